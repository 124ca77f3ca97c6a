"""Benchmark megalite's Triton kernels against PyTorch eager, torch.compile, Liger-Kernel and SDPA.

    python tools/bench_kernels.py                 # full sweep on a GPU
    python tools/bench_kernels.py --quick         # one training shape per op (two for attention)
    python tools/bench_kernels.py --csv out.csv   # also write every row as CSV
    python tools/bench_kernels.py --ops rms_norm,attention

Each (op, shape) is timed forward and forward+backward for every provider: `megalite` (the
Triton kernels), `eager` (the plain-PyTorch reference beside each kernel), `compile`
(torch.compile of that reference) and `liger` (when liger_kernel is importable and has the op:
`pip install 'megalite[liger]'`).
Attention instead has `megalite`, `auto` (megalite.kernels.attention under the default dispatch:
what training calls), `sdpa` (torch's SDPA with k, v heads repeated), `sdpa-gqa` (SDPA's
enable_gqa, where this torch has it) and, with --quick only, `compile`; its inputs are laid out
as the model passes them (permuted views of [s, b, heads, d]). The mixture-of-experts ops
(tools/bench_moe_kernel_cases.py) time the grouped GEMM against a loop of per-expert matmuls
(`x_loop`) and torch._grouped_mm where this torch has it (`x_torch_grouped_mm`), and the token
permute / unpermute against their references.

Every row has two times (tools/bench_kernel_timing.py): gpu_ms, CUDA-graph replay (the kernels
alone), and host_ms, do_bench's events around each eager call (what an eager caller pays); a row
is marked host-bound when host_ms > 1.15 x gpu_ms, and its `timing` says `events` when the call
could not be captured (gpu_ms is then host_ms). Rates, % of ceiling and ratios use gpu_ms.
Memory-bound ops report GB/s of the minimum traffic (each input read once, each output written
once) and its % of the device-to-device copy bandwidth; attention reports TFLOP/s and its % of a
bf16 matmul; both ceilings are measured at the start of the same run with graph replay. Ratios
`x_eager`, `x_compile` and `x_sdpa` are that baseline's gpu_ms over the row's: > 1 means faster.
The run ends with one line per goal of GOALS: measured, goal, met or NOT met (never asserted).

Without a GPU the tool runs only the correctness sweep: every kernel in Triton's interpreter
against its reference on small odd shapes, and says so. Attention tiles are tuned by
`tools/tune_attention.py`. `--smoke-timing` (for testing this script without a GPU) runs the
timing harness on CPU with tiny shapes, both clocks being the wall clock.
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import csv
import json
import math
import os
import sys
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import megalite.kernels as K  # noqa: E402

# tools/ is the script's directory
from bench_kernel_cases import Case, attention_inputs, build_cases, kernel_backend  # noqa: E402
from bench_kernel_timing import Timers, make_timer, make_timers, measure_ceilings, time_both  # noqa: E402

__all__ = ["Case", "GOALS", "Goal", "attention_inputs", "build_cases", "goal_lines", "main", "make_timer",
           "run_case"]
from megalite.errors import reports_usage_errors  # noqa: E402
from megalite.cli import OneLineParser  # noqa: E402
import tune_attention  # noqa: E402
import tune_norms  # noqa: E402


# ------------------------------------------------------------------------------------------------
# Goals: each declared once here; the summary prints one line per goal (never asserted)
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Goal:
    """A target that every matching row must reach: the worst matching row is the measured figure."""
    name: str
    metric: str  # a row column computed from gpu_ms: pct_of_ceiling, x_compile or x_sdpa
    target: float  # met when the worst matching row's metric >= target
    ops: tuple[str, ...]
    providers: tuple[str, ...] = ("megalite",)
    modes: tuple[str, ...] = ("fwd+bwd",)
    shape: str | None = None  # None: every shape of these ops


MEMORY_BOUND_OPS = ("rms_norm", "layer_norm", "bias_gelu", "swiglu", "rope", "cross_entropy", "adamw")
GOALS = (
    Goal("rms_norm fwd+bwd 8192x4096: % of copy", "pct_of_ceiling", 60, ("rms_norm",), shape="8192x4096"),
    Goal("layer_norm fwd+bwd 8192x4096: % of copy", "pct_of_ceiling", 60, ("layer_norm",), shape="8192x4096"),
    Goal("rope fwd+bwd: % of copy", "pct_of_ceiling", 60, ("rope",)),
    Goal("every megalite memory-bound row: x torch.compile", "x_compile", 1.0, MEMORY_BOUND_OPS,
         modes=("fwd", "fwd+bwd", "step")),
    Goal("attention auto fwd+bwd, every shape: x sdpa", "x_sdpa", 1.0, ("attention",), providers=("auto",)),
    Goal("attention megalite (Triton) fwd+bwd, every shape: x sdpa", "x_sdpa", 0.8, ("attention",)),
    Goal("grouped_mm fwd+bwd: x a loop of per-expert matmuls", "x_loop", 1.0, ("grouped_mm",)),
    Goal("grouped_mm fwd+bwd: x torch._grouped_mm", "x_torch_grouped_mm", 0.8, ("grouped_mm",)),
)


def goal_lines(rows: list[dict], goals: tuple[Goal, ...] = GOALS) -> list[str]:
    """One line per goal: the worst matching row's figure, the goal, met / NOT met / not measured."""
    lines = []
    for goal in goals:
        matching = [r for r in rows if r["op"] in goal.ops and r["provider"] in goal.providers
                    and r["mode"] in goal.modes and goal.shape in (None, r["shape"])
                    and math.isfinite(r.get(goal.metric, math.nan))]
        if not matching:
            lines.append(f"  {goal.name:56s}       -  goal >= {goal.target:<4g} not measured")
            continue
        worst = min(matching, key=lambda r: r[goal.metric])
        verdict = "met" if worst[goal.metric] >= goal.target else "NOT met"
        where = ""
        if len(matching) > 1:
            where = f"  (worst of {len(matching)}: {worst['op']} {worst['shape']} {worst['mode']})"
        lines.append(f"  {goal.name:56s} {worst[goal.metric]:7.2f}  goal >= {goal.target:<4g} {verdict}{where}")
    return lines


