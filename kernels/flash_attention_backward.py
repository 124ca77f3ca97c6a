"""Flash-attention backward (FlashAttention-2's recomputation), no atomics, grouped-query heads.

Given the forward's output `out` and its per-row base-2 log-sum-exp lse2 [b, h, s] fp32:

    delta = rowsum(dout * out)                           (one small kernel first)
    p = exp2(scale*log2e * q k^T - lse2);  dv = p^T dout;  dp = dout v^T
    ds = p * (dp - delta);  dq = scale * ds k;  dk = scale * ds^T q

Work split (no atomics, so the result does not depend on scheduling); the programs themselves
are @triton.jit functions in kernels/attention_backward_steps.py:
- dK/dV: one program per (key block of BLOCK_N rows, batch * kv_head). It keeps its k, v block
  and the dk, dv accumulators in registers and streams, for every query head of its group
  (GQA is summed here, not by a later reduction), the query blocks that can see its keys.
- dQ: one program per (query block of BLOCK_M rows, batch * head); it streams the key blocks
  its queries see, re-computing p (the price of no atomics: 7 matmuls instead of 5), and keeps
  dq in fp32 registers, converted once when stored.

Two variants launch them (attention_tiles.backward_for picks; `auto` by measurement):
- "split": a dK/dV launch, then a dQ launch (each with its own tile).
- "fused" (FlexAttention's layout): one grid of batch * n_kv_heads columns, each holding the kv
  head's dK/dV programs first, then its dQ programs, the group's query heads of one query block
  side by side. One launch, no tail between the two kinds of program, k and v rows shared in L2
  by the group's dQ programs; one register allocation for both (the larger), so fewer dQ
  programs fit an SM than in "split". 16-bit inputs only (float32 runs "split").
An "atomic" dQ (reduce-added from the dK/dV program, 5 matmuls) was measured on an H200 at 0.50x
SDPA against the split backward's 0.82x (docs/benchmarks.md) and is not here.

Causal block skipping: a dK/dV program starts at the first query block that reaches its keys
and masks in every step (a separate unmasked loop held ~50 more registers per thread and
spilled at d=128: compile_check); the dQ program runs its unmasked key blocks first and masks
only the blocks that cross the diagonal, in reverse block order so the longest rows start
first and do not trail the grid. EVEN_M / EVEN_N (sequence lengths multiples of the blocks)
drop every bounds mask. n_batch (used only by the dropout counters) is not specialised, so one
compiled kernel serves every batch size.

Dropout regenerates the forward's Philox mask (counters as in the forward, transposed in dK/dV):
dv from the kept, rescaled p, dp through the same mask; delta is unchanged.
"""
from __future__ import annotations

import torch

from .attention_backward_steps import dkdv_program, dq_program
from .attention_tiles import fused_launch
from .dispatch import cdiv, new_output, runnable, tl, triton


