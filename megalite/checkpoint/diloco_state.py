"""DiLoCo's state in a checkpoint (megalite/data_parallel/diloco.py): the outer optimizer, and every
replica group's own inner state.

Between outer steps the replica groups of --dp-shard hold different parameters and AdamW moments
(each trains on its own batches); the outer parameters θ_outer and the Nesterov momentum are the same
in every group. Stored (beside the weights and the optimizer state, in the same boxes of full tensors):
- "master", "exp_avg", "exp_avg_sq" under the plain names: replica group 0's inner state, exactly as
  without DiLoCo (so any run, DiLoCo or not, loads group 0's state at any layout);
- the same kinds under "{logical name}@replica{g}": replica group g's (g >= 1), each element once per
  group (the group's ZeRO shards; at ZeRO 0 its first dp rank);
- "diloco_outer", "diloco_velocity": θ_outer and the momentum, by replica group 0 (as its optimizer state);
- "diloco"/"groups": the number of replica groups saved, one element, by global rank 0.
The weights ("model") are group 0's; every group's parameters are published from its own loaded
masters, so a group's parameters are its own again.

Loading, with the optimizer state, into a DiLoCo run:
- as many replica groups as were saved: each group reads its own inner state, the outer state is read
  (at any tp, dp_shard or ZeRO stage: the ranges are layout-free), and the step count resumes at the
  checkpoint's step, so the next outer step comes when it would have: the run continues exactly;
- another number of groups: every group reads group 0's inner state (the others' are dropped), the
  outer state as saved;
- a checkpoint without DiLoCo's state: the outer parameters start at the loaded masters, zero momentum.
A run without DiLoCo reads group 0's state and ignores the rest.
"""
from __future__ import annotations

import torch

GROUPS_KIND, GROUPS_NAME = "diloco", "groups"
OUTER_KINDS = ("diloco_outer", "diloco_velocity")


def outer_of(optimizer):
    """The DiLoCo outer optimizer `build_optimizer` attached, or None."""
    return getattr(optimizer, "outer", None)


def replica_suffix(group: int) -> str:
    """The name suffix of replica group `group`'s inner state ('' for group 0: the plain names)."""
    return f"@replica{group}" if group else ""


def saving_suffix(optimizer, mesh) -> str | None:
    """The suffix under which this rank stores its inner optimizer state, or None when another replica group
    stores it (hybrid sharding without DiLoCo: the groups hold the same state)."""
    if mesh.dp_replicate_rank == 0:
        return ""
    return replica_suffix(mesh.dp_replicate_rank) if outer_of(optimizer) is not None else None


def groups_item(optimizer, mesh) -> list[tuple[str, str, tuple, torch.Tensor]]:
    """(kind, name, box, tensor) of the replica-group count, written once (global rank 0) under DiLoCo."""
    outer = outer_of(optimizer)
    if outer is None or mesh.rank != 0:
        return []
    return [(GROUPS_KIND, GROUPS_NAME, ((0, 1),), torch.tensor([outer.groups], dtype=torch.int64))]


def stored_groups(reader) -> int:
    """The replica groups whose DiLoCo state the checkpoint holds; 0 without DiLoCo."""
    if not reader.has(GROUPS_KIND, GROUPS_NAME):
        return 0
    out = torch.empty(1, dtype=torch.int64)
    reader.verify_box(GROUPS_KIND, GROUPS_NAME, ((0, 1),))
    reader.read_into(GROUPS_KIND, GROUPS_NAME, ((0, 1),), out)
    return int(out.item())


def loading_suffix(reader, optimizer) -> str:
    """The suffix of the inner state this rank reads: its own group's when DiLoCo runs now with as many
    replica groups as were saved, else group 0's."""
    outer = outer_of(optimizer)
    if outer is None or stored_groups(reader) != outer.groups:
        return ""
    return replica_suffix(outer.mesh.dp_replicate_rank)
