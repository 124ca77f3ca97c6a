"""The on-disk cache: where it lives and how concurrent ranks fill it safely.

Entries are directories named by a content hash. A builder writes into a private temporary
directory beside the entry and renames it into place; `rename` of a directory is atomic and
fails when the target already exists, so when 8 ranks build the same entry at once, exactly
one rename wins, the others discard their copy and use the winner's, and no reader ever sees a
half-written entry. No locks, so a crashed rank cannot leave one held.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from typing import Callable


def cache_root(cache_dir: str | None = None) -> str:
    """`cache_dir` if given, else $MEGALITE_CACHE, else ~/.cache/megalite."""
    root = cache_dir or os.environ.get("MEGALITE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                          "megalite")
    os.makedirs(root, exist_ok=True)
    return root


def build_once(entry_dir: str, build: Callable[[str], None]) -> str:
    """Return `entry_dir`, calling `build(tmp_dir)` to create it first when it does not exist."""
    if os.path.isdir(entry_dir):
        return entry_dir
    parent = os.path.dirname(entry_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(entry_dir) + "-", dir=parent)
    try:
        build(tmp_dir)
        try:
            os.rename(tmp_dir, entry_dir)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not os.path.isdir(entry_dir):
                raise
            # another process finished the same entry first; its copy is identical
    finally:
        if os.path.isdir(tmp_dir):
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return entry_dir
