"""The default corpus: Python's own standard-library sources, tokenized like any other corpus.

Used when no --data-path is given, so every install can train on real text without a
download. Files are the stdlib's `.py` sources (from `sysconfig`), site-packages excluded,
in sorted relative-path order, taken until `max_bytes`; each file is one document. They go
through `preprocess_documents`, the same path as tools/preprocess_data.py, into a cache entry
keyed by a hash of the texts and the tokenizer, so a new Python version or tokenizer gets a
new entry and a repeated run reuses the old one.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig

from megalite.data.cache import build_once, cache_root
from megalite.data.preprocess import preprocess_documents

DEFAULT_CORPUS_BYTES = 6_000_000
FORMAT_TAG = b"megalite-default-corpus-v1"
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_documents(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[tuple[str, str]]:
    """[(relative path, text)] of stdlib .py files, sorted by path, at most `max_bytes` in all."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith(".")]
        paths += [os.path.join(directory, n) for n in names if n.endswith(".py")]
    paths.sort(key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))
    documents, total = [], 0
    for path in paths:
        with open(path, "rb") as f:
            raw = f.read()
        if total + len(raw) > max_bytes:
            break
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:  # a few stdlib test files are deliberately not UTF-8
            continue
        if text:
            documents.append((os.path.relpath(path, root).replace(os.sep, "/"), text))
            total += len(raw)
    if not documents:
        raise RuntimeError(f"no Python sources found under the stdlib directory {root}; "
                           f"pass --data-path to a preprocessed corpus instead")
    return documents


def build_default_corpus(tokenizer, cache_dir: str | None = None, max_bytes: int = DEFAULT_CORPUS_BYTES) -> str:
    """Tokenize the stdlib corpus (once per content and tokenizer); return the dataset prefix."""
    documents = stdlib_documents(max_bytes)
    digest = hashlib.sha256(FORMAT_TAG + tokenizer.name.encode())
    for name, text in documents:
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    entry = os.path.join(cache_root(cache_dir), f"stdlib-corpus-{digest.hexdigest()[:20]}")

    def build(tmp_dir: str) -> None:
        stream = (("text", text, len(text)) for _, text in documents)
        preprocess_documents(stream, os.path.join(tmp_dir, "stdlib"), tokenizer, ("text",), workers=1)

    build_once(entry, build)
    return os.path.join(entry, "stdlib")
