"""The one exception base class for a user's mistake.

    raise UsageError("--data-path corpus: corpus.idx is missing; build the pair with tools/preprocess_data.py")

A `UsageError` is something the person running the job must fix (a flag, a file, a
directory), not a bug in megalite. Its message is one line that names what is wrong (the
file, the flag, the parameter) and the fix. Entry points catch it, print the message once
(rank 0) without a traceback, and exit with `USAGE_EXIT_CODE`.

The library raises it on every rank with the same message, before training starts wherever it
can (data at dataset build time, checkpoints at load-plan time), so no rank waits in a
collective for a rank that gave up. Subclasses keep a built-in base where callers used to
catch that one (e.g. `CorruptIndexError(UsageError, ValueError)`).
"""
from __future__ import annotations

USAGE_EXIT_CODE = 2


class UsageError(Exception):
    """A mistake in the job's input (flags, files, directories): one line naming the fix."""


def one_line(text: str) -> str:
    """`text` folded onto one line (messages built from several parts, e.g. per-rank reports)."""
    return " ".join(str(text).split())


def report_usage_error(error: UsageError, rank: int, stream=None) -> int:
    """What an entry point does with a UsageError: print it once (rank 0), return the exit code."""
    import sys

    if rank == 0:
        print(f"megalite: {one_line(error)}", file=stream or sys.stderr, flush=True)
    return USAGE_EXIT_CODE
