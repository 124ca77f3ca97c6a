"""Which implementation `megalite.kernels.attention` runs: our Triton kernels or torch's SDPA.

With MEGALITE_KERNEL_BACKEND=auto (the default), a call on CUDA tensors runs the implementation
measured fastest, forward + backward, for its (GPU architecture, head dim, dtype, causal) at the
measured sequence length nearest its own (in log2), among those that can serve the call:

    "triton"    our flash kernels (kernels/flash_attention.py)
    "sdpa"      torch.nn.functional.scaled_dot_product_attention, k/v heads repeated for GQA
    "sdpa_gqa"  the same with enable_gqa=True (no repeated copies; torch >= 2.5)

Only "triton" serves attention dropout: megalite's mask is a Philox function of (seed, offset,
head, row, column), regenerated in backward and identical under any tensor-parallel split,
and SDPA draws its own. The log-sum-exp entry points ring attention uses (attention_block.py)
always run the Triton kernels. A key nobody measured gets "sdpa": torch's kernels are tuned
for every GPU torch supports, ours only where `MEASURED_MS` says so.
MEGALITE_KERNEL_BACKEND=triton forces ours, =torch the reference (SDPA with repeated heads).

`MEASURED_MS` holds forward+backward milliseconds per implementation, from
`python tools/tune_attention.py` (model layout: q, k, v are [b, h, s, d] views of [s, b, h, d]
activations; GQA 4:1; 16384 tokens per call), which prints the lines to paste here.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .attention_tiles import cuda_arch, dtype_name

IMPLEMENTATIONS = ("triton", "sdpa", "sdpa_gqa")
NAMES = {"triton": "megalite Triton kernels", "sdpa": "torch SDPA (kv heads repeated)",
         "sdpa_gqa": "torch SDPA (enable_gqa)", "reference": "PyTorch reference"}
SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")

# (arch, head_dim, dtype, causal) -> {seq_len: {implementation: fwd+bwd ms}}
MEASURED_MS: dict[tuple[str, int, str, bool], dict[int, dict[str, float]]] = {
    # NVIDIA H200, torch 2.11 + triton 3.6, 2026-11-26 (tools/tune_attention.py)
    ("sm_90", 128, "bf16", True): {1024: {"triton": 2.0184, "sdpa": 1.89, "sdpa_gqa": 1.4081},
                                   2048: {"triton": 3.1956, "sdpa": 2.6857, "sdpa_gqa": 2.2421},
                                   4096: {"triton": 5.7896, "sdpa": 4.306, "sdpa_gqa": 3.7353},
                                   8192: {"triton": 10.5196, "sdpa": 7.7639, "sdpa_gqa": 7.3578},
                                   16384: {"triton": 19.3394, "sdpa": 14.6954, "sdpa_gqa": 14.2206}},
    ("sm_90", 64, "bf16", True): {1024: {"triton": 2.0917, "sdpa": 2.309, "sdpa_gqa": 1.8182},
                                  2048: {"triton": 3.3102, "sdpa": 3.3196, "sdpa_gqa": 2.8307},
                                  4096: {"triton": 5.94, "sdpa": 5.3294, "sdpa_gqa": 4.9197},
                                  8192: {"triton": 10.9121, "sdpa": 9.4876, "sdpa_gqa": 8.8704},
                                  16384: {"triton": 21.2314, "sdpa": 18.1031, "sdpa_gqa": 17.6596}},
}


def _nearest(measured: dict[int, dict[str, float]], seq_len: int) -> tuple[int, dict[str, float]]:
    seq = min(measured, key=lambda s: (abs(math.log2(s) - math.log2(max(seq_len, 1))), s))
    return seq, measured[seq]


@functools.lru_cache(maxsize=1024)
def _auto(arch: str, head_dim: int, dtype: torch.dtype, causal: bool, seq_len: int, gqa: bool) -> tuple[str, str]:
    """(implementation, why) for a call without dropout; cached: it runs on every forward."""
    key = (arch, head_dim, dtype_name(dtype), causal)
    where = f"d={head_dim} {dtype_name(dtype)} {'causal' if causal else 'full'} s={seq_len} on {arch}"
    if key not in MEASURED_MS:
        return "sdpa", f"{where} not in attention_dispatch.MEASURED_MS: torch's SDPA"
    seq, times = _nearest(MEASURED_MS[key], seq_len)
    usable = {impl: ms for impl, ms in times.items() if impl != "sdpa_gqa" or (SDPA_HAS_GQA and gqa)}
    best = min(usable, key=usable.get)
    others = ", ".join(f"{NAMES[impl]} {ms / usable[best]:.2f}x its time" for impl, ms in usable.items()
                       if impl != best)
    return best, f"fastest measured at {where} (table row s={seq}){': ' + others if others else ''}"


def _forced(backend: str, dropout_p: float) -> tuple[str, str] | None:
    """(implementation, why) where the backend or dropout decides, before any table is read."""
    if backend == "torch":
        return "reference", "MEGALITE_KERNEL_BACKEND=torch"
    if backend == "triton":
        return "triton", "MEGALITE_KERNEL_BACKEND=triton"
    if dropout_p > 0.0:
        return "triton", "attention dropout: only the Triton kernels regenerate megalite's Philox mask"
    return None


def choose(q: torch.Tensor, k: torch.Tensor, causal: bool, dropout_p: float, backend: str,
           have_triton: bool) -> tuple[str, str]:
    """(implementation, why) for attention(q [b, h, s, d], k [b, h_kv, s_kv, d]) under `backend`.

    Returns "reference" off CUDA under auto and under backend torch; "triton" when forced, when
    dropout asks for megalite's regenerable mask, or where the table measured it fastest.
    """
    if backend == "auto" and (q.device.type != "cuda" or not have_triton):
        return "reference", "auto off CUDA (or without triton): the PyTorch reference"
    forced = _forced(backend, dropout_p)
    if forced:
        return forced
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _auto(cuda_arch(index), q.shape[-1], q.dtype, bool(causal), q.shape[2], k.shape[1] != q.shape[1])


def describe(arch: str, head_dim: int, dtype: torch.dtype, seq_len: int, causal: bool, dropout_p: float,
             gqa: bool, backend: str) -> str:
    """One line for the start banner: which attention a model's calls on `arch` run, and why."""
    impl, why = _forced(backend, dropout_p) or _auto(arch, head_dim, dtype, causal, seq_len, gqa)
    return f"attention: {NAMES[impl]} ({why})"


