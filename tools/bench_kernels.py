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
from dataclasses import dataclass, field
from typing import Callable

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import megalite.kernels as K  # noqa: E402


@dataclass
class Case:
    op: str
    shape: str
    make_inputs: Callable[[], list]  # fresh inputs; floating ones require grad when differentiable
    providers: dict[str, Callable]
    fwd_units: float  # bytes moved (memory-bound ops) or FLOPs (attention) by the forward
    fwd_bwd_units: float
    flops: bool = False  # units are FLOPs (report TFLOP/s vs matmul) instead of bytes (GB/s vs copy)
    differentiable: bool = True
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------
# Providers
# ------------------------------------------------------------------------------------------------

def _liger(name: str):
    try:
        from liger_kernel.transformers import functional as liger_functional  # type: ignore

        return getattr(liger_functional, name, None)
    except Exception:  # noqa: BLE001 - liger is optional
        return None


def _providers(kernel: Callable, reference: Callable, liger: Callable | None, use_compile: bool) -> dict:
    providers = {"megalite": kernel, "eager": reference}
    if use_compile:
        providers["compile"] = torch.compile(reference, dynamic=False)
    if liger is not None:
        providers["liger"] = liger
    return providers


# ------------------------------------------------------------------------------------------------
# Cases: training-relevant shapes (Llama-7B/8B-like); `smoke` shrinks them for --smoke-timing
# ------------------------------------------------------------------------------------------------

def build_cases(ops: set[str], quick: bool, device: str, dtype: torch.dtype, use_compile: bool,
                smoke: bool) -> list[Case]:
    """Every (op, shape) case of the sweep for the selected `ops`, in the order they are timed."""
    es = torch.tensor([], dtype=dtype).element_size()
    rand = _random_inputs(device, dtype)
    cases: list[Case] = []
    tokens_hidden = [(8192, 4096)] if quick else [(8192, 4096), (8192, 8192)]
    if smoke:
        tokens_hidden = [(64, 96)]
    for tokens, hidden in tokens_hidden:
        cases += _norm_cases(ops, tokens, hidden, es, rand, use_compile)
        cases += _activation_cases(ops, tokens, hidden, es, rand, use_compile, smoke)
    if "rope" in ops:
        cases.append(_rope_case(device, dtype, es, rand, use_compile, smoke))
    if "cross_entropy" in ops:
        cases += _cross_entropy_cases(quick, device, es, rand, use_compile, smoke)
    if "attention" in ops:
        cases += _attention_cases(quick, rand, use_compile, smoke)
    if "adamw" in ops:
        cases.append(_adamw_case(device, smoke))
    return cases


def _random_inputs(device: str, dtype: torch.dtype) -> Callable:
    """rand(*shape): a fresh normal tensor on the benchmark's device, requiring grad unless told."""
    def rand(*shape, grad=True, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt).requires_grad_(grad)
    return rand


def _norm_cases(ops: set[str], tokens: int, hidden: int, es: int, rand: Callable, use_compile: bool) -> list[Case]:
    """RMSNorm and LayerNorm over [tokens, hidden] activations."""
    shape = f"{tokens}x{hidden}"
    rw = tokens * hidden * es  # one activation tensor
    cases = []
    if "rms_norm" in ops:
        rms_norm_liger = _liger("liger_rms_norm")
        cases.append(Case("rms_norm", shape, lambda t=tokens, h=hidden: [rand(t, h), rand(h)],
                          _providers(K.rms_norm, K.rms_norm_reference,
                                     (lambda x, w: rms_norm_liger(x, w, 1e-6)) if rms_norm_liger else None,
                                     use_compile),
                          2 * rw, 5 * rw))  # fwd: x, y; bwd: x, dy, dx
    if "layer_norm" in ops:
        layer_norm_liger = _liger("liger_layer_norm")
        cases.append(Case("layer_norm", shape, lambda t=tokens, h=hidden: [rand(t, h), rand(h), rand(h)],
                          _providers(K.layer_norm, K.layer_norm_reference,
                                     (lambda x, w, b: layer_norm_liger(x, w, b, 1e-5)) if layer_norm_liger else None,
                                     use_compile),
                          2 * rw, 5 * rw))
    return cases


def _activation_cases(ops: set[str], tokens: int, hidden: int, es: int, rand: Callable, use_compile: bool,
                      smoke: bool) -> list[Case]:
    """bias+GeLU and SwiGLU over the MLP's [tokens, ffn] activations."""
    ffn = 4 * hidden if not smoke else 2 * hidden
    act = tokens * ffn * es
    cases = []
    if "gelu" in ops:
        cases.append(Case("bias_gelu", f"{tokens}x{ffn}", lambda t=tokens, f=ffn: [rand(t, f), rand(f)],
                          _providers(K.bias_gelu, K.bias_gelu_reference, None, use_compile),
                          2 * act, 5 * act))  # fwd: x, y; bwd: x, dy, dx (+ dbias reduce)
    if "swiglu" in ops:
        liger = _liger("liger_swiglu")
        cases.append(Case("swiglu", f"{tokens}x{ffn}", lambda t=tokens, f=ffn: [rand(t, f), rand(t, f)],
                          _providers(K.swiglu, K.swiglu_reference, liger, use_compile),
                          3 * act, 8 * act))  # fwd: g, u, y; bwd: g, u, dy, dg, du
    return cases


