"""examples/pretrain_gpt.py's command line (`megalite-train`): the action its flags choose, and what runs it.

    --simulate                            megalite.simulate.run: the layout's world, rank by rank, in
                                          this process, beside the planner (docs/simulate.md)
    --dry-run, --print-config, or a run   megalite.training.loop

The actions are flags of the one parser (megalite/cli.py). They are told apart here, above both the
training loop and the simulator (which runs the loop's own builders on a fake world), so neither
imports the other's caller. A mistake is one line, exit code 2, as everywhere.

The stop signals are handled before torch is imported: importing the trainer takes a second or more
(torch, triton), and a Ctrl-C or SIGTERM in that window would end in a KeyboardInterrupt traceback or
a silent kill; here it ends like a signal during set-up: one line, exit 128 + the signal's number. This
module is pure Python until the trainer is imported.
"""
from __future__ import annotations

import os
import signal
import sys

from megalite.cli import given_settings, parse_args
from megalite.errors import UsageError, report_usage_error

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # checkpoint.preemption's, without torch


class _StoppedWhileStarting(BaseException):
    """A stop signal during the imports (BaseException: no `except Exception` in an import swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise(signum, frame):
    raise _StoppedWhileStarting(signum)


def _import_actions():
    """(the simulator's main, the training loop's main), imported under the stop handlers."""
    previous = {sig: signal.signal(sig, _raise) for sig in STOP_SIGNALS}
    try:
        from megalite.simulate.run import main as simulate_main  # torch: imported under the stop handlers
        from megalite.training.loop import main as train_main  # torch: imported under the stop handlers
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return simulate_main, train_main


def main(argv: list[str] | None = None) -> int:
    """Parse the flags; --simulate runs the simulator, anything else the training loop's `main`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg, actions = parse_args(argv)
    except UsageError as exc:
        return report_usage_error(exc, int(os.environ.get("RANK", "0")))
    try:
        simulate_main, train_main = _import_actions()
    except _StoppedWhileStarting as stopped:
        print(f"megalite: {signal.Signals(stopped.signum).name} while starting (before set-up): stopped, nothing "
              f"trained or saved", file=sys.stderr, flush=True)
        return 128 + stopped.signum
    if actions["simulate"]:  # a named preset keeps its own vocabulary there, as in a run
        return simulate_main(cfg, actions, preset_given="model" in given_settings(argv))
    return train_main(argv)


if __name__ == "__main__":  # python -m megalite.commands: the same as megalite-train and examples/pretrain_gpt.py
    sys.exit(main())
