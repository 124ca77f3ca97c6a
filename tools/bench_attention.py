"""Our Triton flash attention against torch's SDPA, forward + backward: issue 36's first goal.

    python tools/bench_attention.py                                   # d 64 and 128, s 1k-16k, bf16 causal GQA 4:1
    python tools/bench_attention.py --tables OUT/attention_tables.json   # with the tiles tune_attention just wrote
    python tools/bench_attention.py --smoke                           # CPU self-test (interpreter, tiny shapes)

Shapes and timing are tune_attention's (its `attention_inputs`, `make_timer` and `measure_dispatch`:
16384 tokens per call, 4096 / d query heads over a quarter as many kv heads, q, k, v as [b, h, s, d]
views of [s, b, h, d] activations, `triton.testing.do_bench` medians), so the two tools cannot
disagree on what they time. At every (d, s) the ratio is the faster SDPA's time (kv heads repeated,
or `enable_gqa`) over ours: >= 1.0 is ours faster, for each of our backward variants (split: a dK/dV
then a dQ launch; fused: one grid; kernels/flash_attention_backward.py). Prints the lowest ratio
and the geometric mean and one GOAL line per variant (goal: >= 1.0 at every shape, so that dropout
and ring attention, which always run our kernels, run at the fastest speed there is). Not a test: it asserts no time.
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import json
import math
import os
import sys

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_attention  # noqa: E402  - the shapes, the timer and the sweep measured the same way
from megalite.cli import OneLineParser  # noqa: E402
from megalite.errors import reports_usage_errors  # noqa: E402

SEQS = [1024, 2048, 4096, 8192, 16384]


def ratios(table: dict[int, dict[int, dict[str, float]]], ours: str = "triton") -> list[tuple[int, int, float]]:
    """[(head dim, seq, faster SDPA ms / ours ms)] from {d: {seq: {implementation: ms}}}; `ours` names
    our kernels' row ("triton": the split backward, "triton_fused": the fused one)."""
    rows = []
    for head_dim, by_seq in table.items():
        for seq, times in by_seq.items():
            sdpa = [ms for name, ms in times.items() if name.startswith("sdpa")]
            if ours in times and sdpa:
                rows.append((head_dim, seq, min(sdpa) / times[ours]))
    return rows


def goal_line(rows: list[tuple[int, int, float]], label: str) -> str:
    if not rows:
        return f"GOAL bench_attention {label}: ours >= 1.0x the faster SDPA | measured nothing (every run failed) | NOT met"
    low = min(rows, key=lambda r: r[2])
    geomean = math.exp(sum(math.log(r[2]) for r in rows) / len(rows))
    return (f"GOAL bench_attention {label}: ours fwd+bwd >= 1.0x the faster SDPA at every shape | measured lowest "
            f"{low[2]:.2f}x (d={low[0]} s={low[1]}), geomean {geomean:.2f}x over {len(rows)} shapes | "
            f"{'met' if low[2] >= 1.0 else 'NOT met'}")


@reports_usage_errors
def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--seqs", type=int, nargs="*", default=SEQS)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--tables", help="a tune_attention --json file to put in effect first")
    parser.add_argument("--json", help="write {d: {s: {implementation: ms}}} and the ratios here")
    parser.add_argument("--smoke", action="store_true", help="CPU self-test: tiny shapes, interpreter, wall clock")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("bench_attention needs a GPU (or --smoke to test this script on CPU)")
        return 1
    os.environ["MEGALITE_KERNEL_BACKEND"] = "triton"
    if args.tables:
        tune_attention.load_tables(args.tables)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)  # the interpreter has no bf16 dot
    head_dims, seqs = ([16], [24]) if args.smoke else (args.head_dims, args.seqs)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    print(f"{name}, torch {torch.__version__}; {str(dtype).removeprefix('torch.')} causal GQA 4:1, fwd+bwd")
    timer = tune_attention.make_timer(args.smoke)
    table = {d: tune_attention.measure_dispatch(d, seqs, dtype, device, timer, args.smoke) for d in head_dims}
    dims = ",".join(map(str, head_dims))
    label = "smoke" if args.smoke else f"{str(dtype).removeprefix('torch.')} d{dims} s{seqs[0]}-{seqs[-1]}"
    by_variant = {}
    for ours, variant in tune_attention.BACKWARD_OF.items():
        rows = by_variant[variant] = ratios(table, ours)
        print(f"faster SDPA / ours, {variant} backward (>= 1.0: ours faster):")
        for head_dim, seq, ratio in rows:
            print(f"  d={head_dim:4d} s={seq:6d} {ratio:5.2f}x")
    for variant, rows in by_variant.items():  # the split backward's line first: the one every record has
        print(goal_line(rows, label if variant == "split" else f"{label} fused-backward"))
    if args.json:
        json.dump({"ms": table, "ratios": by_variant["split"], "ratios_by_backward": by_variant}, open(args.json, "w"),
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
