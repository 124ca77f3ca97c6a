"""Flash attention (Dao et al. 2022; FlashAttention-2's loop order), causal or not, grouped-query.

    q [b, h, s, d], k and v [b, h_kv, s, d], h % h_kv == 0: query head i reads kv head i // (h / h_kv)
    out = softmax(scale * q k^T [+ causal mask]) v          (scale defaults to 1/sqrt(d))

Supported by the kernels: head dims 1..128: natively 16, 32, 64, 128 (SUPPORTED_HEAD_DIMS), any
other zero-padded to the next of those (exact, at the cost of a copy); float16 / bfloat16 /
float32 (float32 dots run in full fp32, "ieee", not tf32); the same sequence length for q and k
when causal (the diagonal), any kv length otherwise.

Forward: one program per (query block, batch*head) streams key/value blocks with an online
softmax (running max m and sum l per row, in base 2: exp2 with scale*log2(e) folded in) and
saves lse2 = m + log2(l) per row, fp32 [b, h, s]. A causal program stops at its diagonal;
only the blocks crossing the diagonal or the sequence end pay for masking, and causal
programs run last query block first (the longest rows do not trail the grid).

Backward (no atomics): kernels/flash_attention_backward.py. Tiles per kernel come from the
measured table in kernels/attention_tiles.py; `attention` with MEGALITE_KERNEL_BACKEND=auto
may run torch's SDPA instead where it measured faster (kernels/attention_dispatch.py).

Ring attention (megalite.context_parallel) runs these kernels on one block of a longer softmax
row at a time (`attention_block.py`: forward with its log-sum-exp, backward from the row's
final output and log-sum-exp).

Dropout (DROPOUT): the forward drops probabilities after the normaliser has summed them, with
the Philox mask of kernels/attention_torch.py (a pure function of the batch, head, row and
column of a score, so any tiling regenerates it); both backward kernels regenerate it: dv from
the kept, rescaled p, dp masked and rescaled the same way; delta = rowsum(dout * out) is
unchanged (it equals rowsum(dp_dropped * p_dropped)). Nothing per score is kept. Dropout needs
kv_len == seq_len (whole attention, not one block of a ring).
"""
from __future__ import annotations

import math

import torch

from .attention_backward_steps import document_key_range, philox_keep
from .attention_tiles import backward_for, tiles_for
from .attention_torch import attention_dropout_reference, attention_dropout_torch
from .attention_dispatch import choose, sdpa
from .attention_documents import DocumentMask, attention_documents_reference
from .dispatch import HAVE_TRITON, backend_name, cdiv, check_float_dtype, check_same_device, new_output, runnable, \
    tl, triton, use_triton
from .flash_attention_backward import LOG2E, launch_backward, strides
from .philox import drop_threshold

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


def attention_reference(q, k, v, causal: bool = True, softmax_scale: float | None = None, dropout_p: float = 0.0,
                        dropout_seed: int = 0, dropout_offset: int = 0) -> torch.Tensor:
    if dropout_p > 0.0:
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return attention_dropout_reference(q, k, v, causal, scale, dropout_p, dropout_seed, dropout_offset)
    return sdpa(q, k, v, causal, softmax_scale, native_gqa=False)