# ------------------------------------------------------------------------------------------------
# One case: every (provider, mode) row, both clocks, ratios
# ------------------------------------------------------------------------------------------------

def run_case(case: Case, timers: Timers, ceilings: dict) -> list[dict]:
    """Every (provider, mode) row of one case, with ratios against eager, compile and sdpa (and the
    case's own baselines, e.g. the MoE cases' loop of per-expert matmuls)."""
    rows = [_time_row(case, provider, fn, mode, timers, ceilings)
            for provider, fn in case.providers.items() for mode in case.modes]
    for row in rows:  # same op, shape and mode; kernels-only times
        row["extra_baselines"] = case.extra.get("baselines", ())
        for baseline in ("eager", "compile", "sdpa", *row["extra_baselines"]):
            ref = next((r for r in rows if r["provider"] == baseline and r["mode"] == row["mode"]), None)
            ok = ref is not None and not ref["error"] and not row["error"]
            row[f"x_{baseline}"] = ref["gpu_ms"] / row["gpu_ms"] if ok else math.nan
    return rows


def _time_row(case: Case, provider: str, fn, mode: str, timers: Timers, ceilings: dict) -> dict:
    row = dict(op=case.op, shape=case.shape, provider=provider, mode=mode, gpu_ms=math.nan, host_ms=math.nan,
               median_ms=math.nan, timing="", host_bound=None, rate=math.nan, pct_of_ceiling=math.nan, note="",
               error="")
    try:
        timing = _measure(case, fn, mode, timers)
        units = case.fwd_bwd_units if mode == "fwd+bwd" else case.fwd_units
        rate = units / timing.gpu_ms / (1e9 if case.flops else 1e6)  # TFLOP/s or GB/s
        ceiling = ceilings["matmul_TFLOPs" if case.flops else "copy_GBps"]
        row.update(gpu_ms=timing.gpu_ms, host_ms=timing.host_ms, median_ms=timing.gpu_ms, timing=timing.timing,
                   host_bound=timing.host_bound, rate=rate, pct_of_ceiling=100 * rate / ceiling, note=timing.note)
    except Exception as exc:  # noqa: BLE001 - one failing provider must not stop the sweep
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    if torch.cuda.is_available():  # the inputs died with _measure's frame
        torch.cuda.empty_cache()
    return row


