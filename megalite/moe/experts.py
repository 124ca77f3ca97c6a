"""The experts of one MoE layer held by this rank: SwiGLU (llama) or GeLU (gpt2) MLPs without biases.

Each expert is its own pair of parameters, named by its *global* index (`experts.{e}.fc1_weight`,
`experts.{e}.fc2_weight`), so names, checkpoints and the HF mapping never depend on ep. Inside an
expert the weights are tensor-parallel over `tp_group` exactly like the dense MLP's:

    fc1_weight [2f/tp, h] = [gate_r; up_r] (llama) or [f/tp, h] (gpt2)  -- column-parallel
    fc2_weight [h, f/tp]                                                 -- row-parallel

so the output of `forward` is a partial sum over tp (the caller all-reduces it). With whole experts
(etp = 1: `tp_group` None) tp is 1 here and the output is complete.

Expert e's master weights come from its own seeded stream (`expert_seed`), drawn whole and then
sliced for tp: the same expert has the same values whichever ep rank builds it.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megalite import ops
from megalite.distributed import comm
from megalite.parameters import params
from megalite.fp8.experts import fp8_experts_forward
from megalite.moe.expert_gemm import expert_grouped_mm
from megalite.parameters.sharding import ShardSpec


class Expert(nn.Module):
    """One expert's fc1 and fc2 weights, drawn whole from `seed` (std init_std, out_std) and sliced for
    tp rank `tp_rank` of `tp_size` (module docstring)."""

    def __init__(self, hidden_size: int, ffn: int, *, gated: bool, seed: int, init_std: float, out_std: float,
                 tp_rank: int, tp_size: int, dtype=None, device=None):
        super().__init__()
        rows = 2 * ffn if gated else ffn
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            fc1, fc2 = torch.empty(rows, hidden_size), torch.empty(hidden_size, ffn)
            nn.init.normal_(fc1, mean=0.0, std=init_std)
            nn.init.normal_(fc2, mean=0.0, std=out_std)
        spec1 = ShardSpec((rows, hidden_size), 0, tp_rank, tp_size, blocks=(ffn, ffn) if gated else None)
        spec2 = ShardSpec((hidden_size, ffn), 1, tp_rank, tp_size)
        self.fc1_weight = nn.Parameter(spec1.shard(fc1).to(device=device, dtype=dtype))
        self.fc2_weight = nn.Parameter(spec2.shard(fc2).to(device=device, dtype=dtype))
        params.declare(self.fc1_weight, shard_spec=spec1, expert_parallel=True)
        params.declare(self.fc2_weight, shard_spec=spec2, expert_parallel=True)


class LocalExperts(nn.ModuleDict):
    """This ep rank's experts `expert_ids` (consecutive global indices) of one layer, keyed by global
    index (so a layer's parameters are `experts.{e}.fc1_weight`).

    forward(x [R, h] rows sorted by local expert, group_sizes [E_local] int64) -> [R, h], partial over tp.
    `fp8` (an Fp8Recipe, set by megalite.model.fp8_convert): the experts' GEMMs run as grouped FP8 GEMMs
    (megalite.fp8.experts); `fp8_tokens`: the ranks routing the rest of each microbatch (their amaxes span it).
    """

    fp8 = None
    fp8_tokens = None

    def __init__(self, hidden_size: int, ffn: int, *, gated: bool, expert_ids: range, base_seed: int,
                 init_std: float, num_layers: int, tp_group, dtype=None, device=None):
        super().__init__()
        self.gated, self.first, self.tp_group = gated, expert_ids.start, tp_group
        tp_rank, tp_size = comm.group_rank(tp_group), comm.group_size(tp_group)
        out_std = init_std / math.sqrt(2 * num_layers)
        for e in expert_ids:
            self[str(e)] = Expert(hidden_size, ffn, gated=gated, seed=expert_seed(base_seed, e), init_std=init_std,
                                  out_std=out_std, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return fp8_experts_forward(self, x, group_sizes)
        # the weights are stacked inside each GEMM and saved uncopied (expert_gemm): no per-microbatch copy
        experts = list(self.values())
        y = expert_grouped_mm(x, group_sizes, [e.fc1_weight for e in experts])  # [R, 2f/tp] or gpt2 [R, f/tp]
        if self.gated:
            gate, up = y.chunk(2, dim=-1)
            y = ops.swiglu(gate, up)
        else:
            y = ops.gelu(y)
        return expert_grouped_mm(y, group_sizes, [e.fc2_weight for e in experts])  # [R, h], partial over tp


def expert_seed(base_seed: int, expert: int) -> int:
    """The seed of expert `expert`'s stream in a layer whose stream drew `base_seed`."""
    return (base_seed * 1_000_003 + 7919 * (expert + 1)) % (2 ** 63)
