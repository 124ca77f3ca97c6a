"""Path arguments checked before any work starts: one problem line naming the flag and the fix.

    problem = output_file_problem("--metrics-file", "run/metrics.jsonl")   # None when it can be written
    problem = output_dir_problem("--profile-dir", "profile")
    problem = output_prefix_problem("--output-prefix", "data/corpus", (".bin", ".idx"))

A file the run writes must not be a directory, and a directory must not be a file; neither may
sit below a file, what already exists must be writable, and a missing directory must be creatable
(probed: made, then removed again, so nothing is left here; it is made when first written). Pure file-system queries:
every rank answers alike for a shared file system, and each rank answers for its own disk.
"""
from __future__ import annotations

import os
from pathlib import Path


def _blocking_ancestor(path: Path) -> Path | None:
    """The first ancestor of `path` that exists and is not a directory (a file where a directory is needed)."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return None


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def _unwritable(path: Path) -> bool:
    return not os.access(_nearest_existing(path), os.W_OK)


def _creation_problem(directory: Path) -> str | None:
    """Why the missing `directory` cannot be made (a file system that refuses it, e.g. /proc), or None.
    The directories made to find out are removed again, innermost first."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    if not missing:
        return None
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        return f"cannot create {exc.filename or directory} ({exc.strerror or exc})"
    for made in missing:  # innermost first; another rank may be probing too: ignore what it removed or filled
        try:
            made.rmdir()
        except OSError:
            break
    return None


def output_file_problem(flag: str, path: str | os.PathLike) -> str | None:
    """Why `path` cannot be written as a file (named by `flag`), or None."""
    p = Path(path)
    blocker = _blocking_ancestor(p)
    if blocker is not None:
        return f"{flag} {path}: {blocker} is a file, not a directory; choose a path inside a directory"
    if p.is_dir():
        return f"{flag} {path} is a directory; {flag} takes a file name (e.g. {p / 'out'})"
    if _unwritable(p):
        return f"{flag} {path}: {_nearest_existing(p)} is not writable by this user; choose another path"
    created = _creation_problem(p.parent)
    return f"{flag} {path}: {created}; choose another path" if created else None


def output_dir_problem(flag: str, path: str | os.PathLike) -> str | None:
    """Why `path` cannot be (created and) written as a directory (named by `flag`), or None."""
    p = Path(path)
    blocker = _blocking_ancestor(p)
    if blocker is not None and blocker != p:
        return f"{flag} {path}: {blocker} is a file, not a directory; choose a path inside a directory"
    if p.exists() and not p.is_dir():
        return f"{flag} {path} is a file; {flag} takes a directory (it is created when missing)"
    if _unwritable(p):
        return f"{flag} {path}: {_nearest_existing(p)} is not writable by this user; choose another directory"
    created = _creation_problem(p)
    return f"{flag} {path}: {created}; choose another directory" if created else None


def output_prefix_problem(flag: str, prefix: str | os.PathLike, suffixes: tuple[str, ...]) -> str | None:
    """Why files `prefix + suffix` cannot be written (a prefix naming a directory, or below a file), or None."""
    p = Path(prefix)
    if p.is_dir() or str(prefix).endswith(os.sep):
        return (f"{flag} {prefix} is a directory; {flag} is the start of the files' names "
                f"(e.g. {p / 'corpus'} writes {p / 'corpus'}{suffixes[0]})")
    for suffix in suffixes:
        problem = output_file_problem(flag, f"{prefix}{suffix}")
        if problem is not None:
            return problem
    return None