@triton.jit
def _attention_delta_kernel(O, DO, DELTA, o_stride_b, o_stride_h, o_stride_s, do_stride_b, do_stride_h, do_stride_s,
                            n_heads, seq_len, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[b, h, i] = sum_d dout * out (both [b, h, s, d] with unit last stride)."""
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // n_heads, batch_head % n_heads
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = offs_m[:, None] < seq_len
    o_ptrs = O + batch * o_stride_b + head * o_stride_h + offs_m[:, None] * o_stride_s + offs_d[None, :]
    do_ptrs = DO + batch * do_stride_b + head * do_stride_h + offs_m[:, None] * do_stride_s + offs_d[None, :]
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + batch_head * seq_len + offs_m, tl.sum(o * do, axis=1), mask=offs_m < seq_len)


ARGS = ("n_batch", "dropout_seed", "dropout_offset", "drop_threshold")  # not specialised: one kernel for any batch


@triton.jit(do_not_specialize=ARGS)
def _attention_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, KEY_START, QUERY_END, q_stride_b, q_stride_h, q_stride_s,
                           k_stride_b,
                           k_stride_h, k_stride_s, v_stride_b, v_stride_h, v_stride_s, do_stride_b, do_stride_h,
                           do_stride_s, n_heads, group_size, seq_len,
                           kv_len, softmax_scale, scale_log2, n_batch, dropout_seed, dropout_offset, drop_threshold,
                           dropout_scale, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr):
    """Split variant, dK/dV: one program per (key block, batch * kv_head); every step masks."""
    batch_kv_head = tl.program_id(1).to(tl.int64)  # = batch * n_kv_heads + kv_head
    n_kv_heads = n_heads // group_size
    dkdv_program(Q, K, V, DO, LSE, DELTA, DK, DV, KEY_START, QUERY_END, q_stride_b, q_stride_h, q_stride_s,
                 k_stride_b, k_stride_h,
                 k_stride_s, v_stride_b, v_stride_h, v_stride_s, do_stride_b, do_stride_h, do_stride_s, n_heads,
                 group_size, seq_len, kv_len, softmax_scale, scale_log2, n_batch, dropout_seed, dropout_offset,
                 drop_threshold.to(tl.uint32), dropout_scale, tl.program_id(0), batch_kv_head // n_kv_heads,
                 batch_kv_head % n_kv_heads, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, EVEN_M, EVEN_N, DOT_PRECISION,
                 DROPOUT, VARLEN)


@triton.jit(do_not_specialize=ARGS)
def _attention_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, KEY_START, q_stride_b, q_stride_h, q_stride_s, k_stride_b,
                         k_stride_h,
                         k_stride_s, v_stride_b, v_stride_h, v_stride_s, do_stride_b, do_stride_h, do_stride_s,
                         n_heads, group_size, seq_len, kv_len,
                         softmax_scale, scale_log2, n_batch, dropout_seed, dropout_offset, drop_threshold,
                         dropout_scale, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr):
    """Split variant, dQ: one program per (query block, batch * head); causal: longest rows first."""
    block = tl.program_id(0)
    if CAUSAL:  # the last query blocks see the most keys: start them first
        block = tl.num_programs(0) - 1 - block
    batch_head = tl.program_id(1).to(tl.int64)
    dq_program(Q, K, V, DO, LSE, DELTA, DQ, KEY_START, q_stride_b, q_stride_h, q_stride_s, k_stride_b, k_stride_h,
               k_stride_s,
               v_stride_b, v_stride_h, v_stride_s, do_stride_b, do_stride_h, do_stride_s, n_heads, group_size,
               seq_len, kv_len, softmax_scale, scale_log2, n_batch, dropout_seed, dropout_offset,
               drop_threshold.to(tl.uint32), dropout_scale, block, batch_head // n_heads, batch_head % n_heads,
               batch_head, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, EVEN_M, EVEN_N, DOT_PRECISION, DROPOUT, VARLEN)


@triton.jit(do_not_specialize=ARGS)
def _attention_backward_fused_kernel(Q, K, V, DO, LSE, DELTA, DQ, DK, DV, KEY_START, QUERY_END,
                                     q_stride_b, q_stride_h, q_stride_s,
                                     k_stride_b, k_stride_h, k_stride_s, v_stride_b, v_stride_h, v_stride_s,
                                     do_stride_b, do_stride_h, do_stride_s, n_heads, group_size, seq_len, kv_len,
                                     softmax_scale, scale_log2, n_batch, dropout_seed, dropout_offset,
                                     drop_threshold, dropout_scale, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                                     BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr,
                                     BLOCK_N2: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                                     DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr):
    """Fused variant: the dK/dV and dQ programs of one kv head in one grid (batch * n_kv_heads columns).

    Programs [0, cdiv(kv_len, BLOCK_N1)) are dK/dV programs (key block = program id; causal: the
    first key blocks see the most queries, so the longest run first); the rest are dQ programs of
    the kv head's query heads, the group's heads of one query block side by side (they read the
    same k, v rows: L2 hits), causal: the last query block first."""
    pid = tl.program_id(0)
    batch_kv_head = tl.program_id(1).to(tl.int64)
    n_kv_heads = n_heads // group_size
    batch, kv_head = batch_kv_head // n_kv_heads, batch_kv_head % n_kv_heads
    n_kv_blocks = tl.cdiv(kv_len, BLOCK_N1)
    if pid < n_kv_blocks:
        dkdv_program(Q, K, V, DO, LSE, DELTA, DK, DV, KEY_START, QUERY_END, q_stride_b, q_stride_h, q_stride_s,
                     k_stride_b, k_stride_h,
                     k_stride_s, v_stride_b, v_stride_h, v_stride_s, do_stride_b, do_stride_h, do_stride_s, n_heads,
                     group_size, seq_len, kv_len, softmax_scale, scale_log2, n_batch, dropout_seed, dropout_offset,
                     drop_threshold.to(tl.uint32), dropout_scale, pid, batch, kv_head, CAUSAL, HEAD_DIM, BLOCK_M1,
                     BLOCK_N1, EVEN_M, EVEN_N, DOT_PRECISION, DROPOUT, VARLEN)
    else:
        index = pid - n_kv_blocks  # = block * group_size + member
        block, head = index // group_size, kv_head * group_size + index % group_size
        if CAUSAL:
            block = tl.cdiv(seq_len, BLOCK_M2) - 1 - block
        dq_program(Q, K, V, DO, LSE, DELTA, DQ, KEY_START, q_stride_b, q_stride_h, q_stride_s, k_stride_b, k_stride_h,
                   k_stride_s, v_stride_b, v_stride_h, v_stride_s, do_stride_b, do_stride_h, do_stride_s, n_heads,
                   group_size, seq_len, kv_len, softmax_scale, scale_log2, n_batch, dropout_seed, dropout_offset,
                   drop_threshold.to(tl.uint32), dropout_scale, block, batch, head, batch * n_heads + head, CAUSAL,
                   HEAD_DIM, BLOCK_M2, BLOCK_N2, EVEN_M, EVEN_N, DOT_PRECISION, DROPOUT, VARLEN)


LOG2E = 1.4426950408889634  # scores are taken in base 2: exp(x) = exp2(x * log2(e))


def strides(t: torch.Tensor) -> tuple[int, int, int]:
    """A [b, h, s, d] tensor's (batch, head, sequence) strides, as the kernels take them."""
    return t.stride(0), t.stride(1), t.stride(2)


def launch_backward(q, k, v, out, dout, lse2, causal: bool, softmax_scale: float, config: dict,
                    dropout_args: tuple, dropout: bool, documents=None):
    """Padded q [b, h, sq, D], k, v [b, h_kv, sk, D], out and dout [b, h, sq, D] (all with unit last
    stride, any other strides), lse2 contiguous fp32 [b, h, sq] -> contiguous (dq, dk, dv) like q, k, v.

    `out` and `lse2` are those of the softmax the block belongs to: over these keys only for
    plain attention, over every key of the row for one block of a longer row (ring attention).
    config: flash_attention._config's {"dkdv": (BLOCK_M, BLOCK_N, warps, stages), "dq": ..., "precision":
    the dots' input precision, "backward": "split" (default) or "fused"}; the fused kernel takes its
    dK/dV programs' blocks from "dkdv", its dQ programs' from "dq", its warps and stages from
    attention_tiles.fused_launch (one kernel: one launch configuration).
    dropout_args: the kernels' (n_batch, seed, offset, drop threshold, 1 / (1 - p)).
    """
    batch, n_heads, seq_len, head_dim = q.shape
    n_kv_heads, kv_len = k.shape[1], k.shape[2]
    delta = new_output((batch, n_heads, seq_len), torch.float32, q.device)
    delta_rows = 64
    runnable(_attention_delta_kernel, q.device)[(cdiv(seq_len, delta_rows), batch * n_heads)](
        out, dout, delta, *strides(out), *strides(dout), n_heads, seq_len, HEAD_DIM=head_dim, BLOCK_M=delta_rows)
    dq = new_output(q.shape, q.dtype, q.device)
    dk = new_output(k.shape, k.dtype, k.device)
    dv = new_output(v.shape, v.dtype, v.device)
    common = (*strides(q), *strides(k), *strides(v), *strides(dout), n_heads, n_heads // n_kv_heads, seq_len, kv_len,
              softmax_scale, softmax_scale * LOG2E, *dropout_args)
    meta = dict(CAUSAL=causal, HEAD_DIM=head_dim, DOT_PRECISION=config["precision"], DROPOUT=dropout,
                VARLEN=documents is not None)
    # without documents the two pointers are never read: lse2 stands in
    key_start, query_end = (documents.key_start, documents.query_end) if documents is not None else (lse2, lse2)
    if config.get("backward", "split") == "fused":
        (m1, n1, _, _), (m2, n2, _, _) = config["dkdv"], config["dq"]
        warps, stages = fused_launch(config)
        n_programs = cdiv(kv_len, n1) + cdiv(seq_len, m2) * (n_heads // n_kv_heads)
        runnable(_attention_backward_fused_kernel, q.device)[(n_programs, batch * n_kv_heads)](
            q, k, v, dout, lse2, delta, dq, dk, dv, key_start, query_end, *common, BLOCK_M1=m1, BLOCK_N1=n1,
            BLOCK_M2=m2, BLOCK_N2=n2,
            EVEN_M=seq_len % m1 == 0 and seq_len % m2 == 0, EVEN_N=kv_len % n1 == 0 and kv_len % n2 == 0,
            num_warps=warps, num_stages=stages, **meta)
        return dq, dk, dv
    block_m, block_n, warps, stages = config["dkdv"]
    runnable(_attention_dkdv_kernel, q.device)[(cdiv(kv_len, block_n), batch * n_kv_heads)](
        q, k, v, dout, lse2, delta, dk, dv, key_start, query_end, *common, BLOCK_M=block_m, BLOCK_N=block_n,
        EVEN_M=seq_len % block_m == 0, EVEN_N=kv_len % block_n == 0, num_warps=warps, num_stages=stages, **meta)
    block_m, block_n, warps, stages = config["dq"]
    runnable(_attention_dq_kernel, q.device)[(cdiv(seq_len, block_m), batch * n_heads)](
        q, k, v, dout, lse2, delta, dq, key_start, *common, BLOCK_M=block_m, BLOCK_N=block_n,
        EVEN_M=seq_len % block_m == 0, EVEN_N=kv_len % block_n == 0, num_warps=warps, num_stages=stages, **meta)
    return dq, dk, dv
