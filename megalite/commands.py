"""examples/pretrain_gpt.py's command line: the action its flags choose, and what runs it.

    --simulate                            megalite.simulate.run: the layout's world, rank by rank, in
                                          this process, beside the planner (docs/simulate.md)
    --dry-run, --print-config, or a run   megalite.training.loop

The actions are flags of the one parser (megalite/cli.py). They are told apart here, above both the
training loop and the simulator (which runs the loop's own builders on a fake world), so neither
imports the other's caller. A mistake is one line, exit code 2, as everywhere.
"""
from __future__ import annotations

import os
import sys

from megalite.cli import parse_args
from megalite.errors import UsageError, report_usage_error
from megalite.simulate import run as simulate_run
from megalite.training import loop


def main(argv: list[str] | None = None) -> int:
    """Parse the flags; --simulate runs the simulator, anything else the training loop's `main`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg, actions = parse_args(argv)
    except UsageError as exc:
        return report_usage_error(exc, int(os.environ.get("RANK", "0")))
    if actions["simulate"]:
        return simulate_run.main(cfg, actions)
    return loop.main(argv)


if __name__ == "__main__":  # python -m megalite.commands: the same as megalite-train and examples/pretrain_gpt.py
    sys.exit(main())
