"""The trainer's console entry (`megalite-train`, examples/pretrain_gpt.py): the stop signals are
handled before torch is imported.

Importing the trainer takes a second or more (torch, triton). A Ctrl-C or SIGTERM in that window
would end in a KeyboardInterrupt traceback or a silent kill; here it ends like a signal during
set-up: one line, exit 128 + the signal's number. Pure Python until the trainer is imported.
"""
from __future__ import annotations

import signal
import sys

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # checkpoint.preemption's, without torch


class _StoppedWhileStarting(BaseException):
    """A stop signal during the imports (BaseException: no `except Exception` in an import swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise(signum, frame):
    raise _StoppedWhileStarting(signum)


def main(argv: list[str] | None = None) -> int:
    """Install the stop handlers, import the trainer, run `megalite.training.loop.main(argv)`."""
    previous = {sig: signal.signal(sig, _raise) for sig in STOP_SIGNALS}
    try:
        from megalite.training.loop import main as train_main  # torch: imported under the handlers above
    except _StoppedWhileStarting as stopped:
        print(f"megalite: {signal.Signals(stopped.signum).name} while starting (before set-up): stopped, nothing "
              f"trained or saved", file=sys.stderr, flush=True)
        return 128 + stopped.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
