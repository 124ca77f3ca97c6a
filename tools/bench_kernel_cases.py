"""The cases tools/bench_kernels.py times: each (op, shape) with its inputs, its providers (megalite's
Triton kernel, the eager reference beside it, torch.compile of that reference, Liger-Kernel and
torch's own AdamW where they exist; for attention, torch's SDPA) and the bytes or FLOPs its forward
and backward move.

Training-relevant shapes (Llama-7B/8B-like); `smoke` shrinks them for `--smoke-timing` on CPU.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import megalite.kernels as K  # noqa: E402
from bench_case import Case  # noqa: E402,F401 - bench_kernels and the tests take it from here
from bench_moe_kernel_cases import moe_cases  # noqa: E402


# ------------------------------------------------------------------------------------------------
# Providers
# ------------------------------------------------------------------------------------------------

def _liger(name: str):
    """Liger-Kernel's op `name`, where it can run: its Triton kernels are written for CUDA devices."""
    if not torch.cuda.is_available():
        return None
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
        tokens_hidden = [(16, 96)]  # the interpreter runs one program per row: keep few
    for tokens, hidden in tokens_hidden:
        cases += _norm_cases(ops, tokens, hidden, es, rand, use_compile)
        cases += _activation_cases(ops, tokens, hidden, es, rand, use_compile, smoke)
    if "rope" in ops:
        cases.append(_rope_case(device, dtype, es, rand, use_compile, smoke))
    if "cross_entropy" in ops:
        cases += _cross_entropy_cases(quick, device, es, rand, use_compile, smoke)
    if "attention" in ops:
        cases += attention_cases(quick, device, dtype, use_compile and quick, smoke)  # compile: per shape
    if "adamw" in ops:
        cases.append(_adamw_case(device, smoke))
    if ops & {"grouped_mm", "moe_permute"}:
        cases += moe_cases(ops, quick, device, dtype, use_compile, smoke)
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
# Attention: megalite's kernels and its dispatch against torch's own SDPA, in the model's layout
# ------------------------------------------------------------------------------------------------

BACKEND_ENV = "MEGALITE_KERNEL_BACKEND"