def _rope_case(device: str, dtype: torch.dtype, es: int, rand: Callable, use_compile: bool, smoke: bool) -> Case:
    """Rotary embedding of a [s, b, n, d] query/key tensor; cos/sin tables [s, d] built once here."""
    s, b, n, d = (4096, 2, 32, 128) if not smoke else (16, 2, 3, 16)
    angles = torch.rand(s, d // 2, device=device) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    size = s * b * n * d * es
    return Case("rope", f"s{s}xb{b}xn{n}xd{d}", lambda: [rand(s, b, n, d)],
                _providers(lambda x: K.rope(x, cos, sin), lambda x: K.rope_reference(x, cos, sin), None,
                           use_compile), 2 * size, 4 * size)


def _cross_entropy_cases(quick: bool, device: str, es: int, rand: Callable, use_compile: bool,
                         smoke: bool) -> list[Case]:
    """Cross entropy of [tokens, vocab] logits against [tokens] labels, per vocabulary size."""
    vocabs = [32000, 128256] if not quick else [128256]
    tokens = 8192 if not smoke else 32
    if smoke:
        vocabs = [1000]
    cases = []
    liger = _liger("liger_cross_entropy")
    for vocab in vocabs:
        size = tokens * vocab * es
        cases.append(Case(
            "cross_entropy", f"{tokens}x{vocab}",
            lambda t=tokens, v=vocab: [rand(t, v), torch.randint(0, v, (t,), device=device)],
            _providers(K.cross_entropy, K.cross_entropy_reference,
                       (lambda x, y: liger(x, y, reduction="none")) if liger else None, use_compile),
            size, 3 * size))  # fwd: logits once; bwd: logits, dlogits (+ fwd)
    return cases


def _attention_cases(quick: bool, rand: Callable, use_compile: bool, smoke: bool) -> list[Case]:
    """Causal GQA attention, q [b, h, s, d] over k, v [b, h/4, s, d], per (head_dim, seq)."""
    configs = [(128, 4096)] if quick else [(d, s) for d in (64, 128) for s in (1024, 2048, 4096, 8192)]
    if smoke:
        configs = [(32, 40)]
    cases = []
    for head_dim, seq in configs:
        heads = 4096 // head_dim if not smoke else 4
        kv_heads = max(1, heads // 4)
        batch = max(1, 16384 // seq) if not smoke else 1
        causal_flops = 4 * batch * heads * seq * seq * head_dim / 2  # two matmuls, half the square
        cases.append(Case(
            "attention", f"b{batch}xh{heads}/{kv_heads}xs{seq}xd{head_dim} causal",
            lambda b=batch, h=heads, hk=kv_heads, s=seq, d=head_dim: [rand(b, h, s, d), rand(b, hk, s, d),
                                                                       rand(b, hk, s, d)],
            _providers(K.attention, K.attention_reference, None, use_compile),
            causal_flops, 3.5 * causal_flops, flops=True))  # backward = 2.5 x forward FLOPs
    return cases


def _adamw_case(device: str, smoke: bool) -> Case:
    """One AdamW step over a flat fp32 parameter of n elements (with its grad and two moments)."""
    n = 256 * 2**20 if not smoke else 5000
    return Case("adamw", f"{n}", lambda: [torch.randn(n, device=device) for _ in range(4)],
                {"megalite": lambda p, g, m, v: K.adamw_step(p, g, m, v, 1e-3, 0.9, 0.95, 1e-8, 0.1, 10),
                 "eager": lambda p, g, m, v: K.adamw_step_reference(p, g, m, v, 1e-3, 0.9, 0.95, 1e-8, 0.1, 10),
                 **_torch_adamw_providers(device)},
                7 * 4 * n, 7 * 4 * n, differentiable=False)  # read p, g, m, v; write p, m, v


def _torch_adamw_providers(device: str) -> dict:
    """torch.optim.AdamW's own foreach and fused implementations on one flat parameter."""
    providers = {}
    for impl in ("foreach", "fused"):
        def step(p, g, m, v, impl=impl, cache={}):  # noqa: B006 - one optimizer per buffer, built once
            key = (p.data_ptr(), impl)
            if key not in cache:
                param = torch.nn.Parameter(p)
                param.grad = g
                try:
                    cache[key] = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                                   **{impl: True})
                except (RuntimeError, TypeError):
                    cache[key] = None
            if cache[key] is None:
                raise RuntimeError(f"torch AdamW {impl}=True unavailable on {device}")
            cache[key].step()
        providers[f"torch-{impl}"] = step
    return providers


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
