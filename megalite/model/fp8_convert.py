"""Switch a built model's transformer-block linears to FP8 (torchao's "convert" step, by attribute).

Converted: every ColumnParallelLinear / RowParallelLinear inside the transformer blocks (the
attention projections, the MLP) and every MoE layer's local experts. Left in the training dtype:
the embedding, the output layer and the norms (the issue's rule: unless measured better), and
the router. Each converted weight is declared with the group its tensorwise amax spans
and its scale rounding (`params.fp8_amax_group`), which ZeRO-3's FP8 parameter gather reads.
"""
from __future__ import annotations

from torch import nn

from megalite.parameters import params
from megalite.fp8.recipe import Fp8Recipe
from megalite.moe.experts import LocalExperts
from megalite.moe.layer import MoELayer
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe | None, cp_group=None) -> int:
    """Set `fp8 = recipe` on the linears of `model`'s transformer blocks; return how many modules.
    recipe None converts nothing. Safe on a meta-built model (ZeRO-3): only attributes change.
    `cp_group`: the ranks holding the other tokens of each sequence (the linears' amaxes span it);
    the experts' amaxes span their MoE layer's token group (cp, or tp x cp with whole experts)."""
    if recipe is None:
        return 0
    blocks = getattr(model, "layers", None)
    count = 0
    for module in (blocks.modules() if blocks is not None else model.modules()):
        if isinstance(module, MoELayer):
            module.experts.fp8_tokens = module.token_group
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.fp8, module.fp8_tokens = recipe, cp_group
            params.declare(module.weight, fp8_amax_group=(module.tp_group, recipe.pow2_scales))
            count += 1
        elif isinstance(module, LocalExperts):
            module.fp8 = recipe
            for expert in module.values():
                for weight in (expert.fc1_weight, expert.fc2_weight):
                    params.declare(weight, fp8_amax_group=(module.tp_group, recipe.pow2_scales))
            count += 1
    return count
