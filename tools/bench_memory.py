#!/usr/bin/env python3
"""Saved-activation bytes per transformer layer: measured, the planner's, and Korthikanti et al.'s.

For the six techniques of Korthikanti et al. 2022, Table 2 (no parallelism, TP, TP+SP, TP +
selective recompute, TP+SP + selective recompute, full recompute) one GPT block runs a training
forward at a small shape and its kept bytes are measured:
  CPU   autograd's saved-tensor hooks count every distinct storage the block keeps for backward
        (megalite.model.activation_probe), through megalite's Triton autograd functions with the
        launches skipped (what a GPU keeps) or the PyTorch paths (what a CPU run keeps);
        tensor-parallel techniques fork a gloo world of --tp ranks;
  CUDA  (when a GPU is present) torch.cuda.memory_allocated after the forward, less what existed
        before, less the block's output, plus its input (the probe's convention), and the
        forward's peak from max_memory_allocated. Tensor-parallel rows need --tp GPUs: run under
        `torchrun --nproc_per_node 2 tools/bench_memory.py`; a single process measures the tp = 1 rows.
Beside each: the planner's count (megalite.plan.activations.layer_activation_bytes) and the
paper's formula (Eqs. 1-6), as bytes / (s*b*h) and as ratios.

    python tools/bench_memory.py                        # s=128 b=2 h=64 a=4, bf16, dropout 0.1, tp=2
    python tools/bench_memory.py --seq 256 --hidden 128 --heads 8 --backend torch --json
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch

from megalite.config import RunConfig
from megalite.model.activation_probe import TECHNIQUES, Technique, measure_table
from megalite.config.model import GPTConfig
from megalite.plan.activations import layer_activation_bytes
from megalite.errors import reports_usage_errors
from megalite.cli import OneLineParser
from megalite.distributed import comm
from megalite.model.recompute import checkpoint_with_rng
from megalite.distributed.layer_groups import LayerGroups
from megalite.model.transformer import TransformerBlock
from megalite.tensor_parallel.random import TensorParallelRNG
from megalite.distributed.mesh import init_mesh

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class MemoryRow:
    technique: str
    measured_bytes: int
    planner_bytes: int
    paper_bytes: float
    sbh: int
    cuda_bytes: int | None = None
    cuda_peak_bytes: int | None = None

    def ratios(self) -> dict[str, float]:
        return {"measured/paper": self.measured_bytes / self.paper_bytes,
                "planner/paper": self.planner_bytes / self.paper_bytes,
                "measured/planner": self.measured_bytes / self.planner_bytes}


def planner_layout(technique: Technique, tp: int, batch: int, precision: str) -> RunConfig:
    """The run a technique is: tp (when tensor-parallel), SP, recompute, micro batch, precision."""
    return RunConfig.build(tp=tp if technique.tensor_parallel else 1, sequence_parallel=technique.sequence_parallel,
                           recompute=technique.recompute, micro_batch_size=batch, precision=precision)


def memory_table(config: GPTConfig, seq: int, batch: int, tp: int, precision: str = "bf16",
                 backend: str = "triton") -> list[MemoryRow]:
    """Every technique: measured on CPU (saved-tensor hooks), the planner's bytes and the paper's."""
    measured = measure_table(config, seq=seq, batch=batch, tp=tp, dtype=DTYPES[precision], backend=backend)
    attention = "triton" if backend == "triton" else "reference"  # what the measured path runs, as the planner names it
    return [MemoryRow(t.name, row.measured_bytes,
                      layer_activation_bytes(config, planner_layout(t, tp, batch, precision), attention=attention),
                      row.formula_bytes, row.sbh) for t, row in zip(TECHNIQUES, measured)]


def cuda_layer_bytes(config: GPTConfig, technique: Technique, tp_group, seq: int, batch: int,
                     dtype: torch.dtype) -> tuple[int, int]:
    """(kept bytes, forward peak bytes) of one block on the current CUDA device, by the allocator."""
    tp = comm.group_size(tp_group) if technique.tensor_parallel else 1
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    groups = LayerGroups(tp=tp_group if technique.tensor_parallel else None)
    block = TransformerBlock(config, groups, sequence_parallel=technique.sequence_parallel, dtype=dtype, device=device,
                             layer_number=0).train()
    block.recompute_core = technique.recompute == "selective"
    rows = seq // tp if technique.sequence_parallel else seq
    x = torch.randn(rows, batch, config.hidden_size, dtype=dtype, device=device, requires_grad=True)  # [s(/tp), b, h]
    rng = TensorParallelRNG(seed=1234)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = checkpoint_with_rng(block, rng, x, None, rng) if technique.recompute == "full" else block(x, None, rng)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes() + x.untyped_storage().nbytes()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return kept, peak


def add_cuda_column(rows: list[MemoryRow], config: GPTConfig, seq: int, batch: int, tp: int,
                    precision: str) -> list[MemoryRow]:
    """The allocator's bytes for every technique this process can run: tp = 1 ones alone, all of
    them under torchrun with `tp` ranks (one GPU each)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = None
    if world == tp and tp > 1:
        mesh = init_mesh(tp=tp)
    out = []
    for technique, row in zip(TECHNIQUES, rows):
        if technique.tensor_parallel and mesh is None:
            out.append(row)
            continue
        group = mesh.tp_group if technique.tensor_parallel else None
        kept, peak = cuda_layer_bytes(config, technique, group, seq, batch, DTYPES[precision])
        out.append(MemoryRow(**{**asdict(row), "cuda_bytes": kept, "cuda_peak_bytes": peak}))
    return out