def _measure(case: Case, fn, mode: str, timers: Timers):
    """Both clocks for one provider and mode, on fresh inputs (freed when this returns)."""
    inputs = case.make_inputs()
    if mode != "fwd+bwd":
        return time_both(lambda: fn(*inputs), None, timers)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grad = torch.randn_like(fn(*inputs))  # the output's gradient, made once, outside the timed calls

    def forward_backward():
        with kernel_backend(getattr(fn, "kernel_backend", None)):  # the provider's backend over backward too
            fn(*inputs).backward(grad)
    return time_both(forward_backward, leaves, timers)


def too_big(case: Case) -> str:
    """Why a case cannot run on this GPU ('' when it fits or was not estimated)."""
    if not torch.cuda.is_available() or not case.memory_bytes:
        return ""
    free, _ = torch.cuda.mem_get_info()
    if case.memory_bytes <= 0.9 * free:
        return ""
    return f"skipped: needs ~{case.memory_bytes / 1e9:.1f} GB, {free / 1e9:.1f} GB free"


def print_header(flops: bool) -> None:
    unit = "TFLOP/s" if flops else "GB/s"
    print(f"  {'provider':14s} {'mode':8s} {'gpu_ms':>9s} {'host_ms':>9s} {'timing':6s} {unit:>9s} {'%ceil':>6s} "
          f"{'x_eager':>8s} {'x_compile':>9s} {'x_sdpa':>7s}")


def print_row(row: dict) -> None:
    if row["error"]:
        print(f"  {row['provider']:14s} {row['mode']:8s} ERROR {row['error']}")
        return
    ratios = " ".join(f"{row[f'x_{b}']:{w}.2f}" if math.isfinite(row[f"x_{b}"]) else f"{'-':>{w}s}"
                      for b, w in (("eager", 8), ("compile", 9), ("sdpa", 7)))
    ratios += "".join(f"  x_{b} {row[f'x_{b}']:.2f}" for b in row.get("extra_baselines", ())
                      if math.isfinite(row[f"x_{b}"]))
    flags = ("  host-bound" if row["host_bound"] else "") + (f"  [{row['note']}]" if row["note"] else "")
    print(f"  {row['provider']:14s} {row['mode']:8s} {row['gpu_ms']:9.3f} {row['host_ms']:9.3f} {row['timing']:6s} "
          f"{row['rate']:9.1f} {row['pct_of_ceiling']:5.1f}% {ratios}{flags}")


# ------------------------------------------------------------------------------------------------
# Correctness sweep (CPU: Triton's interpreter; GPU: compiled), small odd shapes
# ------------------------------------------------------------------------------------------------

