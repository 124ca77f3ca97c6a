"""Flash-attention backward (FlashAttention-2's recomputation), no atomics, grouped-query heads.

Given the forward's output `out` and its per-row base-2 log-sum-exp lse2 [b, h, s] fp32:

    delta = rowsum(dout * out)                           (one small kernel first)
    p = exp2(scale*log2e * q k^T - lse2);  dv = p^T dout;  dp = dout v^T
    ds = p * (dp - delta);  dq = scale * ds k;  dk = scale * ds^T q

Work split (no atomics, so the result does not depend on scheduling):
- dK/dV: one program per (key block of BLOCK_N rows, batch * kv_head). It keeps its k, v block
  and the dk, dv accumulators in registers and streams, for every query head of its group
  (GQA is summed here, not by a later reduction), the query blocks that can see its keys.
- dQ: one program per (query block of BLOCK_M rows, batch * head); it streams the key blocks
  its queries see, re-computing p (the price of no atomics: 7 matmuls instead of 5).

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


@triton.jit(do_not_specialize=["n_batch", "dropout_seed", "dropout_offset", "drop_threshold"])
def _attention_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, q_stride_b, q_stride_h, q_stride_s, k_stride_b,
                           k_stride_h, k_stride_s, v_stride_b, v_stride_h, v_stride_s, do_stride_b, do_stride_h,
                           do_stride_s, n_heads, group_size, seq_len,
                           kv_len, softmax_scale, scale_log2, n_batch, dropout_seed, dropout_offset, drop_threshold,
                           dropout_scale, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    batch_kv_head = tl.program_id(1).to(tl.int64)  # = batch * n_kv_heads + kv_head
    n_kv_heads = n_heads // group_size
    batch, kv_head = batch_kv_head // n_kv_heads, batch_kv_head % n_kv_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_ok = offs_n[:, None] < kv_len
    k_ptrs = K + batch * k_stride_b + kv_head * k_stride_h + offs_n[:, None] * k_stride_s + offs_d[None, :]
    v_ptrs = V + batch * v_stride_b + kv_head * v_stride_h + offs_n[:, None] * v_stride_s + offs_d[None, :]
    if EVEN_N:
        k, v = tl.load(k_ptrs), tl.load(v_ptrs)  # [BLOCK_N, HEAD_DIM]
    else:
        k, v = tl.load(k_ptrs, mask=kv_ok, other=0.0), tl.load(v_ptrs, mask=kv_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    # Causal: query blocks before the one holding start_n see none of these keys.
    first_m = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    threshold = drop_threshold.to(tl.uint32)
    for group_member in range(0, group_size):
        head = kv_head * group_size + group_member
        q_base = Q + batch * q_stride_b + head * q_stride_h
        row_base = (batch * n_heads + head) * seq_len  # into lse, delta [b, h, s]
        do_base = DO + batch * do_stride_b + head * do_stride_h
        for start_m in range(first_m, seq_len, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_ptrs = q_base + offs_m[None, :] * q_stride_s + offs_d[:, None]
            do_ptrs = do_base + offs_m[:, None] * do_stride_s + offs_d[None, :]
            if EVEN_M:
                q_t, do = tl.load(q_ptrs), tl.load(do_ptrs)  # [HEAD_DIM, BLOCK_M], [BLOCK_M, HEAD_DIM]
                lse, delta = tl.load(LSE + row_base + offs_m), tl.load(DELTA + row_base + offs_m)
            else:
                row_ok = offs_m < seq_len
                q_t = tl.load(q_ptrs, mask=row_ok[None, :], other=0.0)
                do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
                lse = tl.load(LSE + row_base + offs_m, mask=row_ok, other=0.0)
                delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
            p_t = tl.exp2(tl.dot(k, q_t, input_precision=DOT_PRECISION) * scale_log2 - lse[None, :])  # [N, M]
            if CAUSAL:
                p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
            if not EVEN_M:
                p_t = tl.where(offs_m[None, :] < seq_len, p_t, 0.0)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
            if DROPOUT:  # the forward's mask, regenerated (counters as in the forward, transposed)
                row_start = dropout_offset + ((head * n_batch + batch) * seq_len + offs_m) * seq_len
                row_lo, row_hi = row_start.to(tl.uint32), (row_start >> 32).to(tl.uint32)
                lo_word = row_lo[None, :] + offs_n[:, None].to(tl.uint32)
                hi_word = row_hi[None, :] + (lo_word < row_lo[None, :]).to(tl.uint32)  # carry
                word, _, _, _ = tl.philox(dropout_seed, lo_word, hi_word, lo_word * 0, lo_word * 0)
                keep_t = word >= threshold  # dv from the kept p, dp through the mask
                dv += tl.dot(tl.where(keep_t, p_t * dropout_scale, 0.0).to(do.dtype), do,
                             input_precision=DOT_PRECISION)
                dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
            else:
                dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision=DOT_PRECISION)
    out_ptrs = (batch_kv_head * kv_len + offs_n[:, None]) * HEAD_DIM + offs_d[None, :]
    if EVEN_N:
        tl.store(DK + out_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty))
        tl.store(DV + out_ptrs, dv.to(DV.dtype.element_ty))
    else:
        tl.store(DK + out_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty), mask=kv_ok)
        tl.store(DV + out_ptrs, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit(do_not_specialize=["n_batch", "dropout_seed", "dropout_offset", "drop_threshold"])
def _attention_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, q_stride_b, q_stride_h, q_stride_s, k_stride_b, k_stride_h,
                         k_stride_s, v_stride_b, v_stride_h, v_stride_s, do_stride_b, do_stride_h, do_stride_s,
                         n_heads, group_size, seq_len, kv_len,
                         softmax_scale, scale_log2, n_batch, dropout_seed, dropout_offset, drop_threshold,
                         dropout_scale, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
    block = tl.program_id(0)
    if CAUSAL:  # the last query blocks see the most keys: start them first
        block = tl.num_programs(0) - 1 - block
    start_m = block * BLOCK_M
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // n_heads, batch_head % n_heads
    kv_head = head // group_size
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    q_ptrs = Q + batch * q_stride_b + head * q_stride_h + offs_m[:, None] * q_stride_s + offs_d[None, :]
    do_ptrs = DO + batch * do_stride_b + head * do_stride_h + offs_m[:, None] * do_stride_s + offs_d[None, :]
    if EVEN_M:
        q, do = tl.load(q_ptrs), tl.load(do_ptrs)  # [BLOCK_M, HEAD_DIM]
        lse, delta = tl.load(LSE + batch_head * seq_len + offs_m), tl.load(DELTA + batch_head * seq_len + offs_m)
    else:
        q, do = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0), tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
        lse = tl.load(LSE + batch_head * seq_len + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + batch_head * seq_len + offs_m, mask=row_ok, other=0.0)
    k_base = K + batch * k_stride_b + kv_head * k_stride_h
    v_base = V + batch * v_stride_b + kv_head * v_stride_h
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_start = dropout_offset + ((head * n_batch + batch) * seq_len + offs_m) * seq_len  # as in the forward
    row_lo, row_hi = row_start.to(tl.uint32), (row_start >> 32).to(tl.uint32)
    threshold = drop_threshold.to(tl.uint32)
    # Causal: key blocks before diag_start are seen by every query of the block (phase 0,
    # unmasked); [diag_start, end of the block's rows) cross the diagonal (phase 1, masked).
    diag_start = (start_m // BLOCK_N) * BLOCK_N
    diag_end = tl.minimum(start_m + BLOCK_M, seq_len)
    for phase in tl.static_range(2 if CAUSAL else 1):
        if CAUSAL and phase == 0:
            lo, hi = 0, diag_start
        elif CAUSAL:
            lo, hi = diag_start, diag_end
        else:
            lo, hi = 0, kv_len
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            k_ptrs = k_base + cols[:, None] * k_stride_s + offs_d[None, :]
            v_ptrs = v_base + cols[:, None] * v_stride_s + offs_d[None, :]
            if EVEN_N:
                k, v = tl.load(k_ptrs), tl.load(v_ptrs)  # [BLOCK_N, HEAD_DIM]
            else:
                col_ok = cols[:, None] < kv_len
                k, v = tl.load(k_ptrs, mask=col_ok, other=0.0), tl.load(v_ptrs, mask=col_ok, other=0.0)
            p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2 - lse[:, None])  # [M, N]
            if CAUSAL and phase == 1:
                p = tl.where(offs_m[:, None] >= cols[None, :], p, 0.0)
            if not EVEN_N:
                p = tl.where(cols[None, :] < kv_len, p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            if DROPOUT:
                lo_word = row_lo[:, None] + cols[None, :].to(tl.uint32)
                hi_word = row_hi[:, None] + (lo_word < row_lo[:, None]).to(tl.uint32)
                word, _, _, _ = tl.philox(dropout_seed, lo_word, hi_word, lo_word * 0, lo_word * 0)
                dp = tl.where(word >= threshold, dp * dropout_scale, 0.0)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    out_ptrs = DQ + (batch_head * seq_len + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
    if EVEN_M:
        tl.store(out_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty))
    else:
        tl.store(out_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


LOG2E = 1.4426950408889634  # scores are taken in base 2: exp(x) = exp2(x * log2(e))


def strides(t: torch.Tensor) -> tuple[int, int, int]:
    """A [b, h, s, d] tensor's (batch, head, sequence) strides, as the kernels take them."""
    return t.stride(0), t.stride(1), t.stride(2)