@triton.jit
def _forward_steps(acc, row_sum, row_max, q, k_base, v_base, k_stride_s, v_stride_s, offs_m, offs_d, start, end,
                   kv_len, scale_log2, dropout_seed, row_lo, row_hi, threshold, row_key_start, BLOCK_N: tl.constexpr,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr,
                   KEY_MASK: tl.constexpr):
    """The online softmax over key blocks [start, end): acc [BLOCK_M, D], row_sum, row_max [BLOCK_M]
    (fp32, base 2). MASKED: the blocks cross the diagonal (CAUSAL) or the end of the keys. KEY_MASK:
    they cross a document's (or the window's) first key, row_key_start [BLOCK_M] (attention_documents);
    a row may then see none of a block's keys, so the running max is kept finite for the exponentials."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + cols[None, :] * k_stride_s + offs_d[:, None]
        v_ptrs = v_base + cols[:, None] * v_stride_s + offs_d[None, :]
        if MASKED:
            k_t = tl.load(k_ptrs, mask=cols[None, :] < kv_len, other=0.0)  # [HEAD_DIM, BLOCK_N]
        else:
            k_t = tl.load(k_ptrs)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N], base 2
        if MASKED:
            valid = cols[None, :] < kv_len
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= cols[None, :])
            scores = tl.where(valid, scores, float("-inf"))
        if KEY_MASK:
            scores = tl.where(cols[None, :] >= row_key_start[:, None], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        reference = new_max
        if KEY_MASK:  # a row with no key yet: exp2(-inf - 0) = 0, never exp2(-inf - -inf)
            reference = tl.where(new_max == float("-inf"), 0.0, new_max)
        alpha = tl.exp2(row_max - reference)
        p = tl.exp2(scores - reference[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        if DROPOUT:  # the normaliser sums every p; only the kept ones reach v
            p = tl.where(philox_keep(dropout_seed, row_lo[:, None], row_hi[:, None], cols[None, :], threshold), p, 0.0)
        if MASKED:
            v = tl.load(v_ptrs, mask=cols[:, None] < kv_len, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max
    return acc, row_sum, row_max


@triton.jit
def _key_block_bounds(start_m, seq_len, kv_len, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(unmasked_end, end_n) for query block `start_m`: keys [0, unmasked_end) need no mask (before the
    diagonal, inside kv_len); [unmasked_end, end_n) are masked; none after end_n is seen."""
    if CAUSAL:  # kv_len == seq_len
        unmasked_end = start_m * BLOCK_M  # BLOCK_M % BLOCK_N == 0, so this is a block boundary
        end_n = tl.minimum((start_m + 1) * BLOCK_M, seq_len)
    else:
        unmasked_end = (kv_len // BLOCK_N) * BLOCK_N
        end_n = kv_len
    return unmasked_end, end_n


@triton.jit(do_not_specialize=["n_batch", "dropout_seed", "dropout_offset", "drop_threshold"])
def _attention_forward_kernel(Q, K, V, O, LSE, KEY_START, q_stride_b, q_stride_h, q_stride_s, k_stride_b, k_stride_h,
                              k_stride_s, v_stride_b, v_stride_h, v_stride_s, o_stride_b, o_stride_h, o_stride_s,
                              n_heads, group_size, seq_len,
                              kv_len, scale_log2, n_batch, dropout_seed, dropout_offset, drop_threshold,
                              dropout_scale, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr,
                              VARLEN: tl.constexpr):
    start_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks see the most keys: start them first
        start_m = tl.num_programs(0) - 1 - start_m
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // n_heads, batch_head % n_heads
    kv_head = head // group_size
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + batch * q_stride_b + head * q_stride_h + offs_m[:, None] * q_stride_s + offs_d[None, :],
                mask=offs_m[:, None] < seq_len, other=0.0)
    k_base = K + batch * k_stride_b + kv_head * k_stride_h
    v_base = V + batch * v_stride_b + kv_head * v_stride_h
    # Philox counter of score (row, col) = dropout_offset + ((head * b + batch) * s + row) * s + col,
    # handled as 32-bit halves (lo, hi) so that no [BLOCK_M, BLOCK_N] tile is 64-bit
    row_start = dropout_offset + ((head * n_batch + batch) * seq_len + offs_m) * seq_len  # [BLOCK_M] int64
    row_lo, row_hi = row_start.to(tl.uint32), (row_start >> 32).to(tl.uint32)
    threshold = drop_threshold.to(tl.uint32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Stage 1: key blocks that need no mask (every key < every query of this block, and < kv_len).
    # Stage 2: the blocks that cross the diagonal or the end of the sequence, masked.
    # Documents (VARLEN, causal): the key blocks before `begin` belong to no row's document (skipped),
    # [begin, inner) cross some row's first key (masked).
    unmasked_end, end_n = _key_block_bounds(start_m, seq_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    begin = 0
    row_key_start = offs_m  # unused without documents
    if VARLEN:
        row_key_start = tl.load(KEY_START + batch * seq_len + offs_m, mask=offs_m < seq_len, other=0)
        begin, inner = document_key_range(KEY_START, batch, seq_len, start_m * BLOCK_M, unmasked_end, BLOCK_M,
                                          BLOCK_N)
        acc, row_sum, row_max = _forward_steps(acc, row_sum, row_max, q, k_base, v_base, k_stride_s, v_stride_s,
                                               offs_m, offs_d, begin, inner, kv_len, scale_log2, dropout_seed, row_lo,
                                               row_hi, threshold, row_key_start, BLOCK_N, False, CAUSAL, DOT_PRECISION,
                                               DROPOUT, True)
        begin = inner
    acc, row_sum, row_max = _forward_steps(acc, row_sum, row_max, q, k_base, v_base, k_stride_s, v_stride_s, offs_m,
                                           offs_d, begin, unmasked_end, kv_len, scale_log2, dropout_seed, row_lo,
                                           row_hi, threshold, row_key_start, BLOCK_N, False, CAUSAL, DOT_PRECISION,
                                           DROPOUT, False)
    acc, row_sum, row_max = _forward_steps(acc, row_sum, row_max, q, k_base, v_base, k_stride_s, v_stride_s, offs_m,
                                           offs_d, unmasked_end, end_n, kv_len, scale_log2, dropout_seed, row_lo,
                                           row_hi, threshold, row_key_start, BLOCK_N, True, CAUSAL, DOT_PRECISION,
                                           DROPOUT, VARLEN)
    acc = acc / row_sum[:, None]
    if DROPOUT:
        acc = acc * dropout_scale
    row_ok = offs_m < seq_len
    tl.store(O + batch * o_stride_b + head * o_stride_h + offs_m[:, None] * o_stride_s + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + batch_head * seq_len + offs_m, row_max + tl.log2(row_sum), mask=row_ok)


def _config(head_dim: int, device: torch.device, dtype: torch.dtype, dropout: bool = False,
            causal: bool = True) -> dict:
    """Per kernel (BLOCK_M, BLOCK_N, num_warps, num_stages), and the dots' input precision.

    Tiles come from the measured table in kernels/attention_tiles.py (a safe choice for a GPU
    or shape nobody measured; small tiles in the interpreter, so that odd shapes cross many
    blocks). float32 dots run in full precision ("ieee") on the FMA units; tf32 is ignored for
    16-bit inputs. "backward" names the backward variant (attention_tiles.backward_for). tools/tune_attention.py overrides this function to time candidates.
    """
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return dict(tiles_for(device, head_dim, dtype, causal, dropout), precision=precision,
                backward=backward_for(device, head_dim, dtype, causal, dropout))


def _padded_head_dim(head_dim: int) -> int:
    """The kernel's head dim: the smallest of SUPPORTED_HEAD_DIMS that holds head_dim."""
    return next(d for d in SUPPORTED_HEAD_DIMS if d >= head_dim)


def _pad_head_dim(head_dim: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Zero-pad the last dim to the kernel's head dim: zero columns change no dot product."""
    padded = _padded_head_dim(head_dim)
    if padded == head_dim:
        return list(tensors)
    return [torch.nn.functional.pad(t, (0, padded - head_dim)) for t in tensors]


def _output_like(q: torch.Tensor) -> torch.Tensor:
    """An uninitialised [b, h, s, d] output laid out in memory as q is: the model's q is a view of its
    [s, b, h, d] activations, and the output in that order makes the model's permute back a view
    where a contiguous output cost a copy forward and one more of its gradient backward (issue 26)."""
    order = sorted(range(3), key=lambda dim: -q.stride(dim))  # q's dims b, h, s, outermost first
    memory = new_output(tuple(q.shape[dim] for dim in order) + (q.shape[3],), q.dtype, q.device)
    return memory.permute(*(order.index(dim) for dim in range(3)), 3)


NO_DROPOUT = (0.0, 0, 0)


def _dropout_args(batch: int, dropout: tuple[float, int, int]) -> tuple:
    """The kernels' (n_batch, seed, offset, drop threshold, 1 / (1 - p)) arguments."""
    p, seed, offset = dropout
    return batch, seed, offset, drop_threshold(p), 1.0 / (1.0 - p)


def _launch_forward(q, k, v, causal: bool, softmax_scale: float, dropout: tuple[float, int, int] = NO_DROPOUT,
                    out_like_q: bool = False, documents: DocumentMask | None = None):
    """Padded q [b, h, sq, D], k, v [b, h_kv, sk, D] -> (out [b, h, sq, D], lse2 fp32 [b, h, sq], base 2).

    dropout: (p, seed, offset) of the Philox mask (p = 0: none; needs sk == sq). out is contiguous,
    or with `out_like_q` laid out in memory as q is (see `_output_like`). documents: causal attention
    within packed documents (and a window), kernels/attention_documents.py."""
    batch, n_heads, seq_len, head_dim = q.shape
    group_size = n_heads // k.shape[1]
    cfg = _config(head_dim, q.device, q.dtype, dropout[0] > 0.0, causal)
    out = _output_like(q) if out_like_q else new_output((batch, n_heads, seq_len, head_dim), q.dtype, q.device)
    lse2 = new_output((batch, n_heads, seq_len), torch.float32, q.device)
    block_m, block_n, warps, stages = cfg["fwd"]
    runnable(_attention_forward_kernel, q.device)[(cdiv(seq_len, block_m), batch * n_heads)](
        q, k, v, out, lse2, documents.key_start if documents is not None else lse2,  # lse2: never read
        *strides(q), *strides(k), *strides(v), *strides(out), n_heads, group_size, seq_len,
        k.shape[2],
        softmax_scale * LOG2E, *_dropout_args(batch, dropout), CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_PRECISION=cfg["precision"], DROPOUT=dropout[0] > 0.0, VARLEN=documents is not None,
        num_warps=warps, num_stages=stages)
    return out, lse2


def _launch_backward(q, k, v, out, dout, lse2, causal: bool, softmax_scale: float,
                     dropout: tuple[float, int, int] = NO_DROPOUT, documents: DocumentMask | None = None):
    """Padded inputs, out and dout [b, h, sq, D] with unit last stride, lse2 contiguous fp32 [b, h, sq] -> dq, dk, dv
    (kernels/flash_attention_backward.py)."""
    cfg = _config(q.shape[-1], q.device, q.dtype, dropout[0] > 0.0, causal)
    if documents is not None:  # the fused grid with documents spilled 28 bytes at d=128 (sm_90 compile_check)
        cfg["backward"] = "split"
    return launch_backward(q, k, v, out, dout, lse2, causal, softmax_scale, cfg, _dropout_args(q.shape[0], dropout),
                           dropout[0] > 0.0, documents)


class _FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, dropout, documents):
        ctx.head_dim = q.shape[-1]
        q, k, v = _pad_head_dim(ctx.head_dim, q, k, v)
        out, lse2 = _launch_forward(q, k, v, causal, softmax_scale, dropout, out_like_q=True, documents=documents)
        ctx.save_for_backward(q, k, v, out, lse2)  # the dropout mask is regenerated from (seed, offset)
        ctx.causal, ctx.softmax_scale, ctx.dropout, ctx.documents = causal, softmax_scale, dropout, documents
        return out if out.shape[-1] == ctx.head_dim else out[..., :ctx.head_dim].contiguous()

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse2 = ctx.saved_tensors
        (dout,) = _pad_head_dim(ctx.head_dim, dout)
        (dout,) = _unit_stride(dout)  # the model's dout is a view of [s, b, h, d]: no copy needed
        dq, dk, dv = _launch_backward(q, k, v, out, dout, lse2, ctx.causal, ctx.softmax_scale,
                                      ctx.dropout, ctx.documents)
        if q.shape[-1] != ctx.head_dim:
            dq, dk, dv = (t[..., :ctx.head_dim] for t in (dq, dk, dv))
        return dq, dk, dv, None, None, None, None


def _check_shapes(q, k, v) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention: q, k, v must be 4-D: q [b, h, s, d], k and v [b, h_kv, s, d]")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"attention: shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not fit "
                         "q [b, h, s, d], k = v [b, h_kv, s_kv, d]")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")


def _check_kernel_inputs(q, k, v, causal: bool) -> None:
    """What the Triton path needs beyond the shapes (the reference takes anything SDPA takes)."""
    check_same_device("attention", q, k, v)
    check_float_dtype("attention", q, "q")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"attention: q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype} differ; cast them to one")
    if q.shape[-1] > max(SUPPORTED_HEAD_DIMS):
        raise ValueError(f"attention: head dim {q.shape[-1]} is not supported by the Triton kernel; supported: "
                         f"1 to {max(SUPPORTED_HEAD_DIMS)} (native {SUPPORTED_HEAD_DIMS}, others zero-padded) "
                         "(or set MEGALITE_KERNEL_BACKEND=torch)")
    if causal and k.shape[2] != q.shape[2]:
        raise ValueError(f"attention: the causal Triton kernel needs equal q and kv lengths, got {q.shape[2]} and "
                         f"{k.shape[2]} (or set MEGALITE_KERNEL_BACKEND=torch)")


