"""The flash-attention backward's building blocks, as @triton.jit functions both backward variants
call (kernels/flash_attention_backward.py: "split", two launches; "fused", one grid).

    p = exp2(scale*log2e * q k^T - lse2);  dv = p^T dout;  dp = dout v^T
    ds = p * (dp - delta);  dq = scale * ds k;  dk = scale * ds^T q

- `dkdv_program`: one key block of one kv head. Keeps k, v [BLOCK_N, D] and the fp32 dk, dv
  accumulators in registers and streams, for every query head of its GQA group, the query blocks
  that can see its keys (`dkdv_steps`, one range of query blocks each call).
- `dq_program`: one query block of one query head. Keeps q, dout [BLOCK_M, D] and the fp32 dq
  accumulator, streams the key blocks its rows see (`dq_steps`); dq is converted once, at the end.

Causal masking is a constexpr of each range (CAUSAL_MASK): the ranges that cross the diagonal
mask, the others do not. EVEN_M / EVEN_N (lengths multiples of the blocks) drop every bounds
mask. Dropout regenerates the forward's Philox mask (`philox_keep`, the forward's counters).
"""
from __future__ import annotations

from .dispatch import tl, triton


@triton.jit
def philox_keep(seed, row_lo, row_hi, col, threshold):
    """Which scores the forward kept: row_lo / row_hi are the 32-bit halves of each row's first
    counter and col the column, broadcastable to one tile ([M, 1] with [1, N], or [1, M] with [N, 1])."""
    lo = row_lo + col.to(tl.uint32)
    hi = row_hi + (lo < row_lo).to(tl.uint32)  # carry into the high word
    word, _, _, _ = tl.philox(seed, lo, hi, lo * 0, lo * 0)  # = tl.randint(seed, counter)
    return word >= threshold


