"""The one exception base class for a user's mistake.

    raise UsageError("--data-path corpus: corpus.idx is missing; build the pair with tools/preprocess_data.py")

A `UsageError` is something the person running the job must fix (a flag, a config file, a
file, a directory, a checkpoint), not a bug in megalite. Its message names what is wrong (the
file, the flag, the parameter) and the fix: one line, or one line per problem when a
configuration has several (`ConfigError`). Entry points catch it, print it once per node
(global rank 0 and each node's local rank 0) without a traceback, and exit with
`USAGE_EXIT_CODE`.

The library raises it on every rank with the same message, before training starts wherever it
can (the configuration before any process group exists, data at dataset build time,
checkpoints at load-plan time), so no rank waits in a collective for a rank that gave up.
Subclasses keep a built-in base where callers used to catch that one (e.g.
`CorruptIndexError(UsageError, ValueError)`).
"""
from __future__ import annotations

import functools
import glob
import os
import sys
import tempfile
import time

USAGE_EXIT_CODE = 2


class UsageError(Exception):
    """A mistake in the job's input (flags, files, directories): one line naming the fix."""


class ConfigError(UsageError, ValueError):
    """A configuration that cannot run: every problem, one per line, each with its fix."""

    @classmethod
    def listing(cls, problems: list[str]) -> "ConfigError":
        """The error of several problems, one `  - problem` line each."""
        return cls("\n".join(f"  - {p}" for p in problems))


def one_line(text: str) -> str:
    """`text` folded onto one line (messages built from several parts, e.g. per-rank reports)."""
    return " ".join(str(text).split())


def report_usage_error(error: UsageError, rank: int, stream=None, local_rank: int | None = None) -> int:
    """What an entry point does with a UsageError: print it once per node, return the exit code.

    Printed by global rank 0 and by each node's local rank 0 (`local_rank`, default LOCAL_RANK or
    `rank`), since a problem with a node-local file shows on that node. A ConfigError keeps its
    one line per problem; any other is folded onto one line."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if rank != 0 and local_rank != 0:  # silent here: stay until this node's printer has printed
        _wait_for_report()
        return USAGE_EXIT_CODE
    if rank == 0 or local_rank == 0:
        if isinstance(error, ConfigError) and len(str(error).strip().splitlines()) > 1:
            print(f"megalite: configuration error:\n{error}", file=stream or sys.stderr, flush=True)
        elif isinstance(error, ConfigError):  # one problem: one line
            problem = one_line(error).removeprefix("- ")
            print(f"megalite: configuration error: {problem}", file=stream or sys.stderr, flush=True)
        else:
            print(f"megalite: {one_line(error)}", file=stream or sys.stderr, flush=True)
        _mark_reported()
    return USAGE_EXIT_CODE


# A rank that exits at once makes torchrun stop the others, and it could kill local rank 0 before
# that one printed: the line never reached the user. The silent ranks of a node therefore wait (at
# most REPORT_WAIT_S) for a marker its local rank 0 writes once it has printed. The marker is named
# by the launching process (torchrun's agent: every local rank's parent), the port and the attempt.
REPORT_WAIT_S = 10.0


def _report_marker() -> str | None:
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= 1:
        return None
    key = (f"{os.getppid()}-{os.environ.get('MASTER_PORT', '')}-"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    return os.path.join(tempfile.gettempdir(), f"megalite-reported-{key}")


def _mark_reported() -> None:
    marker = _report_marker()
    if marker is None:
        return
    for old in glob.glob(os.path.join(os.path.dirname(marker), "megalite-reported-*")):
        try:  # earlier launches' markers (their waiters are long gone)
            if time.time() - os.path.getmtime(old) > 10 * REPORT_WAIT_S:
                os.unlink(old)
        except OSError:
            pass
    try:
        with open(marker, "w"):
            pass
    except OSError:
        pass


def _wait_for_report() -> None:
    marker = _report_marker()
    if marker is None:
        return
    deadline = time.monotonic() + REPORT_WAIT_S
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.02)


# A path the person gave that the file system refuses (a directory where a file is needed, a file
# below a file, a missing input, no permission): their mistake, said in one line like a UsageError.
PATH_ERRORS = (IsADirectoryError, NotADirectoryError, FileNotFoundError, FileExistsError, PermissionError)


def reports_usage_errors(main):
    """Decorate a tool's `main(argv) -> int` so that a UsageError, or an OSError naming a path the
    file system refused, is one line on stderr (once per node) and exit code 2, as the trainer does."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        rank = int(os.environ.get("RANK", "0"))
        try:
            return main(*args, **kwargs)
        except UsageError as exc:
            return report_usage_error(exc, rank)
        except PATH_ERRORS as exc:
            if exc.filename is None:
                raise
            return report_usage_error(UsageError(f"{exc.filename}: {exc.strerror or exc}"), rank)
    return wrapper
