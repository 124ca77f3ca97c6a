"""Attention over packed documents, forward + backward: megalite's varlen path against FlexAttention's
block mask and SDPA once per document (issue 45). Not a test: it asserts no time.

    python tools/bench_documents.py                       # GPU: 8192 tokens, documents averaging 512, bf16
    python tools/bench_documents.py --seq 4096 --heads 8  # CPU: fp32, forward only for FlexAttention

Documents: lengths drawn from an exponential of the given mean (seeded), cut at the sequence end, so
short and long ones mix as in a packed corpus. Rows (median milliseconds, fwd+bwd unless marked):
- megalite: `kernels.attention(documents=DocumentMask)`: the Triton kernels on CUDA (tiles outside the
  documents skipped), the per-document SDPA loop elsewhere;
- flex: torch's flex_attention with the block mask of the same documents (torch.compile'd on CUDA;
  forward only on CPU, which has no FlexAttention backward);
- per-document SDPA: one SDPA call per document (what the tiles' work should approach);
- dense mask: one SDPA call with the [s, s] boolean mask (for scale: what a per-layer dense mask costs).
It also prints the share of the causal tiles the kernels visit at the launcher's tile sizes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from megalite.kernels import attention
from megalite.kernels.attention_documents import DocumentMask


def document_lengths(seq: int, mean: float, seed: int) -> list[int]:
    """Exponential lengths of `mean` (at least 1), the last cut to fill `seq` tokens exactly."""
    gen, lengths, left = torch.Generator().manual_seed(seed), [], seq
    while left > 0:
        n = min(left, max(1, int(torch.empty(1).exponential_(1.0 / mean, generator=gen))))
        lengths.append(n)
        left -= n
    return lengths


def visited_tile_share(key_start: list[int], block_m: int, block_n: int) -> float:
    """Key tiles the forward visits over a document mask / over plain causal attention (one sample)."""
    seq = len(key_start)
    visited = causal = 0
    for first_row in range(0, seq, block_m):
        last_row = min(first_row + block_m, seq) - 1
        end = last_row // block_n + 1
        visited += end - key_start[first_row] // block_n
        causal += end
    return visited / causal


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (compilation)
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _candidates(q, k, v, mask: DocumentMask, lengths: list[int], backward: bool) -> dict:
    rows = torch.arange(q.shape[2], device=q.device)
    key_start = mask.key_start[0].long()

    def run(fn):
        def step():
            out = fn()
            if backward:
                out.backward(torch.ones_like(out))
        return step

    def per_document():
        parts, start = [], 0
        for n in lengths:
            sl = slice(start, start + n)
            parts.append(F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True))
            start += n
        return torch.cat(parts, dim=2)

    dense = (rows[None, :] <= rows[:, None]) & (rows[None, :] >= key_start[:, None])  # [s, s]
    found = {"megalite": run(lambda: attention(q, k, v, documents=mask)),
             "per-document SDPA": run(per_document),
             "dense mask SDPA": run(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense))}
    block = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (ki >= key_start[qi]), None, None, q.shape[2],
                              q.shape[2], device=q.device.type)
    flex = torch.compile(flex_attention) if q.is_cuda else flex_attention
    if q.is_cuda:
        found["flex"] = run(lambda: flex(q, k, v, block_mask=block))
    else:  # no FlexAttention backward on the CPU: inputs that need no gradient
        found["flex (forward only)"] = lambda: flex(q.detach(), k.detach(), v.detach(), block_mask=block)
        found["megalite (forward only)"] = lambda: attention(q.detach(), k.detach(), v.detach(), documents=mask)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--mean", type=float, default=512, help="mean document length")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths = document_lengths(args.seq, args.mean, args.seed)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    mask = DocumentMask.from_position_ids(positions)
    q, k, v = (torch.randn(1, args.heads, args.seq, args.head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    print(f"{len(lengths)} documents, mean {args.seq / len(lengths):.0f} tokens, in {args.seq}; "
          f"heads {args.heads} x d {args.head_dim}, {dtype}, {device}")
    key_start = mask.key_start[0].tolist()
    print(f"tiles the kernels visit, of causal: {visited_tile_share(key_start, 128, 64):.3f} (128x64 tiles); "
          f"Σ len^2 / s^2 = {sum(n * n for n in lengths) / args.seq ** 2:.3f}")
    for name, fn in _candidates(q, k, v, mask, lengths, backward=True).items():
        print(f"  {name:28s} {_median_ms(fn, args.repeats):9.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