def correctness_sweep(device: str) -> bool:
    os.environ["MEGALITE_KERNEL_BACKEND"] = "triton"
    torch.manual_seed(0)
    cos_sin = torch.rand(9, 16, device=device)
    group_sizes = torch.tensor([5, 0, 22, 0])  # two experts without rows
    expert_ids = torch.tensor([[2, 0], [0, -1], [3, 1], [0, 2], [-1, -1], [1, 3], [2, 0], [0, 2], [3, 0]],
                              device=device)  # 9 tokens top-2 over 4 experts, a token and a slot dropped
    cases = {
        "rms_norm": (K.rms_norm, K.rms_norm_reference, lambda dt: [torch.randn(7, 100, dtype=dt), torch.randn(100, dtype=dt)]),
        "layer_norm": (K.layer_norm, K.layer_norm_reference,
                       lambda dt: [torch.randn(7, 100, dtype=dt), torch.randn(100, dtype=dt), torch.randn(100, dtype=dt)]),
        "bias_gelu": (K.bias_gelu, K.bias_gelu_reference, lambda dt: [torch.randn(7, 300, dtype=dt), torch.randn(300, dtype=dt)]),
        "swiglu": (K.swiglu, K.swiglu_reference, lambda dt: [torch.randn(7, 300, dtype=dt), torch.randn(7, 300, dtype=dt)]),
        "rope": (lambda x: K.rope(x, cos_sin.cos(), cos_sin.sin()), lambda x: K.rope_reference(x, cos_sin.cos(), cos_sin.sin()),
                 lambda dt: [torch.randn(9, 2, 3, 16, dtype=dt)]),
        "cross_entropy": (K.cross_entropy, K.cross_entropy_reference,
                          lambda dt: [torch.randn(7, 1000, dtype=dt) * 3, torch.randint(0, 1000, (7,))]),
        "attention": (K.attention, K.attention_reference,
                      lambda dt: [torch.randn(1, 4, 37, 32, dtype=dt), torch.randn(1, 2, 37, 32, dtype=dt),
                                  torch.randn(1, 2, 37, 32, dtype=dt)]),
        "grouped_mm": (lambda x, w: K.grouped_mm(x, w, group_sizes.to(x.device)),
                       lambda x, w: K.grouped_mm_reference(x, w, group_sizes.to(x.device)),
                       lambda dt: [torch.randn(27, 40, dtype=dt), torch.randn(4, 40, 24, dtype=dt) / 6]),
        "moe_permute": (lambda x, w: _moe_round_trip(K.permute_tokens, K.unpermute_tokens, x, w, expert_ids),
                        lambda x, w: _moe_round_trip(K.permute_tokens_reference, K.unpermute_tokens_reference, x, w,
                                                     expert_ids),
                        lambda dt: [torch.randn(9, 40, dtype=dt), torch.rand(9, 2, dtype=dt)]),
    }
    tolerances = {torch.float32: 2e-5, torch.float16: 1e-2}
    all_ok = True
    for name, (kernel, reference, make) in cases.items():
        for dtype, tol in tolerances.items():
            inputs = [t.to(device) for t in make(dtype)]
            k_in = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
            r_in = [(t.float() if t.is_floating_point() else t).clone().requires_grad_(t.is_floating_point())
                    for t in inputs]
            out, expected = kernel(*k_in), reference(*r_in)
            grad = torch.randn_like(expected)
            out.backward(grad.to(out.dtype))
            expected.backward(grad)
            errors = [(out.float() - expected).abs().max().item()]
            errors += [(a.grad.float() - b.grad).abs().max().item() for a, b in zip(k_in, r_in) if b.grad is not None]
            scale = max(1.0, expected.abs().max().item())
            ok = all(e <= tol * scale * 4 for e in errors)
            all_ok &= ok
            print(f"  {name:14s} {str(dtype).replace('torch.', ''):8s} max |err| out/grads "
                  f"{' '.join(f'{e:.1e}' for e in errors):40s} {'ok' if ok else 'FAIL'}")
    return all_ok


def _moe_round_trip(permute, unpermute, x, weights, expert_ids):
    """permute -> an elementwise "expert" -> unpermute: [T, H] -> [T, H]."""
    permuted, sorted_index, _ = permute(x, expert_ids, 4)
    return unpermute(permuted * 1.5, sorted_index, weights, x.shape[0])


CSV_COLUMNS = ["device", "torch", "triton", "command", "op", "shape", "dtype", "provider", "mode", "gpu_ms",
               "host_ms", "timing", "host_bound", "median_ms", "rate", "unit", "pct_of_ceiling", "ceiling", "x_eager",
               "x_compile", "x_sdpa", "x_loop", "x_torch_grouped_mm", "note",
               "error"]  # median_ms = gpu_ms, kept for readers of older CSVs