@triton.jit
def document_key_range(KEY_START, batch, seq_len, first_row, diagonal, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """(begin, inner) for the query rows [first_row, first_row + BLOCK_M) under a document mask
    (kernels/attention_documents.py: key_start [b, s] int32, monotone in the row): key blocks before
    `begin` hold no key any of the rows sees (skipped); [begin, inner) cross some row's first key
    (masked); [inner, diagonal) every row sees. `diagonal` is a multiple of BLOCK_N, at most first_row."""
    base = KEY_START + batch * seq_len
    first = tl.load(base + first_row)
    last = tl.load(base + tl.minimum(first_row + BLOCK_M, seq_len) - 1)
    begin = (first // BLOCK_N) * BLOCK_N
    return begin, tl.minimum(tl.cdiv(last, BLOCK_N) * BLOCK_N, diagonal)


@triton.jit
def dkdv_steps(dk, dv, k, v, q_base, do_base, lse_base, delta_base, q_stride_s, do_stride_s, offs_n, offs_d,
               start, end, seq_len, scale_log2, dropout_seed, row_counter, threshold, dropout_scale, key_start_base,
               BLOCK_M: tl.constexpr, CAUSAL_MASK: tl.constexpr, EVEN_M: tl.constexpr,
               DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr, KEY_MASK: tl.constexpr):
    """dk, dv [BLOCK_N, D] fp32 += one query head's query blocks [start, end) (transposed: [N, M] tiles).
    row_counter: the Philox counter of this head's row 0, column 0 (int64). KEY_MASK: documents, each
    row's first key from key_start_base (this sample's row of key_start)."""
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = q_base + offs_m[None, :] * q_stride_s + offs_d[:, None]
        do_ptrs = do_base + offs_m[:, None] * do_stride_s + offs_d[None, :]
        if EVEN_M:
            q_t, do = tl.load(q_ptrs), tl.load(do_ptrs)  # [HEAD_DIM, BLOCK_M], [BLOCK_M, HEAD_DIM]
            lse, delta = tl.load(lse_base + offs_m), tl.load(delta_base + offs_m)
        else:
            row_ok = offs_m < seq_len
            q_t = tl.load(q_ptrs, mask=row_ok[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        p_t = tl.exp2(tl.dot(k, q_t, input_precision=DOT_PRECISION) * scale_log2 - lse[None, :])  # [N, M]
        if CAUSAL_MASK:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        if KEY_MASK:
            row_key_start = tl.load(key_start_base + offs_m, mask=offs_m < seq_len, other=0)
            p_t = tl.where(offs_n[:, None] >= row_key_start[None, :], p_t, 0.0)
        if not EVEN_M:
            p_t = tl.where(offs_m[None, :] < seq_len, p_t, 0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        if DROPOUT:  # dv from the kept, rescaled p; dp through the same mask
            row_start = row_counter + offs_m * seq_len
            keep_t = philox_keep(dropout_seed, row_start.to(tl.uint32)[None, :],
                                 (row_start >> 32).to(tl.uint32)[None, :], offs_n[:, None], threshold)
            dv += tl.dot(tl.where(keep_t, p_t * dropout_scale, 0.0).to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
        else:
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def dq_steps(dq, q, do, lse, delta, k_base, v_base, k_stride_s, v_stride_s, offs_m, offs_d, start, end, kv_len,
             scale_log2, dropout_seed, row_lo, row_hi, threshold, dropout_scale, row_key_start,
             BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
             DROPOUT: tl.constexpr, KEY_MASK: tl.constexpr):
    """dq [BLOCK_M, D] fp32 += the key blocks [start, end) of one query block; KEY_MASK: keys before
    each row's first key, row_key_start [BLOCK_M] (documents), are masked."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + cols[:, None] * k_stride_s + offs_d[None, :]
        v_ptrs = v_base + cols[:, None] * v_stride_s + offs_d[None, :]
        if EVEN_N:
            k, v = tl.load(k_ptrs), tl.load(v_ptrs)  # [BLOCK_N, HEAD_DIM]
        else:
            col_ok = cols[:, None] < kv_len
            k, v = tl.load(k_ptrs, mask=col_ok, other=0.0), tl.load(v_ptrs, mask=col_ok, other=0.0)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2 - lse[:, None])  # [M, N]
        if CAUSAL_MASK:
            p = tl.where(offs_m[:, None] >= cols[None, :], p, 0.0)
        if KEY_MASK:
            p = tl.where(cols[None, :] >= row_key_start[:, None], p, 0.0)
        if not EVEN_N:
            p = tl.where(cols[None, :] < kv_len, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = philox_keep(dropout_seed, row_lo[:, None], row_hi[:, None], cols[None, :], threshold)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def dkdv_program(Q, K, V, DO, LSE, DELTA, DK, DV, KEY_START, QUERY_END, q_stride_b, q_stride_h, q_stride_s, k_stride_b,
                 k_stride_h,
                 k_stride_s, v_stride_b, v_stride_h, v_stride_s, do_stride_b, do_stride_h, do_stride_s,
                 n_heads, group_size, seq_len, kv_len, softmax_scale, scale_log2, n_batch, dropout_seed,
                 dropout_offset, threshold, dropout_scale, block, batch, kv_head, CAUSAL: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr,
                 EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr):
    """dK, dV of key block `block` of (batch, kv_head), summed over the kv head's query heads.
    Documents (VARLEN): the query rows stop at the last key's query_end (no later row sees a key here).

    Causal: query blocks before the one holding the block's first key see none of its keys; every
    later step masks. A second, unmasked loop for the query blocks past the diagonal (the tutorial's
    layout) spills on sm_90 (compile_check, bf16 causal: 44 bytes at d=64, 212 at d=128)."""
    start_n = block * BLOCK_N
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
    first_m = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    end_m = seq_len
    if VARLEN:
        end_m = tl.load(QUERY_END + batch * seq_len + tl.minimum(start_n + BLOCK_N, kv_len) - 1)
    for member in range(0, group_size):
        head = kv_head * group_size + member
        row_base = (batch * n_heads + head) * seq_len  # into lse, delta [b, h, s]
        q_base = Q + batch * q_stride_b + head * q_stride_h
        do_base = DO + batch * do_stride_b + head * do_stride_h
        row_counter = dropout_offset + (head * n_batch + batch) * seq_len * seq_len  # the forward's Philox counters
        dk, dv = dkdv_steps(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, q_stride_s, do_stride_s,
                            offs_n, offs_d, first_m, end_m, seq_len, scale_log2, dropout_seed, row_counter,
                            threshold, dropout_scale, KEY_START + batch * seq_len, BLOCK_M, CAUSAL, EVEN_M,
                            DOT_PRECISION, DROPOUT, VARLEN)
    out_ptrs = ((batch * (n_heads // group_size) + kv_head) * kv_len + offs_n[:, None]) * HEAD_DIM + offs_d[None, :]
    if EVEN_N:
        tl.store(DK + out_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty))
        tl.store(DV + out_ptrs, dv.to(DV.dtype.element_ty))
    else:
        tl.store(DK + out_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty), mask=kv_ok)
        tl.store(DV + out_ptrs, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def dq_program(Q, K, V, DO, LSE, DELTA, DQ, KEY_START, q_stride_b, q_stride_h, q_stride_s, k_stride_b, k_stride_h,
               k_stride_s, v_stride_b, v_stride_h, v_stride_s, do_stride_b, do_stride_h, do_stride_s,
               n_heads, group_size, seq_len, kv_len, softmax_scale, scale_log2, n_batch, dropout_seed,
               dropout_offset, threshold, dropout_scale, block, batch, head, batch_head, CAUSAL: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr,
               EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr):
    """dQ of query block `block` of (batch, head), batch_head = batch * n_heads + head (the caller's:
    recomputed here it held 24 more registers at d=128). Causal: the key blocks every row of the
    block sees run unmasked, then those crossing the diagonal, masked. Documents (VARLEN): the key
    blocks before the rows' documents are skipped, those crossing a document's start masked first."""
    start_m = block * BLOCK_M
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
    # Causal: key blocks before diag_start are seen by every query of the block (unmasked);
    # [diag_start, end of the block's rows) cross the diagonal (masked).
    diag_start = (start_m // BLOCK_N) * BLOCK_N if CAUSAL else kv_len
    begin = 0
    row_key_start = offs_m  # unused without documents
    # Documents: each row's first key [BLOCK_M] (rows past the end take the last row's, never stored); from
    # the rows' first document on every step masks (a third, unmasked loop spilled: compile_check, fp32)
    if VARLEN:
        row_key_start = tl.load(KEY_START + batch * seq_len + tl.minimum(offs_m, seq_len - 1))
        begin, _ = document_key_range(KEY_START, batch, seq_len, start_m, diag_start, BLOCK_M, BLOCK_N)
    dq = dq_steps(dq, q, do, lse, delta, k_base, v_base, k_stride_s, v_stride_s, offs_m, offs_d, begin, diag_start,
                  kv_len, scale_log2, dropout_seed, row_lo, row_hi, threshold, dropout_scale, row_key_start,
                  BLOCK_N, False, EVEN_N, DOT_PRECISION, DROPOUT, VARLEN)
    if CAUSAL:
        dq = dq_steps(dq, q, do, lse, delta, k_base, v_base, k_stride_s, v_stride_s, offs_m, offs_d, diag_start,
                      tl.minimum(start_m + BLOCK_M, seq_len), kv_len, scale_log2, dropout_seed, row_lo, row_hi,
                      threshold, dropout_scale, row_key_start, BLOCK_N, True, EVEN_N, DOT_PRECISION, DROPOUT, VARLEN)
    out_ptrs = DQ + (batch_head * seq_len + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
    if EVEN_M:
        tl.store(out_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty))
    else:
        tl.store(out_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
