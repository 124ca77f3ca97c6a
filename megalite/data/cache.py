"""The on-disk cache: where it lives and how concurrent ranks fill it safely.

Entries are directories named by a content hash. A builder writes into a private temporary
directory beside the entry and renames it into place; renaming a directory is atomic and
fails when the target already exists, so no reader ever sees a half-written entry and when
several builders race, one rename wins and the others keep the winner's identical copy.

So that 8 ranks do not all do the same work, builders of one entry also take an advisory
`flock` on `<entry>.lock`: the first builds, the others wait and then find the entry. The
kernel drops the lock when its holder dies, so a crashed rank cannot leave it held; where
the filesystem has no flock (some network mounts) everyone builds and the rename decides.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
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


@contextlib.contextmanager
def _exclusive(lock_path: str):
    """Hold an advisory lock on lock_path; a no-op where the filesystem cannot lock."""
    try:
        handle = open(lock_path, "a+b")
    except OSError:
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass  # no locking here: the atomic rename alone keeps the cache correct
        yield  # closing the file releases the lock


def build_once(entry_dir: str, build: Callable[[str], None]) -> str:
    """Return `entry_dir`, calling `build(tmp_dir)` to create it first when it does not exist."""
    if os.path.isdir(entry_dir):
        return entry_dir
    parent = os.path.dirname(entry_dir)
    os.makedirs(parent, exist_ok=True)
    with _exclusive(entry_dir + ".lock"):
        if os.path.isdir(entry_dir):  # another process built it while we waited
            return entry_dir
        tmp_dir = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(entry_dir) + "-", dir=parent)
        try:
            build(tmp_dir)
            try:
                os.rename(tmp_dir, entry_dir)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not os.path.isdir(entry_dir):
                    raise
                # a builder without the lock finished the same entry first; its copy is identical
        finally:
            if os.path.isdir(tmp_dir):
                shutil.rmtree(tmp_dir, ignore_errors=True)
    return entry_dir