def launch_backward(q, k, v, out, dout, lse2, causal: bool, softmax_scale: float, config: dict,
                    dropout_args: tuple, dropout: bool):
    """Padded q [b, h, sq, D], k, v [b, h_kv, sk, D], out and dout [b, h, sq, D] (all with unit last
    stride, any other strides), lse2 contiguous fp32 [b, h, sq] -> contiguous (dq, dk, dv) like q, k, v.

    `out` and `lse2` are those of the softmax the block belongs to: over these keys only for
    plain attention, over every key of the row for one block of a longer row (ring attention).
    config: flash_attention._config's {"dkdv": (BLOCK_M, BLOCK_N, warps, stages), "dq": ..., "precision":
    the dots' input precision}; dropout_args: the kernels' (n_batch, seed, offset, drop threshold, 1 / (1 - p)).
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
    meta = dict(CAUSAL=causal, HEAD_DIM=head_dim, DOT_PRECISION=config["precision"], DROPOUT=dropout)
    block_m, block_n, warps, stages = config["dkdv"]
    runnable(_attention_dkdv_kernel, q.device)[(cdiv(kv_len, block_n), batch * n_kv_heads)](
        q, k, v, dout, lse2, delta, dk, dv, *common, BLOCK_M=block_m, BLOCK_N=block_n,
        EVEN_M=seq_len % block_m == 0, EVEN_N=kv_len % block_n == 0, num_warps=warps, num_stages=stages, **meta)
    block_m, block_n, warps, stages = config["dq"]
    runnable(_attention_dq_kernel, q.device)[(cdiv(seq_len, block_m), batch * n_heads)](
        q, k, v, dout, lse2, delta, dq, *common, BLOCK_M=block_m, BLOCK_N=block_n,
        EVEN_M=seq_len % block_m == 0, EVEN_N=kv_len % block_n == 0, num_warps=warps, num_stages=stages, **meta)
    return dq, dk, dv