def _check_documents(q, k, causal: bool, documents: DocumentMask) -> None:
    if not causal or k.shape[2] != q.shape[2]:
        raise ValueError("attention: packed documents need causal attention with equal q and kv lengths")
    if tuple(documents.key_start.shape) != (q.shape[0], q.shape[2]) or documents.key_start.device != q.device:
        raise ValueError(f"attention: the document mask is [{', '.join(map(str, documents.key_start.shape))}] on "
                         f"{documents.key_start.device}; q needs [{q.shape[0]}, {q.shape[2]}] on {q.device}")


def _unit_stride(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              softmax_scale: float | None = None, dropout_p: float = 0.0, dropout_seed: int = 0,
              dropout_offset: int = 0, documents: DocumentMask | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [causal]) v with grouped-query heads; q [b, h, s, d], k, v [b, h_kv, s_kv, d].

    Same function as F.scaled_dot_product_attention with k, v heads repeated (repeat_interleave).
    Under MEGALITE_KERNEL_BACKEND=auto a CUDA call runs whichever of the Triton kernels and torch's
    SDPA measured faster for its shape (kernels/attention_dispatch.py); dropout always runs ours.
    With dropout_p > 0 the probabilities are dropped with the Philox mask of (dropout_seed,
    dropout_offset) described in kernels/attention_torch.py, regenerated in backward (nothing per
    score is kept); the PyTorch path computes the same mask. The Triton path needs d <= 128 (16,
    32, 64, 128 natively, others zero-padded), one dtype among float16/bfloat16/float32 and, when
    causal or with dropout, equal q and kv sequence lengths.

    documents: packed documents and/or a sliding window (kernels/attention_documents.py; causal, equal
    lengths): the Triton kernels skip the tiles outside them wherever they can run (SDPA cannot, so
    `auto` picks them on CUDA); the PyTorch path runs SDPA once per document (no dropout there).
    """
    _check_shapes(q, k, v)
    if documents is not None:
        _check_documents(q, k, causal, documents)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    dropout = (float(dropout_p), int(dropout_seed), int(dropout_offset))
    drop_threshold(dropout_p)  # raises on p outside [0, 1)
    if not 0 <= dropout_seed < 2 ** 63 or dropout_offset < 0:
        raise ValueError(f"attention: dropout_seed must be in [0, 2^63) and dropout_offset >= 0, got "
                         f"{dropout_seed}, {dropout_offset}")
    if dropout_p > 0.0 and k.shape[2] != q.shape[2]:
        raise ValueError(f"attention: dropout needs equal q and kv lengths, got {q.shape[2]} and {k.shape[2]}")
    impl = "reference" if q.numel() == 0 else choose(q, k, causal, dropout_p, backend_name(), HAVE_TRITON)[0]
    if documents is not None and impl in ("sdpa", "sdpa_gqa"):  # SDPA would compute every masked tile
        impl = "triton" if q.shape[-1] <= max(SUPPORTED_HEAD_DIMS) else "reference"
    if impl in ("sdpa", "sdpa_gqa"):  # auto, where torch's kernels measured faster (attention_dispatch)
        return sdpa(q, k, v, bool(causal), float(softmax_scale), native_gqa=impl == "sdpa_gqa")
    if impl == "reference" or not use_triton(q):  # use_triton raises where forced Triton cannot run
        if documents is not None:
            if dropout_p > 0.0:
                raise ValueError("attention: dropout within packed documents runs on the Triton kernels only; "
                                 "set the attention dropout to 0 or MEGALITE_KERNEL_BACKEND=triton")
            return attention_documents_reference(q, k, v, documents, softmax_scale)
        if dropout_p > 0.0:
            return attention_dropout_torch(q, k, v, causal, softmax_scale, *dropout)
        return attention_reference(q, k, v, causal, softmax_scale)
    _check_kernel_inputs(q, k, v, causal)
    q, k, v = _unit_stride(q, k, v)
    return _FlashAttentionFunction.apply(q, k, v, bool(causal), float(softmax_scale), dropout, documents)
