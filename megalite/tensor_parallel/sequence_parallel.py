"""Declaring which parameters see a sequence shard under sequence parallelism (torch only, no kernels).

See `norms.py` for why: a replicated parameter applied to a sequence shard [s/tp, b, h] gets a
partial gradient per tp rank, which the data-parallel wrapper sums over tp only when declared.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn

from megalite.parameters import params


def mark_sequence_parallel(target: nn.Module | Iterable[torch.Tensor], sequence_parallel: bool = True):
    """Declare that the parameters of `target` (a module, or parameters) see a sequence shard under
    sequence parallelism (their gradients are summed over tp by the DP wrapper), or, with False,
    that they see the whole sequence. Returns `target`."""
    found = target.parameters() if isinstance(target, nn.Module) else target
    for param in found:
        params.declare(param, sequence_parallel_grad=sequence_parallel)
    return target


def _is_norm(module: nn.Module) -> bool:
    """torch's norms, megalite's, and a user's own class named like one (e.g. `MyRMSNorm`)."""
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or type(module).__name__.endswith("Norm")


def unmarked_norm_problem(chunks: Sequence[nn.Module], tp_size: int) -> str | None:
    """The first norm whose gradient would be partial but is not declared, as one line naming the
    fix; None when the model uses no sequence-parallel layer (or tp = 1) or every norm is declared."""
    if tp_size == 1:
        return None
    modules = [(name, m) for chunk in chunks for name, m in chunk.named_modules()]
    if not any(getattr(m, "sequence_parallel", False) is True for _, m in modules):
        return None
    for name, module in modules:
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if _is_norm(module) and own and not all(params.is_sequence_parallel_declared(p) for p in own):
            kind = type(module).__name__
            old_style = any(hasattr(p, "sequence_parallel") for p in own)  # Megatron's attribute: not read here
            return (f"{name or 'the model'} ({kind}) sits among sequence-parallel layers but its parameters are not "
                    f"declared{' (their `sequence_parallel` attribute is not read)' if old_style else ''}, so under "
                    f"tp={tp_size} its gradient would be 1/tp partial: build it as megalite.tensor_parallel."
                    f"{'RMSNorm' if 'RMS' in kind else 'LayerNorm'}(..., sequence_parallel=True), or call "
                    f"megalite.tensor_parallel.mark_sequence_parallel(module) (mark_sequence_parallel(module, False) "
                    f"if it sees the whole sequence)")
    return None