def attention_cases(quick: bool, device: str, dtype: torch.dtype, use_compile: bool, smoke: bool) -> list[Case]:
    """Causal GQA attention (4 query heads per kv head, 4096 = heads x head_dim, 16384 tokens per
    batch), per (head_dim, seq). use_compile: add torch.compile of the reference (recompiles per shape)."""
    configs = [(d, s) for d in (64, 128) for s in (1024, 2048, 4096, 8192, 16384)]
    if quick:
        configs = [(128, 4096), (64, 4096)]
    if smoke:
        configs = [(32, 40)]
    element_size = torch.tensor([], dtype=dtype).element_size()
    cases = []
    for head_dim, seq in configs:
        heads = 4096 // head_dim if not smoke else 4
        kv_heads = heads // 4
        batch = max(1, 16384 // seq) if not smoke else 1
        fwd, fwd_bwd = attention_flops(batch, heads, seq, head_dim)
        cases.append(Case(
            "attention", f"b{batch}xh{heads}/{kv_heads}xs{seq}xd{head_dim} causal",
            lambda b=batch, h=heads, hk=kv_heads, s=seq, d=head_dim: attention_inputs(b, h, hk, s, d, dtype, device),
            attention_providers(use_compile), fwd, fwd_bwd, flops=True,
            memory_bytes=attention_memory_bytes(batch, heads, kv_heads, seq, head_dim, element_size)))
    return cases


def attention_inputs(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, dtype: torch.dtype,
                     device, requires_grad: bool = True) -> list[torch.Tensor]:
    """[q, k, v] laid out as megalite's Attention.core passes them: q [b, h, s, d], k and v
    [b, h_kv, s, d], each the permuted view of an [s, b, heads, d] tensor (strides
    (heads*d, d, b*heads*d, 1): not contiguous, so a kernel that needs contiguous inputs pays a copy).

    detach() keeps those strides and makes each a leaf, so its gradient lands in .grad, which the
    timers reset between calls (in the model it flows on through the view into the fused qkv).
    """
    def permuted(n_heads: int) -> torch.Tensor:
        x = torch.randn(seq, batch, n_heads, head_dim, device=device, dtype=dtype)
        return x.permute(1, 2, 0, 3).detach().requires_grad_(requires_grad)  # [s, b, n, d] -> [b, n, s, d]
    return [permuted(heads), permuted(kv_heads), permuted(kv_heads)]


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs of causal attention: two matmuls (q k^T and p v) over half
    the [s, s] square; the backward counts 2.5x the forward (five matmuls, the scores recomputed,
    as FlashAttention-2 counts)."""
    forward = 2 * 2 * batch * heads * seq * seq * head_dim / 2
    return forward, 3.5 * forward


def attention_memory_bytes(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int,
                           element_size: int) -> float:
    """Peak bytes of fwd+bwd for the hungriest provider, `sdpa` (k, v repeated to every query head).

    In units of one q-sized tensor Q = b*h*s*d elements and one kv-sized KV: q, k, v and their
    gradients (2Q + 4KV); the repeated k, v and their gradients (4Q); out, dout and dq (3Q); a
    contiguous copy SDPA may take of q and of dq's permuted .grad (2Q); fp32 log-sum-exp and delta
    [b, h, s]. At 16384 tokens, heads*d = 4096, bf16: Q = 128 MiB, total ~1.5 GiB, whatever s.
    """
    q_size = batch * heads * seq * head_dim * element_size
    kv_size = batch * kv_heads * seq * head_dim * element_size
    return 11 * q_size + 4 * kv_size + 2 * batch * heads * seq * 4


def attention_providers(use_compile: bool) -> dict:
    """megalite (the Triton kernels), auto (what training calls: megalite's dispatch, which may pick
    SDPA), sdpa (k, v repeated), sdpa-gqa (SDPA's own grouped heads, where this torch has them) and
    compile (torch.compile of the reference)."""
    providers = {"megalite": _with_backend("triton", K.attention), "auto": _with_backend("auto", K.attention),
                 "sdpa": sdpa_repeated_kv}
    if sdpa_accepts_gqa():
        providers["sdpa-gqa"] = sdpa_gqa
    if use_compile:
        providers["compile"] = torch.compile(K.attention_reference, dynamic=False)
    return providers


@contextlib.contextmanager
def kernel_backend(backend: str | None):
    """MEGALITE_KERNEL_BACKEND=backend inside (None: unchanged), the previous value restored after."""
    previous = os.environ.get(BACKEND_ENV)
    if backend is not None:
        os.environ[BACKEND_ENV] = backend
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = previous


def _with_backend(backend: str, fn: Callable) -> Callable:
    """fn under MEGALITE_KERNEL_BACKEND=backend (dispatch reads it on every call). The backend is
    also kept as `.kernel_backend`, so that the tool can hold it over the backward too, in case a
    dispatch decides anything there."""
    def call(*args):
        with kernel_backend(backend):
            return fn(*args)
    call.kernel_backend = backend
    return call


def sdpa_repeated_kv(q, k, v):
    """torch's SDPA with each k, v head repeated over its query group (the first run's `eager`).

    expand + reshape copies as repeat_interleave(group, dim=1) does (query head i reads kv head
    i // group) but builds no index tensor: some torch versions' CUDA repeat_interleave reads its
    repeats back to the host, which would keep this row out of a CUDA graph.
    """
    batch, kv_heads, seq, head_dim = k.shape
    group = q.shape[1] // kv_heads

    def repeated(t):  # [b, h_kv, s, d] -> [b, h_kv, group, s, d] -> [b, h, s, d]
        return t[:, :, None].expand(batch, kv_heads, group, seq, head_dim).reshape(batch, kv_heads * group, seq,
                                                                                   head_dim)
    return F.scaled_dot_product_attention(q, repeated(k), repeated(v), is_causal=True)


def sdpa_gqa(q, k, v):
    """torch's SDPA reading each kv head for its whole query group itself (enable_gqa, torch >= 2.5)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@functools.lru_cache(maxsize=None)
def sdpa_accepts_gqa() -> bool:
    """Does this torch's SDPA take enable_gqa? Asked once, on tiny CPU tensors."""
    try:
        sdpa_gqa(torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8))
        return True
    except (TypeError, RuntimeError):
        return False
