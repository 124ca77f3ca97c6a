"""Each cp rank's share of the masked attention work of packed documents under the zigzag split and
under the per-document (Megatron THD) split, `--cp-split documents` (context_parallel/balance.py, on
the positions the training path hands each rank; issue 45). Host arithmetic only: no attention runs,
nothing is timed.

    python tools/cp_balance.py --seq 8192 --mean 512 --cp 2 4 --samples 100

Documents as tools/bench_documents.py draws them (exponential lengths of --mean, seeded: sample k
uses seed k), --seq tokens in all, not padded (the per-document split deals each document's last
length % 2cp tokens as one zigzag sequence; --pad rounds every length up to a multiple of 2cp
instead, the split's exactly even case, and the sequence then grows past --seq). Prints sample 0's
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
    parser.add_argument("--pad", action="store_true", help="round every length up to a multiple of 2*cp")
    args = parser.parse_args(argv)
    for cp in args.cp:
        samples = [document_lengths(args.seq, args.mean, seed) for seed in range(args.samples)]
        if args.pad:
            samples = [padded_lengths(lengths, 2 * cp) for lengths in samples]
        print(f"cp {cp}: sample 0 has {len(samples[0])} documents, {sum(samples[0])} tokens"
              f"{' after padding' if args.pad else ''}")
        print(_row("zigzag", zigzag_shares(samples[0], cp, window=args.window)))
        print(_row("per-document", document_split_shares(samples[0], cp, window=args.window)))
        for name, shares in (("zigzag", zigzag_shares), ("per-document", document_split_shares)):
            costs = [imbalance(shares(lengths, cp, window=args.window)) for lengths in samples]
            print(f"    {name:13s} over {args.samples} samples: busiest x cp mean {statistics.mean(costs):.3f}, "
                  f"worst {max(costs):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