def print_table(rows: list[MemoryRow], header: str) -> None:
    print(header)
    print(f"{'technique':50s} {'measured':>9s} {'planner':>9s} {'paper':>7s} {'meas/paper':>10s} "
          f"{'plan/paper':>10s} {'meas/plan':>9s} {'cuda':>7s} {'cuda peak':>9s}   (bytes / sbh)")
    for row in rows:
        r = row.ratios()
        cuda = f"{row.cuda_bytes / row.sbh:7.3f} {row.cuda_peak_bytes / row.sbh:9.3f}" if row.cuda_bytes is not None \
            else f"{'-':>7s} {'-':>9s}"
        print(f"{row.technique:50s} {row.measured_bytes / row.sbh:9.3f} {row.planner_bytes / row.sbh:9.3f} "
              f"{row.paper_bytes / row.sbh:7.1f} {r['measured/paper']:10.3f} {r['planner/paper']:10.3f} "
              f"{r['measured/planner']:9.3f} {cuda}")


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--precision", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    parser.add_argument("--backend", choices=("triton", "torch"), default="triton",
                        help="CPU measurement: megalite's Triton autograd functions (what a GPU keeps) or the "
                             "PyTorch paths (what a CPU run keeps)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    config = GPTConfig("gpt2", num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads,
                       seq_length=args.seq, vocab_size=128, hidden_dropout=args.dropout,
                       attention_dropout=args.dropout)
    rank = int(os.environ.get("RANK", "0"))
    rows = memory_table(config, args.seq, args.batch, args.tp, args.precision, args.backend) if rank == 0 else []
    if torch.cuda.is_available():
        rows = add_cuda_column(rows or [MemoryRow(t.name, 0, 0, 1.0, 1) for t in TECHNIQUES], config, args.seq,
                               args.batch, args.tp, args.precision)
    if rank != 0:
        return 0
    if args.json:
        print(json.dumps([{**asdict(r), **r.ratios()} for r in rows], indent=1))
    else:
        print_table(rows, f"saved activation bytes per layer, {args.precision}, dropout {args.dropout}, s={args.seq} "
                          f"b={args.batch} h={args.hidden} a={args.heads}, tp={args.tp} where TP is used; CPU "
                          f"measurement: {args.backend} path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
