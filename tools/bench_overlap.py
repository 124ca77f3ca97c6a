"""How much of the ZeRO parameter all-gather --overlap-param-gather hides in the real training step.

Runs the training loop (megalite.training.loop.main, what examples/pretrain_gpt.py runs) on
`--dp` forked gloo ranks with ZeRO-1, three ways, alternating so machine load hits all alike:

- `no overlap`: step() waits for every bucket's gather before it returns (the baseline: its
  wait is the exposed gather time);
- `overlap`: the gathers run behind the next forward; each read waits only for its bucket;
- `overlap, tokens first`: as before this redesign, the step's token-count all-reduce is waited
  for at the start of the step. On one process group collectives complete in order, so that
  wait is a wait for every gather queued before it.

Printed per mode: the median over steps of the host seconds blocked waiting for gathers
(`exposed_param_gather_s`, plus `exposed_token_count_s`: the token count's all-reduce is queued
behind the gathers, so its wait is theirs), the step time, and the hidden fraction of the
baseline's wait: 1 - exposed / exposed(no overlap). Timings are host wall-clock on shared CPUs: compare within
one run only.

    python tools/bench_overlap.py --dp 2 --hidden-size 256 --num-layers 4 --bucket-size 200000
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.testing import run_distributed  # noqa: E402
from megalite.training.metrics_file import read_records  # noqa: E402

MODES = {"no overlap": [], "overlap": ["--overlap-param-gather"],
         "overlap, tokens first": ["--overlap-param-gather"]}
from megalite.errors import reports_usage_errors  # noqa: E402
from megalite.cli import OneLineParser  # noqa: E402
from megalite.training import loop, step


def _run_rank(argv: list[str], tokens_first: bool) -> int:
    if tokens_first:  # the previous train step: the token count waited for before the first forward
        real_init = step.GlobalTokens.__init__

        def waiting_init(self, microbatches, mesh):
            real_init(self, microbatches, mesh)
            self._wait()

        step.GlobalTokens.__init__ = waiting_init
    return loop.main(argv)


def _medians(path: str, warmup: int) -> dict[str, float]:
    rows = read_records(path)
    rows = [r for r in rows if "loss" in r and r["step"] > warmup]
    return {"gather_wait_s": statistics.median(r["exposed_param_gather_s"] + r["exposed_token_count_s"] for r in rows),
            "step_time_s": statistics.median(r["step_time_s"] for r in rows), "last_loss": rows[-1]["loss"]}


@reports_usage_errors
def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--bucket-size", type=int, default=200_000, help="elements per bucket")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    common = ["--dp", str(args.dp), "--zero", "1", "--hidden-size", str(args.hidden_size), "--num-layers",
              str(args.num_layers), "--seq-length", str(args.seq_length), "--micro-batch-size",
              str(args.micro_batch_size), "--ddp-bucket-size", str(args.bucket_size), "--train-iters",
              str(args.steps), "--log-interval", "1", "--eval-iters", "0"]
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for mode, flags in MODES.items():
                path = os.path.join(tmp, f"{repeat}_{mode.replace(' ', '_').replace(',', '')}.jsonl")
                run_distributed(_run_rank, args.dp, common + flags + ["--metrics-file", path],
                                mode == "overlap, tokens first", timeout_s=1800)
                results[mode].append(_medians(path, args.warmup))
    base = statistics.median(r["gather_wait_s"] for r in results["no overlap"])
    print(f"# bench_overlap: dp={args.dp} zero=1 h={args.hidden_size} layers={args.num_layers} "
          f"seq={args.seq_length} micro={args.micro_batch_size} bucket={args.bucket_size} elements, "
          f"{args.steps} steps ({args.warmup} warm-up) x {args.repeats} repeats, gloo, {os.cpu_count()} cpus")
    print(f"{'mode':<24} {'gather wait ms':>15} {'step ms':>9} {'hidden':>8} {'final loss':>12}")
    for mode, runs in results.items():
        wait = statistics.median(r["gather_wait_s"] for r in runs)
        step_time = statistics.median(r["step_time_s"] for r in runs)
        hidden = 1.0 - wait / base if base > 0 else float("nan")
        print(f"{mode:<24} {1e3 * wait:>15.2f} {1e3 * step_time:>9.1f} {100 * hidden:>7.0f}% "
              f"{runs[-1]['last_loss']:>12.6f}")


if __name__ == "__main__":
    main()
