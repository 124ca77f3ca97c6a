"""Use megalite's parallel layers, data-parallel wrapper and sharded optimizer in your own model.

    python examples/custom_transformer.py                                         # one process, CPU ok
    torchrun --nproc_per_node 4 examples/custom_transformer.py --tp 2 --dp 2 --zero 1
    torchrun --nproc_per_node 2 examples/custom_transformer.py --dp 2 --zero 0     # any torch optimizer
    torchrun --nproc_per_node 4 examples/custom_transformer.py --tp 2 --dp 2 --zero 3  # parameters sharded too

A hand-written pre-norm block (Megatron's pattern: column-parallel in, row-parallel out, so each
half of the block needs one all-reduce) on a vocab-parallel embedding and a vocab-parallel cross
entropy that never gathers the logits. The rest is plain torch (LayerNorm, SDPA, GeLU).

`DataParallel` owns the parameters and gradients: it buckets the gradients and reduces them over
dp during the backward. At --zero 0 a plain `torch.optim.AdamW` steps on the reduced gradients;
at --zero 1/2 megalite's `DistributedOptimizer` keeps fp32 state for a 1/dp shard only; at --zero 3
the parameters are sharded too, unit by unit (here the default units: the embedding, each block,
the final norm; the tied head's read of the embedding weight gathers it on demand). The global
batch is fixed and split over dp, and the loss is divided by its token count once, so every
(tp, dp, zero) prints the same losses (float32, to ~1e-6).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from megalite import comm
from megalite.data_parallel import DataParallel
from megalite.mesh import destroy_mesh, init_mesh
from megalite.optim import DistributedOptimizer
from megalite.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                      copy_to_tensor_parallel_region, vocab_parallel_cross_entropy)

VOCAB, HIDDEN, HEADS, LAYERS, SEQ, GLOBAL_BATCH, LR = 100, 64, 4, 2, 32, 8, 3e-3


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, tp: int):
        super().__init__()
        self.local_heads, self.head_dim = heads // tp, hidden // heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, fused_blocks=(hidden, hidden, hidden))  # [Q_r; K_r; V_r]
        self.out = RowParallelLinear(hidden, hidden)
        self.up = ColumnParallelLinear(hidden, 4 * hidden)
        self.down = RowParallelLinear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [b, s, h], the same on every tp rank
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.local_heads, self.head_dim).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, -1))  # this rank's heads -> summed over tp
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, tp: int):
        super().__init__()
        self.embed = VocabParallelEmbedding(VOCAB, HIDDEN, init_method=lambda w: nn.init.normal_(w, std=0.02))
        self.blocks = nn.ModuleList(Block(HIDDEN, HEADS, tp) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss SUM over this rank's tokens (the caller divides by the global token count)."""
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        x = copy_to_tensor_parallel_region(self.norm(x), self.embed.tp_group)  # backward: all-reduce over tp
        logits_shard = x @ self.embed.weight.t()  # tied head: [b, s, V_pad/tp]
        return vocab_parallel_cross_entropy(logits_shard, labels, vocab_size=VOCAB).sum()


def counting_sequences(steps: int) -> torch.Tensor:
    """[steps, GLOBAL_BATCH, SEQ + 1] token ids counting from a random start by a random stride:
    learnable (the next token follows from the last two), so the loss falls visibly."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randint(0, VOCAB, (steps, GLOBAL_BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (steps, GLOBAL_BATCH, 1), generator=gen)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (splits the fixed global batch)")
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                        help="0: torch.optim.AdamW on the reduced grads; 1/2/3: megalite's sharded AdamW "
                             "(3: parameters sharded too)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--metrics-file", default=None, help="JSON lines with step and loss (rank 0)")
    return parser.parse_args(argv)


def build_optimizer(model: DataParallel, zero: int):
    if zero == 0:  # any torch optimizer: decay on matrices only, as megalite's default rule
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=LR, betas=(0.9, 0.95))
    return DistributedOptimizer(model, betas=(0.9, 0.95), weight_decay=0.1)


def main(argv: list[str] | None = None) -> list[float]:
    args = parse(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp * args.dp != world or GLOBAL_BATCH % args.dp or HEADS % args.tp:
        sys.exit(f"custom_transformer: need world = tp x dp ({args.tp} x {args.dp} != {world}), dp dividing "
                 f"{GLOBAL_BATCH} and tp dividing {HEADS}; launch with torchrun --nproc_per_node {args.tp * args.dp}")
    mesh = init_mesh(tp=args.tp, dp=args.dp)
    torch.manual_seed(0)  # the same master weights on every rank: each keeps its tp slice
    # dp_reduction="sum": the loss below is divided by the global batch's tokens, so gradients add up over dp
    model = DataParallel(TinyLM(mesh.tp_size), mesh, zero_stage=args.zero, bucket_size=20_000, dp_reduction="sum")
    optimizer = build_optimizer(model, args.zero)
    data = counting_sequences(args.steps)
    rows = slice(mesh.dp_rank * GLOBAL_BATCH // mesh.dp_size, (mesh.dp_rank + 1) * GLOBAL_BATCH // mesh.dp_size)
    metrics = open(args.metrics_file, "w") if args.metrics_file and mesh.rank == 0 else None
    losses = []
    for step in range(args.steps):
        model.zero_grad()
        batch = data[step, rows]
        loss = model(batch[:, :-1], batch[:, 1:]) / (GLOBAL_BATCH * SEQ)  # normalised once, globally
        loss.backward()  # the buckets' dp reductions start during the backward
        if args.zero == 0:
            model.finish_grad_sync()  # every param.grad is now the gradient of the whole global batch
            optimizer.step()
        else:
            optimizer.step(LR)
        losses.append(float(comm.all_reduce(loss.detach().double(), mesh.dp_group)))
        if mesh.rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f} (tp={mesh.tp_size} dp={mesh.dp_size} zero={args.zero}; "
                  f"dp bytes so far {comm.ledger.total_bytes(group='dp')})")
        if metrics is not None:
            metrics.write(json.dumps({"step": step, "loss": losses[-1]}) + "\n")
    if metrics is not None:
        metrics.close()
    destroy_mesh()
    return losses


if __name__ == "__main__":
    main()
