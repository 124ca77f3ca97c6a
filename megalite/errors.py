"""The one exception base class for a user's mistake.

    raise UsageError("--data-path corpus: corpus.idx is missing; build the pair with tools/preprocess_data.py")

A `UsageError` is something the person running the job must fix (a flag, a config file, a
file, a directory, a checkpoint), not a bug in megalite. Its message names what is wrong (the
file, the flag, the parameter) and the fix: one line, or one line per problem when a
configuration has several (`ConfigError`). Entry points catch it, print it once per node
(the first local rank of the node to fail; without a launcher, global rank 0 and each node's
local rank 0) without a traceback, and exit with `USAGE_EXIT_CODE`.

The library raises it on every rank with the same message, before training starts wherever it
can (the configuration before any process group exists, data at dataset build time,
checkpoints at load-plan time), so no rank waits in a collective for a rank that gave up.
Subclasses keep a built-in base where callers used to catch that one (e.g.
`CorruptIndexError(UsageError, ValueError)`).
"""
from __future__ import annotations

import functools
import glob
import json
import numbers
import os
import sys
import tempfile
import time
import zlib

USAGE_EXIT_CODE = 2


class UsageError(Exception):
    """A mistake in the job's input (flags, files, directories): one line naming the fix."""


class ConfigError(UsageError, ValueError):
    """A configuration that cannot run: every problem, one per line, each with its fix."""

    @classmethod
    def listing(cls, problems: list[str]) -> "ConfigError":
        """The error of several problems, one `  - problem` line each."""
        return cls("\n".join(f"  - {p}" for p in problems))


class ArgumentTypeError(UsageError, TypeError):
    """A library call given an argument of the wrong type: names the argument and what it takes."""


class ArgumentValueError(UsageError, ValueError):
    """A library call given an argument outside the values it takes: names the argument and those values."""


def positive_int(owner: str, name: str, value) -> int:
    """`value` when it is an int >= 1; else the one-line error naming `owner`'s argument `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy's ints are Integral
        raise ArgumentTypeError(f"{owner}: {name} takes a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ArgumentValueError(f"{owner}: {name} takes a positive int, got {value}")
    return int(value)


def one_line(text: str) -> str:
    """`text` folded onto one line (messages built from several parts, e.g. per-rank reports)."""
    return " ".join(str(text).split())


def report_usage_error(error: UsageError, rank: int, stream=None, local_rank: int | None = None) -> int:
    """What an entry point does with a UsageError: print it once per node, return the exit code.

    Printed once per node, since a problem with a node-local file shows on that node: by the node's
    first failing rank where several local ranks share it (LOCAL_WORLD_SIZE > 1), else by global
    rank 0 and each node's local rank 0 (`local_rank`, default LOCAL_RANK or `rank`). A ConfigError keeps its
    one line per problem; any other is folded onto one line."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    text = usage_text(error)
    write_error_file(text)  # torchrun's report shows this line as the failure's root cause
    marker = _report_marker()
    if marker is None:  # one process per node (or no launcher): global rank 0 and each node's first print
        printer = rank == 0 or local_rank == 0
    else:  # several local ranks: local rank 0 prints; another prints an error no rank claimed within the grace
        claim = f"{marker}-{zlib.crc32(text.encode()):08x}.claim"  # per error: a process may report several
        printer = _claim(claim, wait_s=0.0 if local_rank == 0 else CLAIM_GRACE_S) or local_rank == 0
    if not printer:  # silent here: stay until this node's printer has printed
        _wait_for_report(marker)
        return USAGE_EXIT_CODE
    print(text, file=stream or sys.stderr, flush=True)
    _mark_reported(marker)
    return USAGE_EXIT_CODE


def usage_text(error: UsageError) -> str:
    """What the person sees of a UsageError: one line (a ConfigError of several problems: one per problem)."""
    if isinstance(error, ConfigError) and len(str(error).strip().splitlines()) > 1:
        return f"megalite: configuration error:\n{error}"
    if isinstance(error, ConfigError):  # one problem: one line
        return f"megalite: configuration error: {one_line(error).removeprefix('- ')}"
    return f"megalite: {one_line(error)}"


def write_error_file(text: str) -> None:
    """Fill torchrun's error file (TORCHELASTIC_ERROR_FILE, torch.distributed.elastic's reply file) with
    `text`, so that its ChildFailedError report names megalite's line as the root cause instead of
    'To enable traceback see ...'. Nothing without torchrun; an unwritable file is left alone."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        pass


# A rank that exits at once makes torchrun stop the others, and it could kill the rank about to
# print before it printed: the line never reached the user. Under a launcher with several local
# ranks, one rank of a node claims the report (an exclusive file named by the launching process,
# torchrun's agent: every local rank's parent, the port and the attempt), prints it and marks it
# done; the node's other failing ranks wait (at most REPORT_WAIT_S) for that mark. Local rank 0
# claims at once; another rank claims only when none did within CLAIM_GRACE_S (rank 0 may have no
# error at all: a node-local file only one rank reads), so its line is not lost.
REPORT_WAIT_S = 10.0
CLAIM_GRACE_S = 2.0  # what the other local ranks leave local rank 0 to claim the report first


def _report_marker() -> str | None:
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= 1:
        return None
    key = (f"{os.getppid()}-{os.environ.get('MASTER_PORT', '')}-"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    return os.path.join(tempfile.gettempdir(), f"megalite-reported-{key}")


def _claim(claim: str, wait_s: float = 0.0) -> bool:
    """True for the one rank of the node that creates the claim file first (its error is the one printed),
    after waiting `wait_s` for local rank 0's claim to appear (rank 0 itself waits for nothing; it may
    have no error at all, so the others claim once the grace is over)."""
    deadline = time.monotonic() + wait_s
    while not os.path.exists(claim) and time.monotonic() < deadline:
        time.sleep(0.02)
    for old in glob.glob(os.path.join(os.path.dirname(claim), "megalite-reported-*")):
        try:  # earlier launches' markers (their waiters are long gone)
            if time.time() - os.path.getmtime(old) > 10 * REPORT_WAIT_S:
                os.unlink(old)
        except OSError:
            pass
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    except OSError:  # no temp directory to share: every failing rank prints
        return True
    return True


def _mark_reported(marker: str | None) -> None:
    if marker is None:
        return
    try:
        with open(marker, "w"):
            pass
    except OSError:
        pass


def _wait_for_report(marker: str | None) -> None:
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