@reports_usage_errors
def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one training shape per op, shorter timing")
    parser.add_argument("--csv", help="write all rows to this CSV file")
    parser.add_argument("--ops", default="rms_norm,layer_norm,gelu,swiglu,rope,cross_entropy,attention,adamw,"
                                         "grouped_mm,moe_permute")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--smoke-timing", action="store_true", help="CPU self-test of the timing harness")
    parser.add_argument("--no-correctness", action="store_true", help="skip the compiled correctness sweep (the "
                        "GPU plan runs tests/kernels first)")
    parser.add_argument("--tables", nargs="*", default=[], help="JSON tables written by tools/tune_attention.py "
                        "--json or tools/tune_norms.py --json: time with them in effect (as if pasted)")
    args = parser.parse_args(argv)
    for path in args.tables:
        load_tables(path)

    on_gpu = torch.cuda.is_available()
    import triton  # optional (Linux only, setup.py): the kernels run their references without it

    run_info = dict(device=torch.cuda.get_device_name() if on_gpu else "cpu", torch=torch.__version__,
                    triton=triton.__version__, command=" ".join(sys.argv))
    print(f"torch {run_info['torch']}, triton {run_info['triton']}, device "
          f"{run_info['device'] if on_gpu else 'cpu (no GPU)'}, command: {run_info['command']}")
    if not on_gpu and not args.smoke_timing:
        print("No GPU: running the correctness sweep only (Triton's interpreter vs the references); no timings.\n"
              "(Whether every kernel compiles for a GPU: TRITON_INTERPRET=0 python -m megalite.kernels.compile_check)")
        ok = correctness_sweep("cpu")
        print("correctness sweep:", "all ok" if ok else "FAILURES")
        return 0 if ok else 1
    if on_gpu and not args.no_correctness:
        print("correctness sweep (compiled kernels):")
        if not correctness_sweep("cuda"):
            print("correctness sweep FAILED; timings below are of wrong kernels")
    os.environ["MEGALITE_KERNEL_BACKEND"] = "triton"
    device = "cuda" if on_gpu else "cpu"
    timers = make_timers(args.smoke_timing, args.quick)
    ceilings = measure_ceilings(timers, device, args.smoke_timing)
    print(f"ceilings ({ceilings['timing']}): copy {ceilings['copy_GBps']:.0f} GB/s (1 GiB device-to-device), "
          f"bf16 matmul {ceilings['matmul_TFLOPs']:.0f} TFLOP/s (8192^3)")
    print("gpu_ms: CUDA-graph replay, kernels only (rates, % of ceiling and x_ ratios use it); host_ms: events "
          "around each eager call; host-bound: host_ms > 1.15 x gpu_ms" if not args.smoke_timing else
          "--smoke-timing: gpu_ms and host_ms are both the wall clock (tests the harness, not speed)")
    rows = run_cases(build_cases(set(args.ops.split(",")), args.quick, device, getattr(torch, args.dtype),
                                 not args.no_compile, args.smoke_timing), timers, ceilings, args.dtype, run_info)
    print("goals (from gpu_ms; printed, never asserted):")
    print("\n".join(goal_lines(rows)))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            writer.writerows({c: r.get(c, "") for c in CSV_COLUMNS} for r in rows)
        print(f"wrote {len(rows)} rows to {args.csv}")
    return 0


def load_tables(path: str) -> None:
    """Put a tuning tool's measured tables in effect in this process (tools/ is the script's directory)."""
    saved = json.load(open(path))
    (tune_norms.load_tables if "norm_tables" in saved else tune_attention.load_tables)(path)
    print(f"tables from {path} in effect: {', '.join(saved)}")


def run_cases(cases: list[Case], timers: Timers, ceilings: dict, dtype_name: str, run_info: dict) -> list[dict]:
    """Time and print every case (skipping those the GPU has no memory for); the rows, for CSV and goals."""
    rows = []
    for case in cases:
        dtype = dtype_name if case.op != "adamw" else "float32"
        print(f"{case.op} {case.shape} {dtype}")
        skip = too_big(case)
        if skip:
            print(f"  {skip}")
            continue
        print_header(case.flops)
        for row in run_case(case, timers, ceilings):
            print_row(row)
            row.update(run_info, dtype=dtype, unit="TFLOP/s" if case.flops else "GB/s",
                       ceiling=ceilings["matmul_TFLOPs" if case.flops else "copy_GBps"])
            rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
