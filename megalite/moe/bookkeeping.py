"""The training step's bookkeeping over a model's MoE layers (what a step does with them, besides running them):

- `set_loss_scale(chunks, scale)` before the step's forwards: the factor of the balancing losses'
  gradient (see layer.py);
- `update_expert_biases(chunks, mesh)` after the optimizer: DeepSeek-V3's bias step;
- `moe_stats(chunks, mesh)` after the step: losses, load and drops per MoE layer, the same on every rank;
- `expert_biases(chunk)`: the expert score biases by local name, what a checkpoint stores beside the weights.
"""
from __future__ import annotations

from typing import Iterable

import torch

from megalite.distributed import comm
from megalite.moe.layer import MoELayer
from megalite.moe.router import Router, update_expert_bias


def moe_layers(chunks: Iterable[torch.nn.Module]) -> list[tuple[int, MoELayer]]:
    """(global layer number, layer) of every MoE layer in this rank's chunks."""
    found = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                found.append((getattr(module, "layer_number", len(found)), module))
    return found


def set_loss_scale(chunks, scale: float) -> None:
    for _, layer in moe_layers(chunks):
        layer.loss_scale = scale


def update_expert_biases(chunks, mesh) -> None:
    for _, layer in moe_layers(chunks):
        if layer.router.expert_bias is not None:
            if layer.experts_whole:  # etp = 1: each tp rank counted the routes of its own tokens
                comm.all_reduce(layer.router.step_tokens_per_expert, mesh.tp_group)
            update_expert_bias(layer.router, mesh.dp_cp_group, layer.moe.bias_update_rate)


def expert_biases(chunk: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(local name, bias buffer [E] fp32) of every router of `chunk` with an expert bias; the buffers
    themselves (a checkpoint load writes into them). Same values on every rank holding the layer."""
    return [(f"{name}.expert_bias", module.expert_bias) for name, module in chunk.named_modules()
            if isinstance(module, Router) and module.expert_bias is not None]


def moe_stats(chunks, mesh) -> dict:
    """The step's MoE statistics over every replica (dp x cp; and tp at etp = 1) and stage, then reset.

    {"moe_aux_loss", "moe_z_loss": means over layers and forwards; "moe_dropped_tokens": routes dropped,
     "moe_load_imbalance": max over layers of max/mean routes per expert;
     "moe_layers": {layer: {"tokens_per_expert_max", "tokens_per_expert_mean", "aux_loss", "z_loss",
                            "dropped"}}}. {} for a model without experts."""
    chunks = list(chunks)
    if getattr(chunks[0], "config", None) is None or chunks[0].config.moe is None:
        return {}  # a dense model: nothing to report, and no collective (every rank agrees: same config)
    layers = moe_layers(chunks)
    mine = {}
    for number, layer in layers:
        st = layer.stats
        if st["forwards"] == 0:
            continue
        loads = st["tokens_per_expert"].double()
        packed = torch.cat([loads, torch.stack([torch.as_tensor(st[k], dtype=torch.float64, device=loads.device)
                                                for k in ("aux_loss", "z_loss", "dropped")]),
                            torch.tensor([float(st["forwards"])], dtype=torch.float64, device=loads.device)])
        comm.all_reduce(packed, mesh.dp_cp_group)  # replicas route different tokens
        if layer.experts_whole:  # etp = 1: so do the tp ranks
            comm.all_reduce(packed, mesh.tp_group)
        loads, (aux, z, dropped, forwards) = packed[:-4], packed[-4:].tolist()
        mine[number] = {"tokens_per_expert_max": float(loads.max()), "tokens_per_expert_mean": float(loads.mean()),
                        "aux_loss": aux / forwards, "z_loss": z / forwards, "dropped": int(dropped)}
        layer.reset_stats()
    merged: dict = {}
    for part in comm.all_gather_object(mine, mesh.pp_group) if mesh.pp_size > 1 else [mine]:
        merged.update(part)
    if not merged:
        return {}
    values = list(merged.values())
    return {"moe_aux_loss": sum(v["aux_loss"] for v in values) / len(values),
            "moe_z_loss": sum(v["z_loss"] for v in values) / len(values),
            "moe_dropped_tokens": sum(v["dropped"] for v in values),
            "moe_load_imbalance": max(v["tokens_per_expert_max"] / max(v["tokens_per_expert_mean"], 1e-9)
                                      for v in values),
            "moe_layers": dict(sorted(merged.items()))}
