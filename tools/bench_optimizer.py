"""Muon's Newton-Schulz against the training step it belongs to, on this machine's device.

    python tools/bench_optimizer.py --model tiny-llama --repeats 5

One process (dp 1): a forward and backward of one microbatch, then the optimizer step with AdamW and with
Muon (bf16 and fp32 Newton-Schulz), and the Newton-Schulz iterations alone over the model's hidden
matrices (each q, k, v, gate, up block separately, as Muon runs them). Prints milliseconds (median of
--repeats) and Muon's extra step time as a share of the whole step (forward + backward + optimizer).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from megalite.parameters import params as P
from megalite.data_parallel import DataParallel
from megalite.distributed.mesh import single_process_mesh
from megalite.model import GPTModel, preset
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.optim.muon import MuonSettings, default_hidden_matrix, matrix_blocks, newton_schulz


def _ms(fn, repeats: int, device: torch.device) -> float:
    """Median milliseconds of fn() (one warm-up call first)."""
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    mesh = single_process_mesh()
    cfg = preset(args.model)
    model = GPTModel(cfg, mesh, seed=1)
    ids = torch.randint(0, cfg.vocab_size, (args.micro_batch_size, cfg.seq_length), device=mesh.device)

    def forward_backward():
        model.zero_grad(set_to_none=True)
        model(ids, ids, reduction="mean").backward()

    print(f"{args.model}, micro batch {args.micro_batch_size}, {mesh.device.type}, torch {torch.__version__}",
          flush=True)
    rows = [("forward + backward", _ms(forward_backward, args.repeats, mesh.device))]
    for label, muon in (("AdamW step", None), ("Muon step (bf16 NS)", MuonSettings()),
                        ("Muon step (fp32 NS)", MuonSettings(ns_dtype=torch.float32))):
        wrapped = GPTModel(cfg, mesh, seed=1)
        wrapper = DataParallel(wrapped, mesh)
        optimizer = DistributedOptimizer(wrapper, lr=1e-4, muon=muon)
        optimizer.zero_grad()
        wrapper.set_last_microbatch(True)
        wrapped(ids, ids, reduction="mean").backward()  # a gradient in the wrapper's buffers that every step reuses
        rows.append((label, _ms(optimizer.step, args.repeats, mesh.device)))
        print(f"  {label:<42} {rows[-1][1]:9.2f} ms", flush=True)
    blocks = [p.detach().narrow(dim, start, size).float().contiguous() for n, p in model.logical_parameters()
              if default_hidden_matrix(n, p) for dim, start, size in matrix_blocks(P.shard_spec(p))]
    for dtype in (torch.bfloat16, torch.float32):
        rows.append((f"Newton-Schulz alone ({str(dtype)[6:]}, {len(blocks)} matrices)",
                     _ms(lambda: [newton_schulz(b, (3.4445, -4.7750, 2.0315), 5, 1e-7, dtype) for b in blocks],
                         args.repeats, mesh.device)))
    for label, ms in rows[-2:]:
        print(f"  {label:<42} {ms:9.2f} ms")
    times = dict(rows)
    step = times["forward + backward"] + times["AdamW step"]
    print(f"  {'forward + backward':<42} {times['forward + backward']:9.2f} ms")
    for label in ("Muon step (bf16 NS)", "Muon step (fp32 NS)"):
        extra = times[label] - times["AdamW step"]
        print(f"  {label} over AdamW: +{extra:.2f} ms = {100 * extra / step:.1f}% of a one-microbatch AdamW step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
