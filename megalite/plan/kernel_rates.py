"""Measured kernel rates the step-time model reads where a profile has them (pure arithmetic, no torch).

Attention: a profile's `attention_ms` rows are forward + backward milliseconds of one causal call of
`ATTENTION_TABLE_TOKENS` tokens whose query heads x head_dim = `ATTENTION_TABLE_WIDTH` (4096), per
(head_dim, precision, causal, seq_len, implementation): tools/tune_attention.py's dispatch table,
the same rows as kernels/attention_dispatch.MEASURED_MS (a test holds the two equal). A call of
another shape is timed from the row by its work: attention's FLOPs are tokens x query heads x
head_dim x seq_len (x a constant), so at the table's seq_len

    ms(call) = ms(row) x (tokens x heads x head_dim) / (ATTENTION_TABLE_TOKENS x ATTENTION_TABLE_WIDTH);

between two measured lengths the rate (work per ms) is interpolated linearly in log2(seq_len), and
beyond the ends it is the end's. The implementation is the one megalite's `auto` dispatch runs:
without dropout the fastest at the measured length nearest in log2 ("sdpa_gqa" only for grouped
queries), with dropout or ring context parallelism "triton"; `Kernels.attention_backend` can force
one, as MEGALITE_KERNEL_BACKEND does. Where the profile has no rows for (head_dim, precision, causal), or
the forced implementation was not measured, `attention_seconds` answers None and the caller keeps
the model without a table. The forward's share of the measured time is its share of the products
(2 of the 2 + 5 a flash backward recomputes and runs): 2 / 7.

Memory-bound kernels: `memory_fractions[family]` is the (forward, backward) fraction of the copy
bandwidth a kernel family reaches (tools/bench_kernels.py per kernel; see hardware.py's H200 for
where each number was measured); a family the profile does not list runs at the copy bandwidth.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megalite.config.choices import CPCommType
from megalite.config.model import GPTConfig, attention_span
from megalite.plan.hardware import HardwareProfile
from megalite.plan.layout import DTYPE_BYTES
from megalite.plan.params import mean_document_length

if TYPE_CHECKING:
    from megalite.config import RunConfig

ATTENTION_TABLE_TOKENS = 16384   # tools/tune_attention.py TOKENS: batch = 16384 // seq_len
ATTENTION_TABLE_WIDTH = 4096     # its query heads = 4096 // head_dim (kv heads a quarter of them)
FORWARD_SHARE = 2.0 / 7.0        # flash forward: 2 products; backward: 5 (scores recomputed)
BACKENDS = ("auto", "triton", "sdpa", "sdpa_gqa")


def _rows(hw: HardwareProfile, head_dim: int, precision: str, causal: bool) -> dict[int, dict[str, float]]:
    """{seq_len: {implementation: ms}} of the profile's measured attention at this key."""
    table: dict[int, dict[str, float]] = {}
    for d, p, c, seq, impl, ms in hw.attention_ms:
        if (d, p, c) == (head_dim, precision, causal):
            table.setdefault(seq, {})[impl] = ms
    return table


def choose_attention(table: dict[int, dict[str, float]], seq_len: int, grouped: bool, dropout: bool,
                     backend: str = "auto") -> str | None:
    """The implementation megalite runs for a call (kernels/attention_dispatch.py's rule), None if unmeasured."""
    if backend != "auto":
        return backend if any(backend in row for row in table.values()) else None
    if dropout:                                   # only the Triton kernels regenerate megalite's mask
        return "triton" if any("triton" in row for row in table.values()) else None
    nearest = min(table, key=lambda s: (abs(math.log2(s) - math.log2(max(seq_len, 1))), s))
    usable = {impl: ms for impl, ms in table[nearest].items() if impl != "sdpa_gqa" or grouped}
    return min(usable, key=usable.get) if usable else None


def attention_implementation(model: GPTConfig, cfg: RunConfig, hw: HardwareProfile, backend: str = "auto") -> str:
    """The implementation megalite's blocks run on the profile's GPU (kernels/attention_dispatch.py's
    rule): ring attention and dropout run Triton's; a forced backend its own; else the fastest in the
    profile's table, and torch's SDPA (repeated kv heads) where it has none, as the dispatch answers a
    key nobody measured. Its activation bytes and layout copies depend on it (activations.py)."""
    dropout = model.attention_dropout > 0
    if getattr(cfg.parallel, "cp", 1) > 1 and getattr(cfg.parallel, "cp_comm_type", CPCommType.P2P) == CPCommType.P2P:
        return "triton"
    table = _rows(hw, model.head_dim, cfg.precision.precision, True)
    grouped = model.num_query_groups < model.num_attention_heads
    chosen = choose_attention(table, model.seq_length, grouped, dropout, backend) if table else None
    if chosen:
        return chosen
    return backend if backend != "auto" else ("triton" if dropout else "sdpa")


