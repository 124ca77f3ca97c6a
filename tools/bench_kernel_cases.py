"""The cases tools/bench_kernels.py times: each (op, shape) with its inputs, its providers (megalite's
Triton kernel, the eager reference beside it, torch.compile of that reference, Liger-Kernel and
torch's own AdamW where they exist) and the bytes or FLOPs its forward and backward move.

Training-relevant shapes (Llama-7B/8B-like); `smoke` shrinks them for `--smoke-timing` on CPU.
"""
from __future__ import annotations

import os
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
