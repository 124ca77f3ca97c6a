"""Attention over one block of keys, with its log-sum-exp, and the merge of blocks (online softmax).

A query row's softmax over keys split into blocks B1, B2, ... is recovered exactly from each
block's normalised output o_k and log-sum-exp lse_k = log sum_{j in Bk} exp(scale q.k_j):

    lse = log(sum_k exp(lse_k))         out = sum_k exp(lse_k - lse) * o_k

(Milakov & Gimelshein 2018, "online softmax"; the merge FlashAttention does inside a kernel,
done here across ranks.) The backward of one block needs only the row's final `out` and `lse`:
p = exp(scale q k^T - lse) is the block's slice of the row's probabilities and
delta = rowsum(dout * out) the row's, so every block's gradients are exact on their own.

Shapes: q and k [b, h(_kv), s, d_qk], v [b, h_kv, sk, d_v] (h % h_kv == 0: query head i reads kv head
i // (h / h_kv)), out [b, h, sq, d_v], lse fp32 [b, h, sq]. Causal blocks are square diagonals. The
scores take d_qk, the output d_v: multi-head latent attention has d_qk > d_v (DeepSeek: 192 / 128).

On CUDA (per MEGALITE_KERNEL_BACKEND) the Triton flash-attention kernels run
(`megalite.kernels.attention_forward_with_lse` / `attention_backward_with_lse`) where d_qk = d_v (their
one head dim); elsewhere, and for d_qk != d_v, the
PyTorch code below, which holds the fp32 scores of one tile of at most 1024 query rows of one
block at a time (a block of a long sequence is itself [s/cp, s/cp]).

Packed documents and windows (`BlockMask`): a query row sees the keys at global positions
key_start[row] <= j <= its own. On the Triton path a causal call (a rank's own chunks) takes the
mask in its own rows (`BlockMask.local`: the varlen kernels); a masked full block runs the PyTorch
code on every device (the kernels' documents are causal). The PyTorch code masks each tile from
the block's global positions, never a dense [s, s] tensor. A row that sees no key of a block gets
lse = -inf and out = 0, which the merge drops.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.kernels import DocumentMask, attention_backward_with_lse, attention_forward_with_lse
from megalite.kernels.dispatch import use_triton


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, h, s, d] -> [b, h_kv, h/h_kv, s, d] fp32: query heads grouped under the kv head they read."""
    b, h, s, d = x.shape
    return x.float().reshape(b, kv_heads, h // kv_heads, s, d)


@dataclass(frozen=True)
class BlockMask:
    """Packed documents (and a window) on one block: query_positions [sq] and key_positions [sk] are
    the rows' global positions in the whole sequence (int64), key_start [b, sq] the first global key
    each query row sees (DocumentMask.key_start at those rows)."""

    query_positions: torch.Tensor
    key_positions: torch.Tensor
    key_start: torch.Tensor

    def keep(self, rows: slice, keys: slice) -> torch.Tensor:
        """[b, 1, 1, rows, keys] bool: key_start[i] <= j <= i for the tile's (query i, key j), in
        global positions; broadcasts over the scores' [b, h_kv, group, rows, keys]."""
        queries, seen = self.query_positions[rows], self.key_positions[keys]
        keep = (seen[None, None, :] <= queries[None, :, None]) & (seen[None, None, :] >= self.key_start[:, rows, None])
        return keep[:, None, None]

    def local(self) -> DocumentMask:
        """The mask of a causal square call (its rows are its keys: a rank's own chunks, increasing) in the
        call's own rows, for the varlen kernels: key_start[i] the first local key at or after the global
        one, query_end[j] the first row whose key_start passes j. (position_ids: each row's distance
        from its first key; the kernels read only the two tables.)"""
        key_start = torch.searchsorted(self.key_positions, self.key_start.contiguous())  # [b, s] local
        rows = torch.arange(key_start.shape[1], device=key_start.device).expand_as(key_start).contiguous()
        query_end = torch.searchsorted(key_start, rows, right=True)  # key_start is monotone in the row
        return DocumentMask(key_start.to(torch.int32), query_end.to(torch.int32), rows - key_start)


_ROWS = 1024  # query rows per tile of the PyTorch path: its fp32 scores are [b, h, rows, sk], never [sq, sk]


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, softmax_scale: float, first_row: int = 0,
            keep: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 scale * q k^T of query rows first_row.. of one block: [b, h_kv, group, rows, sk]; when
    causal, keys after a row's own position (row index in the block = key index) are -inf; so are
    the keys outside `keep` ([b, 1, 1, rows, sk], BlockMask.keep) when given."""
    keys = k.float().unsqueeze(2)  # [b, h_kv, 1, sk, d]: broadcast over the group, no repeat
    scores = torch.matmul(_grouped(q, k.shape[1]), keys.transpose(-1, -2)) * softmax_scale
    if causal:
        future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu_(first_row + 1)
        scores = scores.masked_fill(future, float("-inf"))
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _row_tiles(sq: int, sk: int, causal: bool):
    """(rows, keys) slices: query rows in tiles of _ROWS; under causal masking a tile's rows see
    only the keys up to its last row (the rest are all masked)."""
    for start in range(0, sq, _ROWS):
        stop = min(sq, start + _ROWS)
        yield slice(start, stop), slice(0, stop if causal else sk)


def _keep(mask: BlockMask | None, rows: slice, keys: slice) -> torch.Tensor | None:
    return mask.keep(rows, keys) if mask is not None else None


def _torch_forward(q, k, v, causal: bool, softmax_scale: float, mask: BlockMask | None = None):
    b, h, sq, _ = q.shape
    d = v.shape[-1]  # the output takes the values' head dim
    out = torch.empty(b, h, sq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    for rows, keys in _row_tiles(sq, k.shape[2], causal):
        scores = _scores(q[:, :, rows], k[:, :, keys], causal, softmax_scale, rows.start, _keep(mask, rows, keys))
        tile_lse = torch.logsumexp(scores, dim=-1)  # [b, h_kv, group, rows]; -inf where a row sees no key
        finite_lse = tile_lse.masked_fill(torch.isinf(tile_lse), 0.0)  # such a row: probs 0, out 0
        probs = torch.exp(scores - finite_lse.unsqueeze(-1))
        tile_out = torch.matmul(probs, v[:, :, keys].float().unsqueeze(2))  # [b, h_kv, group, rows, d]
        out[:, :, rows] = tile_out.reshape(b, h, -1, d).to(q.dtype)
        lse[:, :, rows] = tile_lse.reshape(b, h, -1)
    return out, lse


def _torch_backward(q, k, v, out, dout, lse, causal: bool, softmax_scale: float, mask: BlockMask | None = None):
    b, h, sq, d = q.shape  # d: d_qk (dq's; dv keeps v's d_v)
    kv_heads = k.shape[1]
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for rows, keys in _row_tiles(sq, k.shape[2], causal):
        q_rows, k_keys, v_keys = q[:, :, rows], k[:, :, keys], v[:, :, keys]
        scores = _scores(q_rows, k_keys, causal, softmax_scale, rows.start, _keep(mask, rows, keys))
        n = q_rows.shape[2]
        probs = torch.exp(scores - lse[:, :, rows].float().reshape(b, kv_heads, h // kv_heads, n, 1))  # the row's
        dout_g = _grouped(dout[:, :, rows], kv_heads)
        delta = (dout_g * _grouped(out[:, :, rows], kv_heads)).sum(-1, keepdim=True)  # [b, h_kv, group, rows, 1]
        dv[:, :, keys] += torch.matmul(probs.transpose(-1, -2), dout_g).sum(2)  # summed over the group
        dprobs = torch.matmul(dout_g, v_keys.float().unsqueeze(2).transpose(-1, -2))
        dscores = probs * (dprobs - delta) * softmax_scale
        dq[:, :, rows] = torch.matmul(dscores, k_keys.float().unsqueeze(2)).reshape(b, h, n, d)
        dk[:, :, keys] += torch.matmul(dscores.transpose(-1, -2), _grouped(q_rows, kv_heads)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _on_kernels(q: torch.Tensor, v: torch.Tensor, causal: bool, mask: BlockMask | None) -> bool:
    """The Triton kernels take one head dim for q, k and v, and a block without a mask or a causal one
    with it (varlen); a masked full block, or values narrower than the keys, run the PyTorch code."""
    return (mask is None or causal) and q.shape[-1] == v.shape[-1] and use_triton(q)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  softmax_scale: float, mask: BlockMask | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over this block of keys: (out in q.dtype, lse fp32 [b, h, sq], natural log).
    mask: packed documents / a window on this block."""
    if _on_kernels(q, v, causal, mask):
        return attention_forward_with_lse(q, k, v, causal, softmax_scale, mask.local() if mask else None)
    return _torch_forward(q, k, v, causal, softmax_scale, mask)


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                   lse: torch.Tensor, causal: bool, softmax_scale: float, mask: BlockMask | None = None):
    """(dq, dk, dv) of this block, given the row's final out, dout and lse (inputs' dtypes)."""
    if _on_kernels(q, v, causal, mask):
        return attention_backward_with_lse(q, k, v, out, dout, lse, causal, softmax_scale,
                                           mask.local() if mask else None)
    return _torch_backward(q, k, v, out, dout, lse, causal, softmax_scale, mask)


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block into the running (out, lse) of the same rows, in place (fp32 views).

    out [b, h, r, d] and lse [b, h, r] start at 0 and -inf: exp(-inf - lse') = 0 drops them.
    """
    merged = torch.logaddexp(lse, block_lse)
    finite = merged.masked_fill(torch.isinf(merged), 0.0)  # rows that saw no key yet stay 0, -inf (documents)
    out.mul_(torch.exp(lse - finite).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse - finite).unsqueeze(-1))
    lse.copy_(merged)
