"""Use megalite's tensor-parallel layers inside your own transformer code.

    python examples/custom_transformer.py                        # one process, CPU ok
    torchrun --nproc_per_node 2 examples/custom_transformer.py   # tp=2: same losses

A hand-written pre-norm block (Megatron's pattern: column-parallel in, row-parallel out, so each
half of the block needs one all-reduce) on a vocab-parallel embedding and a vocab-parallel cross
entropy that never gathers the logits. The layers default to the tp group of `init_mesh`.
Weights are built full from the seed and sliced, so the losses printed are the same at any tp.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite import comm
from megalite.mesh import init_mesh
from megalite.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                      copy_to_tensor_parallel_region, vocab_parallel_cross_entropy)


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
    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, tp: int):
        super().__init__()
        self.vocab = vocab
        self.embed = VocabParallelEmbedding(vocab, hidden, init_method=lambda w: nn.init.normal_(w, std=0.02))  # rows split over tp
        self.blocks = nn.ModuleList(Block(hidden, heads, tp) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        x = copy_to_tensor_parallel_region(self.norm(x), self.embed.tp_group)  # backward: all-reduce
        logits_shard = x @ self.embed.weight.t()  # tied head: [b, s, V_pad/tp]
        return vocab_parallel_cross_entropy(logits_shard, labels, vocab_size=self.vocab).mean()


def main(steps: int = 8) -> list[float]:
    mesh = init_mesh(tp=int(__import__("os").environ.get("WORLD_SIZE", "1")))
    torch.manual_seed(0)  # the same master weights on every rank
    model = TinyLM(vocab=100, hidden=64, heads=4, layers=2, tp=mesh.tp_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    data = torch.randint(0, 100, (4, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(steps):
        loss = model(data[:, :-1], data[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if mesh.rank == 0:
            print(f"step {step}: loss {loss.item():.5f} (tp={mesh.tp_size}, tp bytes so far "
                  f"{comm.ledger.total_bytes(group='tp')})")
    return losses


if __name__ == "__main__":
    main()
