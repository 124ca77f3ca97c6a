"""Shared by the optimizer tests: a toy GPT made of megalite TP layers, its data, and result transport."""
import torch
import torch.nn.functional as F
from torch import nn

from megalite.parameters import params as P
from megalite.tensor_parallel import mappings
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, linear

V, H, FFN, SEQ, GLOBAL_BATCH = 16, 8, 16, 8, 8


class ToyGPT(nn.Module):
    """[b, s] ids -> summed next-token loss. Embedding tied to the output layer (two grad deliveries)."""

    def __init__(self, tp_group=None, sequence_parallel=False):
        super().__init__()
        self.tp_group, self.sp = tp_group, sequence_parallel
        self.embedding = VocabParallelEmbedding(V, H, tp_group)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            block = nn.Module()
            block.norm = nn.LayerNorm(H)
            block.fc1 = ColumnParallelLinear(H, FFN, tp_group=tp_group, sequence_parallel=sequence_parallel)
            block.fc2 = RowParallelLinear(FFN, H, tp_group=tp_group, sequence_parallel=sequence_parallel)
            self.blocks.append(block)
        self.final_norm = nn.LayerNorm(H)
        for module in [self.final_norm] + [b.norm for b in self.blocks]:
            for p in module.parameters():
                P.declare(p, sequence_parallel_grad=sequence_parallel)

    def forward(self, ids, targets):
        x = self.embedding(ids.t())  # [s, b, h]
        if self.sp:
            x = mappings.scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/tp, b, h]
        for block in self.blocks:
            x = x + block.fc2(F.gelu(block.fc1(block.norm(x))))
        x = self.final_norm(x)
        if self.sp:
            x = mappings.gather_from_sequence_parallel_region(x, self.tp_group)  # [s, b, h]
        else:
            x = mappings.copy_to_tensor_parallel_region(x, self.tp_group)
        logits = linear(x, self.embedding.weight)  # [s, b, V/tp]
        return vocab_parallel_cross_entropy(logits.float(), targets.t(), self.tp_group).sum()


def toy_batch(step):
    tokens = torch.randint(V, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def portable(obj):
    """Tensors -> numpy so results travel back by value (torch pickles tensors as shared fds)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(v) for v in obj)
    return obj


def sharded_adamw(model, m, *, zero_stage, bucket_size=64, **optimizer_kwargs):
    """A DataParallel wrapper over `model` and megalite's AdamW over the shard it hands out."""
    from megalite.data_parallel import DataParallel
    from megalite.optim.distributed_optimizer import DistributedOptimizer

    return DistributedOptimizer(DataParallel(model, m, zero_stage=zero_stage, bucket_size=bucket_size,
                                             dp_reduction="sum"),
                                **optimizer_kwargs)
