"""Each cp rank's share of the masked attention work of packed documents under today's zigzag split
and under the per-document (Megatron THD) split (context_parallel/balance.py; issue 45). Host
arithmetic only: no attention runs, nothing is timed.

    python tools/cp_balance.py --seq 8192 --mean 512 --cp 2 4 --samples 100

Documents as tools/bench_documents.py draws them (exponential lengths of --mean, seeded: sample k
uses seed k), each padded up to a multiple of 2*cp (the per-document split needs it; both splits
are measured on the same padded lengths, so the sequence can grow past --seq). Prints sample 0's
shares, then over --samples samples the mean and the worst of the step's cost over an even split
(the busiest rank's share times cp).
"""
from __future__ import annotations

import argparse
import statistics
import sys

from bench_documents import document_lengths
from megalite.context_parallel.balance import document_split_shares, imbalance, padded_lengths, zigzag_shares


def _row(name: str, shares: list[float]) -> str:
    return f"    {name:13s} shares {' '.join(f'{s:.3f}' for s in shares)}  (busiest x cp = {imbalance(shares):.3f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--mean", type=float, default=512, help="mean document length")
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--samples", type=int, default=100)
    args = parser.parse_args(argv)
    for cp in args.cp:
        samples = [padded_lengths(document_lengths(args.seq, args.mean, seed), 2 * cp) for seed in range(args.samples)]
        print(f"cp {cp}: sample 0 has {len(samples[0])} documents, {sum(samples[0])} tokens after padding")
        print(_row("zigzag", zigzag_shares(samples[0], cp, window=args.window)))
        print(_row("per-document", document_split_shares(samples[0], cp, window=args.window)))
        for name, shares in (("zigzag", zigzag_shares), ("per-document", document_split_shares)):
            costs = [imbalance(shares(lengths, cp, window=args.window)) for lengths in samples]
            print(f"    {name:13s} over {args.samples} samples: busiest x cp mean {statistics.mean(costs):.3f}, "
                  f"worst {max(costs):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
