"""Ring attention over packed documents at cp ranks (forked gloo ranks on this machine): forward +
backward per rank with the documents' mask under the zigzag split and under the per-document split
(--cp-split documents) against plain causal attention, the ring's blocks computed of the causal
ones, and the score area its calls compute (full calls cropped to their visible pairs) of the causal
area, under both splits (issue 45). Not a test: it asserts no time.

    python tools/bench_ring_documents.py --seq 4096 --mean 256 --heads 4 --head-dim 32   # CPU, cp 2

Documents as tools/bench_documents.py draws them (exponential lengths of --mean, seeded). Each rank
runs `context_parallel.ring_attention` on its zigzag chunks (or its tokens of the per-document
split), fp32, one thread per rank; the figures
are the median milliseconds of --repeats runs after a warm-up, the two alternating, per rank. On CUDA the blocks without a mask run the
Triton kernels and the masked ones the PyTorch block code; here (gloo, CPU) every block is PyTorch.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench_documents import document_lengths
from megalite.context_parallel import ring_attention, split_sequence
from megalite.context_parallel.blocks import DIAGONAL, FULL, causal_work, rank_block_counts, ring_plan, ring_source
from megalite.context_parallel.document_split import SplitDocumentMask, local_tokens, split_documents
from megalite.context_parallel.documents import RingDocuments, chunk_visibility
from megalite.context_parallel.split_calls import RingSplit
from megalite.distributed import mesh
from megalite.kernels import DocumentMask
from megalite.testing import run_distributed


def _rank(args) -> dict:
    m = mesh.init_mesh(cp=args.cp)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(1, args.heads, args.seq, args.head_dim, generator=gen) for _ in range(3))
    positions = torch.cat([torch.arange(n) for n in document_lengths(args.seq, args.mean, args.seed)])[None]
    mask = DocumentMask.from_position_ids(positions)
    split = split_documents(mask, m.cp_size)
    times: dict[str, list[float]] = {"documents": [], "split": [], "causal": []}
    for repeat in range(args.repeats + 1):  # the three alternate (a loaded machine slows all alike); 0: warm-up
        for name, documents in (("documents", mask), ("split", split), ("causal", None)):
            local = [_local(t, documents, m).requires_grad_(True) for t in (q, k, v)]
            start = time.perf_counter()
            ring_attention(*local, m.cp_group, documents=documents).sum().backward()
            if repeat:
                times[name].append((time.perf_counter() - start) * 1e3)
    result = {name: statistics.median(runs) for name, runs in times.items()}
    counts = rank_block_counts(m.cp_rank, m.cp_size, visible=chunk_visibility(mask, m.cp_size))
    plain = rank_block_counts(m.cp_rank, m.cp_size)
    result["blocks"] = (counts[FULL] + counts[DIAGONAL], plain[FULL] + plain[DIAGONAL])
    result["area"] = _computed_area(mask, m.cp_rank, m.cp_size) / causal_work(plain)
    result["split area"] = _split_area(split, m.cp_rank, m.cp_size) / causal_work(plain)
    return result


def _local(t: torch.Tensor, documents, m) -> torch.Tensor:
    """[1, h, s, d] -> this rank's tokens [1, h, s/cp, d]: its zigzag chunks, or its tokens of the split."""
    if isinstance(documents, SplitDocumentMask):
        mine = local_tokens(t.transpose(1, 2), documents.order, cp_rank=m.cp_rank, cp=m.cp_size)  # [1, s/cp, h, d]
        return mine.transpose(1, 2).contiguous()
    return split_sequence(t, m.cp_rank, m.cp_size, dim=2)


def _split_area(split: SplitDocumentMask, cp_rank: int, cp: int) -> float:
    """Score elements the ring's calls compute under the per-document split (split_calls.py: each
    document's boxes; a causal call counts half), in chunk x chunk units."""
    chunk, area = split.key_start.shape[1] // (2 * cp), 0.0
    for calls in RingSplit(split, cp_rank=cp_rank, cp=cp).schedule():
        for _, rows, cols, causal, _ in calls:
            size = (rows.stop - rows.start) * (cols.stop - cols.start) / chunk ** 2
            area += size / 2 if causal else size
    return area


def _computed_area(mask: DocumentMask, cp_rank: int, cp: int) -> float:
    """Score elements the ring's calls compute with documents (cropped full calls; a causal call
    counts half), in chunk x chunk units, as ring.py runs them."""
    documents = RingDocuments(mask, cp_rank, cp)
    chunk, area = mask.key_start.shape[1] // (2 * cp), 0.0
    for step, calls in enumerate(ring_plan(cp_rank, cp, visible=documents.visible)):
        for call in calls:
            rows, cols = slice(call.q_start * chunk, call.q_stop * chunk), slice(call.kv_start * chunk,
                                                                                   call.kv_stop * chunk)
            kept = documents.call(rows, cols, ring_source(cp_rank, step, cp), call.causal)
            if kept is not None:
                size = (kept[0].stop - kept[0].start) * (kept[1].stop - kept[1].start) / chunk ** 2
                area += size / 2 if call.causal else size
    return area


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--mean", type=float, default=256, help="mean document length")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    lengths = document_lengths(args.seq, args.mean, args.seed)
    print(f"{len(lengths)} documents, mean {args.seq / len(lengths):.0f} tokens, in {args.seq}; heads {args.heads} "
          f"x d {args.head_dim}, fp32, cp {args.cp} (gloo, CPU)")
    for rank, result in enumerate(run_distributed(_rank, args.cp, args, timeout_s=3600)):
        computed, causal = result["blocks"]
        print(f"  cp rank {rank}: documents {result['documents']:9.1f} ms (zigzag), {result['split']:9.1f} ms (split), "
              f"causal {result['causal']:9.1f} ms; zigzag blocks computed {computed} of {causal}, score area "
              f"{result['area']:.3f} (zigzag), {result['split area']:.3f} (split) of causal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