def _work_per_ms(table: dict[int, dict[str, float]], impl: str, seq_len: int) -> float:
    """Measured rate of `impl` in units of (tokens x width x seq_len) per ms, log2-interpolated in seq_len."""
    points = sorted((seq, ATTENTION_TABLE_TOKENS * ATTENTION_TABLE_WIDTH * seq / row[impl])
                    for seq, row in table.items() if impl in row)
    if seq_len <= points[0][0]:
        return points[0][1]
    for (s0, r0), (s1, r1) in zip(points, points[1:]):
        if seq_len <= s1:
            w = (math.log2(seq_len) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
            return r0 + w * (r1 - r0)
    return points[-1][1]


def attention_seconds(hw: HardwareProfile, head_dim: int, precision: str, causal: bool, seq_len: int,
                      tokens: int, heads: int, grouped: bool, dropout: bool,
                      backend: str = "auto") -> tuple[float, str] | None:
    """(forward + backward seconds, implementation) of attention over `tokens` query tokens of
    `heads` query heads attending to `seq_len` keys each, from the profile's measured table; None
    where it has none for this call (the caller falls back)."""
    table = _rows(hw, head_dim, precision, causal)
    impl = choose_attention(table, seq_len, grouped, dropout, backend) if table else None
    if impl is None:
        return None
    return tokens * heads * head_dim * seq_len / _work_per_ms(table, impl, seq_len) * 1e-3, impl


def memory_seconds(hw: HardwareProfile, family: str, forward_bytes: float, backward_bytes: float = 0.0,
                   transcendental: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of a memory-bound kernel family moving these bytes (read + written):
    at its measured fraction of the copy bandwidth where the profile lists the family, else at the
    copy bandwidth (`transcendental`: the elementwise rate, slower than memory on a CPU)."""
    rate = hw.elementwise_seconds if transcendental else hw.memory_seconds
    if family not in hw.memory_fractions:
        return rate(forward_bytes), rate(backward_bytes)
    forward, backward = hw.memory_fractions[family]
    return hw.memory_seconds(forward_bytes) / forward, hw.memory_seconds(backward_bytes) / backward


def attention_products(model: GPTConfig, cfg: RunConfig, hw: HardwareProfile, attention: str, backend: str,
                       heads: int, local: int) -> tuple[float, float]:
    """Seconds of attention's two products in forward, over `heads` (b x local heads) of `local` queries:
    from the profile's measured table where it has this call (`attention_seconds`; the forward's 2/7 of its
    fwd+bwd time), else fused flash at `attention_efficiency`, else two batched GEMMs on the curve."""
    precision, d, s = cfg.precision.precision, model.head_dim, model.seq_length
    causal = 0.5 if attention == "flash" else 1.0
    # packed documents and a window: the share of the causal work flash still does (it skips the rest)
    kept = attention_span(s, mean_document_length(cfg), model.window_size) / s if attention == "flash" else 1.0
    causal *= kept
    if getattr(cfg.parallel, "cp", 1) > 1 and getattr(cfg.parallel, "cp_comm_type", CPCommType.P2P) == CPCommType.P2P:
        backend = "triton"                                           # ring attention merges Triton's blocks
    if attention == "flash":
        measured = attention_seconds(hw, d, precision, True, s, heads * local, 1,
                                     model.num_query_groups < model.num_attention_heads, model.attention_dropout > 0,
                                     backend)
        if measured:
            return (measured[0] * kept * FORWARD_SHARE / 2,) * 2
        if hw.attention_efficiency:                                  # a fused kernel at its measured rate
            return (2 * heads * local * s * causal * d / (hw.peak_flops(precision) * hw.attention_efficiency),) * 2
    # heads products of [s_local, d] x [d, s] and [s_local, s] x [s, d]
    return (hw.matmul_seconds(local, s * causal, d, precision, batch=heads),
            hw.matmul_seconds(local, d, s * causal, precision, batch=heads))


def layout_copies(model: GPTConfig, cfg: RunConfig, hw: HardwareProfile, tokens: int,
                  megalite_layout: bool, output_in_place: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of megalite's own layout passes in one block, counted where the profile
    measured torch's copy kernels ("layout_copy"): forward: attention's output [b, nq, s, d] -> [s, b, nq d]
    (not where the Triton kernels write it in place, `output_in_place`), the column-parallel bias adds
    (QKV, fc1), SwiGLU's gate and up halves made contiguous; backward: the output gradient made contiguous
    (not in place either), the q/k/v gradients copied where no RoPE wrote them (strided), and the
    concatenations of the QKV (and gate/up) gradients (at the copy bandwidth: cat is a plain copy)."""
    if not megalite_layout or "layout_copy" not in hw.memory_fractions:
        return 0.0, 0.0
    a, t = DTYPE_BYTES[cfg.precision.precision], cfg.parallel.tp
    d, f = model.head_dim, model.ffn_hidden_size // t
    nq, nkv = model.num_attention_heads // t, model.num_query_groups // t
    llama = model.flavour == "llama"
    output = 0 if output_in_place else 2 * a * tokens * nq * d
    forward = output + (2 * a * tokens * ((nq + 2 * nkv) * d + f) if model.add_bias else 0)
    forward += 2 * 2 * a * tokens * f if llama else 0
    backward = output + 2 * a * tokens * (nkv if llama else nq + 2 * nkv) * d
    concatenated = 2 * a * tokens * ((nq + 2 * nkv) * d + (2 * f if llama else 0))
    fwd, bwd = memory_seconds(hw, "layout_copy", forward, backward)
    return fwd, bwd + hw.memory_seconds(concatenated)