def implementation(arch: str, head_dim: int, dtype: torch.dtype, seq_len: int, causal: bool, dropout_p: float,
                   gqa: bool, backend: str) -> str:
    """The implementation `describe` names (the planner counts what it keeps for backward)."""
    return (_forced(backend, dropout_p) or _auto(arch, head_dim, dtype, causal, seq_len, gqa))[0]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
         native_gqa: bool) -> torch.Tensor:
    """torch's SDPA on q [b, h, s, d], k, v [b, h_kv, s_kv, d]; GQA by enable_gqa or repeated heads."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and native_gqa:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=True)
    if group > 1:
        k, v = repeat_kv_heads(k, group), repeat_kv_heads(v, group)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)


def memory_efficient_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                          softmax_scale: float) -> torch.Tensor:
    """torch's memory-efficient SDPA kernel by name: q, k [b, h, s, d_qk], v [b, h, s, d_v] -> [b, h, s, d_v].

    It keeps q, k, v, its output and an fp32 log-sum-exp [b, h, s] for backward, never the scores. This is
    the kernel CUDA's SDPA runs for d_qk != d_v (torch's order is flash, memory-efficient, math, cuDNN, and
    flash takes one head dim); it has a meta implementation, which --simulate's data-less tensors run
    where the dispatcher, given no device kernels, would fall back to the math path's [b, h, s, s] scores."""
    out, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                     scale=softmax_scale)
    return out


def repeat_kv_heads(t: torch.Tensor, group: int) -> torch.Tensor:
    """[b, h_kv, s, d] -> [b, h_kv * group, s, d], each kv head repeated for its group's query heads
    (= repeat_interleave(group, dim=1), which on CUDA reads its output size back to the host)."""
    b, h_kv, s, d = t.shape
    return t[:, :, None].expand(b, h_kv, group, s, d).reshape(b, h_kv * group, s, d)
