"""Benchmark megalite's Triton kernels against PyTorch eager, torch.compile and Liger-Kernel.

    python tools/bench_kernels.py                 # full sweep on a GPU (minutes)
    python tools/bench_kernels.py --quick         # one training shape per op
    python tools/bench_kernels.py --csv out.csv   # also write every row as CSV
    python tools/bench_kernels.py --ops rms_norm,attention

Each (op, shape) is timed forward and forward+backward with `triton.testing.do_bench`
(median) for every provider: `megalite` (the Triton kernels), `eager` (the plain-PyTorch
reference beside each kernel), `compile` (torch.compile of that reference) and `liger`
(when liger_kernel is importable and has the op). Memory-bound ops report GB/s of the
minimum traffic (each input read once, each output written once) and its percentage of the
device-to-device copy bandwidth measured at the start of the same run; attention reports
TFLOP/s and its percentage of a bf16 matmul measured in the same run. Ratios `x_eager` and
`x_compile` are eager (compile) time divided by the provider's time: > 1 means faster.

Without a GPU the tool runs only the correctness sweep: every kernel in Triton's interpreter
against its reference on small odd shapes, and says so. Attention tiles are tuned by
`tools/tune_attention.py`. `--smoke-timing` (for testing this
script without a GPU) runs the timing harness on CPU with tiny shapes and a wall-clock timer.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import megalite.kernels as K  # noqa: E402

from bench_kernel_cases import Case, build_cases  # noqa: E402  (tools/ is the script's directory)

__all__ = ["Case", "build_cases", "make_timer", "main"]


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------

def make_timer(smoke: bool, quick: bool):
    if smoke:
        def wall_clock(fn, grad_to_none=None):
            fn()
            times = []
            for _ in range(3):
                for t in grad_to_none or []:
                    t.grad = None
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return 1e3 * sorted(times)[1]
        return wall_clock
    import triton.testing

    warmup, rep = (10, 50) if quick else (25, 100)

    def gpu(fn, grad_to_none=None):
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")
    return gpu


def measure_ceilings(timer, device: str, smoke: bool) -> dict:
    n_bytes = 2**30 if not smoke else 2**22
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    del src, dst
    n = 8192 if not smoke else 256
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    matmul_ms = timer(lambda: a @ b)
    return {"copy_GBps": 2 * n_bytes / copy_ms / 1e6, "matmul_TFLOPs": 2 * n**3 / matmul_ms / 1e9}


def run_case(case: Case, timer, ceilings: dict) -> list[dict]:
    rows = []
    base = dict(op=case.op, shape=case.shape)
    for provider, fn in case.providers.items():
        modes = ("fwd", "fwd+bwd") if case.differentiable else ("step",)
        for mode in modes:
            row = dict(base, provider=provider, mode=mode, median_ms=math.nan, rate=math.nan, pct_of_ceiling=math.nan,
                       error="")
            try:
                inputs = case.make_inputs()
                leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
                if mode == "fwd+bwd":
                    grad = torch.randn_like(fn(*inputs).float()).to(fn(*inputs).dtype)

                    def step(fn=fn, inputs=inputs, grad=grad):
                        fn(*inputs).backward(grad)
                    ms = timer(step, grad_to_none=leaves)
                else:
                    ms = timer(lambda fn=fn, inputs=inputs: fn(*inputs))
                units = case.fwd_bwd_units if mode == "fwd+bwd" else case.fwd_units
                rate = units / ms / (1e9 if case.flops else 1e6)  # TFLOP/s or GB/s
                ceiling = ceilings["matmul_TFLOPs" if case.flops else "copy_GBps"]
                row.update(median_ms=ms, rate=rate, pct_of_ceiling=100 * rate / ceiling)
            except Exception as exc:  # noqa: BLE001 - one failing provider must not stop the sweep
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            finally:
                inputs = leaves = None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            rows.append(row)
    for row in rows:  # ratios against eager and compile of the same op, shape and mode
        for baseline in ("eager", "compile"):
            ref = next((r for r in rows if r["provider"] == baseline and r["mode"] == row["mode"]), None)
            ok = ref is not None and not ref["error"] and not row["error"]
            row[f"x_{baseline}"] = ref["median_ms"] / row["median_ms"] if ok else math.nan
    return rows


def print_row(row: dict, flops: bool) -> None:
    unit = "TFLOP/s" if flops else "GB/s"
    if row["error"]:
        print(f"  {row['provider']:14s} {row['mode']:8s} ERROR {row['error']}")
        return
    print(f"  {row['provider']:14s} {row['mode']:8s} {row['median_ms']:9.3f} ms {row['rate']:9.1f} {unit:7s} "
          f"{row['pct_of_ceiling']:6.1f}% of ceiling  x_eager {row['x_eager']:5.2f}  x_compile {row['x_compile']:5.2f}")


# ------------------------------------------------------------------------------------------------
# Correctness sweep (CPU: Triton's interpreter; GPU: compiled), small odd shapes
# ------------------------------------------------------------------------------------------------

def correctness_sweep(device: str) -> bool:
    os.environ["MEGALITE_KERNEL_BACKEND"] = "triton"
    torch.manual_seed(0)
    cos_sin = torch.rand(9, 16, device=device)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one training shape per op, shorter timing")
    parser.add_argument("--csv", help="write all rows to this CSV file")
    parser.add_argument("--ops", default="rms_norm,layer_norm,gelu,swiglu,rope,cross_entropy,attention,adamw")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--smoke-timing", action="store_true", help="CPU self-test of the timing harness")
    args = parser.parse_args(argv)

    on_gpu = torch.cuda.is_available()
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"device {torch.cuda.get_device_name() if on_gpu else 'cpu (no GPU)'}, command: {' '.join(sys.argv)}")
    if not on_gpu and not args.smoke_timing:
        print("No GPU: running the correctness sweep only (Triton's interpreter vs the references); no timings.\n"
              "(Whether every kernel compiles for a GPU: TRITON_INTERPRET=0 python -m megalite.kernels.compile_check)")
        ok = correctness_sweep("cpu")
        print("correctness sweep:", "all ok" if ok else "FAILURES")
        return 0 if ok else 1
    if on_gpu:
        print("correctness sweep (compiled kernels):")
        if not correctness_sweep("cuda"):
            print("correctness sweep FAILED; timings below are of wrong kernels")
    os.environ["MEGALITE_KERNEL_BACKEND"] = "triton"
    device = "cuda" if on_gpu else "cpu"
    dtype = getattr(torch, args.dtype)
    timer = make_timer(args.smoke_timing, args.quick)
    ceilings = measure_ceilings(timer, device, args.smoke_timing)
    print(f"ceilings: copy {ceilings['copy_GBps']:.0f} GB/s (1 GiB device-to-device), "
          f"bf16 matmul {ceilings['matmul_TFLOPs']:.0f} TFLOP/s (8192^3)")
    ops = set(args.ops.split(","))
    rows = []
    cases = build_cases(ops, args.quick, device, dtype, not args.no_compile, args.smoke_timing)
    for case in cases:
        print(f"{case.op} {case.shape} {args.dtype if case.op != 'adamw' else 'float32'}")
        for row in run_case(case, timer, ceilings):
            print_row(row, case.flops)
            row.update(dtype=args.dtype if case.op != "adamw" else "float32",
                       unit="TFLOP/s" if case.flops else "GB/s",
                       ceiling=ceilings["matmul_TFLOPs" if case.flops else "copy_GBps"],
                       device=torch.cuda.get_device_name() if on_gpu else "cpu", torch=torch.__version__,
                       triton=triton.__version__)
            rows.append(row)
    if args.csv:
        columns = ["device", "torch", "triton", "op", "shape", "dtype", "provider", "mode", "median_ms", "rate", "unit",
                   "pct_of_ceiling", "ceiling", "x_eager", "x_compile", "error"]
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows({c: r.get(c, "") for c in columns} for r in rows)
        print(f"wrote {len(rows)} rows to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
