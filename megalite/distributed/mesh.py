"""The device mesh: `Mesh`, the frozen object holding this process's place and process groups.

The sizes and the rules between them are a `megalite.layout.Layout` (validated once, where it is
built); the rank arithmetic (Megatron order with context parallelism: tp fastest, then cp, dp, pp)
is pure and lives in `megalite.distributed.topology`, re-exported here. `init_mesh` is the only function here
that touches `torch.distributed`, and it does so through `megalite.distributed.comm` (the communication
choke point).
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch

from megalite.distributed import comm, exit_teardown
from megalite.layout import Layout
from megalite.distributed.topology import (coords_to_rank, cp_group_ranks, dp_cp_group_ranks, dp_group_ranks,  # noqa: F401
                               embedding_group_ranks, ep_group_ranks, expert_dp_group_ranks, model_parallel_group_ranks,
                               pp_group_ranks, rank_to_coords, rank_to_cp_rank, tp_group_ranks, tp_cp_group_ranks,
                               dp_shard_group_ranks, dp_replicate_group_ranks, expert_dp_shard_group_ranks)
from megalite.distributed.torch_mesh import build_device_mesh, build_ep_device_mesh

# ---------------------------------------------------------------------------------------------
# The frozen mesh
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mesh:
    """This process's place in the (tp, cp, dp, pp) layout and the process groups it uses.

    Groups are `None` in a single-process run with no process group; every megalite
    communication function treats `None` as a group of one (a no-op). At cp = 1, `cp_group`
    is None and `dp_cp_group` is `dp_group` itself (same ranks, same ledger name "dp").

    Expert parallelism (ep > 1) subdivides dp x cp: `ep_group` holds ep consecutive members of
    the dp x cp group (different experts, tokens exchanged all-to-all), `expert_dp_group` the
    dp*cp/ep members holding the same experts (their gradients reduce there). At ep = 1 there is
    no ep group and `expert_dp_group` is `dp_cp_group`.

    Expert tensor parallelism (`etp_size`, 1 or tp): at etp = tp the experts are split over tp like
    the dense MLP. At etp = 1 (tp > 1) every tp rank holds whole experts and routes its own 1/tp of
    the tokens, so the ranks holding the same experts are the expert-dp members of every tp rank:
    `expert_dp_group` is then (dp*cp/ep) x tp ranks, and `moe_token_group` (the ranks whose tokens
    make up one replica's microbatch: the router's losses and counts are theirs together) is tp x cp
    instead of the cp group. A dense model (`layout.num_experts` 0) has none of these expert groups.
    """

    rank: int
    layout: Layout  # the sizes: tp, cp, dp, pp, vp, ep, etp, dp_shard, the world, the model's experts
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    backend: str | None
    cp_rank: int = 0
    tp_group: Any = field(default=None, repr=False)
    pp_group: Any = field(default=None, repr=False)
    dp_group: Any = field(default=None, repr=False)
    cp_group: Any = field(default=None, repr=False)  # the context-parallel ring (K/V blocks, all-to-alls)
    dp_cp_group: Any = field(default=None, repr=False)  # dp x cp: where replicated gradients are reduced
    model_parallel_group: Any = field(default=None, repr=False)
    embedding_group: Any = field(default=None, repr=False)
    pp_ranks: tuple[int, ...] = ()  # global ranks of this rank's pipeline group, by stage
    placements: tuple[tuple[str, int, str], ...] = ()  # per global rank: (host, local rank, device)
    ep_rank: int = 0
    ep_group: Any = field(default=None, repr=False)  # experts sharded over it; tokens travel all-to-all
    expert_dp_group: Any = field(default=None, repr=False)  # same experts: expert gradients reduce here
    moe_token_group: Any = field(default=None, repr=False)  # cp, or tp x cp at etp = 1: a microbatch's routed tokens
    # Hybrid sharding (--dp-shard S < dp): ZeRO shards over S dp ranks (x cp), replicated dp/S times.
    dp_shard_group: Any = field(default=None, repr=False)  # S x cp ranks: reduce-scatter and gather here
    dp_replicate_group: Any = field(default=None, repr=False)  # dp/S ranks holding the same shard: all-reduce
    expert_dp_shard_group: Any = field(default=None, repr=False)  # expert-dp members of this replica group
    _torch_meshes: dict = field(default_factory=dict, repr=False, compare=False)  # torch_mesh's cache

    @property
    def device_mesh(self):
        """torch's DeviceMesh over this mesh's groups, dims ("pp", "dp", "cp", "tp") (megalite/distributed/torch_mesh.py)."""
        if "main" not in self._torch_meshes:
            self._torch_meshes["main"] = build_device_mesh(self)
        return self._torch_meshes["main"]

    @property
    def ep_device_mesh(self):
        """torch's DeviceMesh of the experts' layout, dims ("pp", "edp", "ep", "tp") (megalite/distributed/torch_mesh.py)."""
        if "experts" not in self._torch_meshes:
            self._torch_meshes["experts"] = build_ep_device_mesh(self)
        return self._torch_meshes["experts"]

    @property
    def world_size(self) -> int:
        return self.layout.world

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def etp_size(self) -> int:
        return self.layout.etp

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place in its dp x cp group (cp fastest)."""
        return self.cp_rank + self.cp_size * self.dp_rank

    @property
    def dp_shard_size(self) -> int:
        """S: the data-parallel ranks ZeRO shards over (dp at flat ZeRO)."""
        return self.layout.dp_shard

    @property
    def dp_replicate_size(self) -> int:
        """dp / S: replicas of each ZeRO shard group; 1 at flat ZeRO over all of dp x cp."""
        return self.layout.dp_replicate

    @property
    def dp_replicate_rank(self) -> int:
        """Which replica group this rank is in (0 at flat ZeRO): dp_rank = shard index + S * this."""
        return self.dp_rank // self.dp_shard_size

    @property
    def zero_group(self):
        """The group ZeRO shards dense parameters over: dp x cp, or the shard group under hybrid sharding."""
        return self.dp_shard_group if self.dp_replicate_size > 1 else self.dp_cp_group

    @property
    def expert_zero_group(self):
        """The group ZeRO shards the experts over: expert-dp, or its members of this replica group."""
        return self.expert_dp_shard_group if self.dp_replicate_size > 1 else self.expert_dp_group

    @property
    def replicate_group(self):
        """The ranks holding this rank's shard (None at flat ZeRO): sharded gradients all-reduce here."""
        return self.dp_replicate_group if self.dp_replicate_size > 1 else None

    @property
    def experts_whole(self) -> bool:
        """Experts under tp > 1 kept whole on every tp rank (etp = 1), each routing its own share of the tokens."""
        return self.layout.experts_whole

    @property
    def expert_replicas_apart(self) -> bool:
        """Whether the experts' replica group differs from dp x cp (ep > 1, or whole experts over tp)."""
        return self.layout.expert_groups_apart

    @property
    def expert_dp_rank(self) -> int:
        """This rank's place in `expert_dp_group` (ascending ranks: tp fastest when it spans tp)."""
        edp_rank = self.dp_cp_rank // self.ep_size
        return edp_rank * self.tp_size + self.tp_rank if self.experts_whole else edp_rank

    @property
    def expert_dp_size(self) -> int:
        return self.layout.expert_dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        """A rank table of the whole layout: one line per global rank."""
        tp, cp, pp, dp = self.tp_size, self.cp_size, self.pp_size, self.dp_size
        with_cp = cp > 1  # without context parallelism the table keeps its familiar columns
        order = "tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank))" if with_cp else \
            "tp_rank + tp*(dp_rank + dp*pp_rank)"
        cp_degree = (f" cp={cp}" if with_cp else "") + (f" ep={self.ep_size}" if self.ep_size > 1 else "")
        if self.dp_replicate_size > 1:  # hybrid sharding: dp = shard x replicate, the shard index fastest
            cp_degree += f" (dp = dp_shard {self.dp_shard_size} x dp_replicate {self.dp_replicate_size})"
        cp_column = f" {'cp':>3}" if with_cp else ""
        lines = [
            f"mesh: world={self.world_size} tp={tp}{cp_degree} pp={pp} dp={dp} "
            f"backend={self.backend or 'none'} (rank = {order})",
            f"{'rank':>5} {'tp':>3}{cp_column} {'dp':>3} {'pp':>3}  {'host':<20} {'local':>5}  device",
        ]
        for r in range(self.world_size):
            t, d, p = rank_to_coords(r, tp, pp, dp, cp)
            c = f" {rank_to_cp_rank(r, tp, cp):>3}" if with_cp else ""
            host, local, device = self.placements[r] if r < len(self.placements) else ("?", -1, "?")
            lines.append(f"{r:>5} {t:>3}{c} {d:>3} {p:>3}  {host:<20} {local:>5}  {device}")
        return "\n".join(lines)


_CURRENT_MESH: Mesh | None = None


def current_mesh() -> Mesh | None:
    """The mesh made by the last `init_mesh`, or None. Only layers' `tp_group=None` default reads it."""
    return _CURRENT_MESH


def single_process_mesh(device: torch.device | str | None = None, layout: Layout | None = None) -> Mesh:
    """A mesh of one process (every size 1; `layout` for the model's experts) that needs no process group."""
    device = torch.device(device) if device is not None else default_device()
    return Mesh(rank=0, layout=layout or Layout(world=1), tp_rank=0, pp_rank=0, dp_rank=0, device=device,
                backend=None, pp_ranks=(0,), placements=(_placement(device),))


def _placement(device: torch.device) -> tuple[str, int, str]:
    """(host, local rank, device) of this process, for the rank table."""
    name = str(device)
    if device.type == "cuda":
        name += f" ({torch.cuda.get_device_name(device)})"
    return socket.gethostname(), int(os.environ.get("LOCAL_RANK", "0")), name


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _my_group(rank: int, name: str, all_ranks: list[list[int]]):
    """Create every group of one kind (every rank must create every group, in the same order) and
    return the one holding `rank` (None if none does)."""
    chosen = None
    for ranks in all_ranks:
        group = comm.new_group(ranks, name)
        if rank in ranks:
            chosen = group
    return chosen


def _create_groups(rank: int, layout: Layout) -> dict[str, Any]:
    """This rank's process groups, by Mesh field name, created in the same order on every rank."""
    tp, pp, dp, cp, ep = layout.tp, layout.pp, layout.dp, layout.cp, layout.ep
    groups = {
        "tp_group": _my_group(rank, "tp", tp_group_ranks(tp, pp, dp, cp)),
        "dp_group": _my_group(rank, "dp", dp_group_ranks(tp, pp, dp, cp)),
        "pp_group": _my_group(rank, "pp", pp_group_ranks(tp, pp, dp, cp)),
        "model_parallel_group": _my_group(rank, "mp", model_parallel_group_ranks(tp, pp, dp, cp)),
        "embedding_group": _my_group(rank, "embedding", embedding_group_ranks(tp, pp, dp, cp)),
    }
    # At cp = 1 no ring exists and dp x cp is the dp group: no extra groups, layouts unchanged.
    groups["cp_group"] = _my_group(rank, "cp", cp_group_ranks(tp, pp, dp, cp)) if cp > 1 else None
    groups["dp_cp_group"] = (_my_group(rank, "dp_cp", dp_cp_group_ranks(tp, pp, dp, cp)) if cp > 1
                             else groups["dp_group"])
    # At ep = 1 no expert-parallel group exists; a dense model has no expert groups at all.
    groups["ep_group"] = _my_group(rank, "ep", ep_group_ranks(tp, pp, dp, cp, ep)) if ep > 1 else None
    # Whole experts under tp (etp = 1): their replicas span tp too (always an "edp" group then, even
    # where it has the tp group's ranks: the ledger names the experts' traffic).
    groups["expert_dp_group"] = (_my_group(rank, "edp", expert_dp_group_ranks(tp, pp, dp, cp, ep, layout.etp))
                                 if layout.expert_groups_apart else groups["dp_cp_group"])
    groups["moe_token_group"] = groups["cp_group"]  # the ranks routing one replica's microbatch between them
    if layout.experts_whole:
        groups["moe_token_group"] = (_my_group(rank, "tp_cp", tp_cp_group_ranks(tp, pp, dp, cp)) if cp > 1
                                     else groups["tp_group"])
    dp_shard = layout.dp_shard
    if dp_shard < dp:  # hybrid sharding; created last, so flat layouts create the same groups as ever
        groups["dp_shard_group"] = _my_group(rank, "dp_shard", dp_shard_group_ranks(tp, pp, dp, cp, dp_shard))
        groups["dp_replicate_group"] = _my_group(rank, "dp_replicate",
                                                 dp_replicate_group_ranks(tp, pp, dp, cp, dp_shard))
        groups["expert_dp_shard_group"] = (
            _my_group(rank, "edp_shard", expert_dp_shard_group_ranks(tp, pp, dp, cp, ep, layout.etp, dp_shard))
            if layout.expert_groups_apart else groups["dp_shard_group"])
    return groups


def init_mesh(tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1, backend: str | None = None,
              timeout_s: float = 600.0, ep: int = 1, etp: int = 1, replace: bool = False, *, num_experts: int = 0,
              dp_shard: int | None = None,
              layout: Layout | None = None, device: torch.device | str | None = None) -> Mesh:
    """Build the mesh for this process from torchrun's RANK / WORLD_SIZE / LOCAL_RANK.

    The sizes: `layout` (a `megalite.layout.Layout`), or tp, pp, dp (None: inferred from the world),
    cp, ep, etp and the model's `num_experts` (0: a dense model, no expert groups), from which one is
    built on WORLD_SIZE ranks; either way a bad layout is refused (LayoutError, the configuration
    check's line) before any process group exists. `device`: what this rank's tensors live on
    (default: cuda:LOCAL_RANK when CUDA is available, else the CPU; --simulate passes the meta device).
    A second call with another layout while this process's mesh is live is refused unless
    `replace=True` (layers already built keep the first mesh's groups: silently mixing two layouts).

    dp_shard (default dp): hybrid sharding, ZeRO over groups of dp_shard dp ranks (x cp), replicated
    dp/dp_shard times (`Mesh.zero_group`, `Mesh.replicate_group`).
    Backend: nccl on a CUDA device, gloo otherwise. Every rank creates every group in the same order
    (torch.distributed requires it) and keeps its own.
    """
    global _CURRENT_MESH
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    sizes = dict(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, num_experts=num_experts, dp_shard=dp_shard)
    if layout is None:
        layout = Layout(world=world_size, **sizes)
    elif sizes != dict(tp=1, pp=1, dp=None, cp=1, ep=1, etp=1, num_experts=0, dp_shard=None):
        raise TypeError("init_mesh takes the sizes or a layout, not both")
    elif layout.world != world_size:
        layout = Layout(**{**layout.sizes(), "world": world_size})  # refused in the layout's words
    _refuse_another_layout(layout, rank, replace)
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1 and not comm.is_initialized():
        _CURRENT_MESH = single_process_mesh(device, layout)
        return _CURRENT_MESH
    return _mesh_of_world(rank, layout, device, backend or ("nccl" if device.type == "cuda" else "gloo"), timeout_s)


def _mesh_of_world(rank: int, layout: Layout, device: torch.device, backend: str, timeout_s: float) -> Mesh:
    """init_mesh for a world of several processes: the process group (unless one exists) and the groups."""
    global _CURRENT_MESH
    if not comm.is_initialized():
        exit_teardown.register(destroy_mesh, _current_backend)
        comm.init_process_group(backend, rank, layout.world, datetime.timedelta(seconds=timeout_s),
                                device=device if device.type == "cuda" else None)
    tp, pp, dp, cp = layout.tp, layout.pp, layout.dp, layout.cp
    tp_rank, dp_rank, pp_rank = rank_to_coords(rank, tp, pp, dp, cp)
    cp_rank = rank_to_cp_rank(rank, tp, cp)
    mesh = Mesh(
        rank=rank, layout=layout, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank, device=device,
        backend=backend, cp_rank=cp_rank, **_create_groups(rank, layout),
        ep_rank=(cp_rank + cp * dp_rank) % layout.ep,
        pp_ranks=tuple(next(r for r in pp_group_ranks(tp, pp, dp, cp) if rank in r)),
        # One small gather at start-up, so the rank table names every rank's node and device.
        placements=tuple(comm.all_gather_object(_placement(device), comm.world_group())),
    )
    _CURRENT_MESH = mesh
    return mesh


def _refuse_another_layout(layout: Layout, rank: int, replace: bool) -> None:
    """ValueError when this process's live mesh has another layout and `replace` is not given.
    A mesh of another rank or world (inherited by a forked process) is not this process's: ignored."""
    mesh = _CURRENT_MESH
    if replace or mesh is None or mesh.rank != rank or mesh.world_size != layout.world or mesh.layout == layout:
        return
    current, asked = mesh.layout.sizes(), layout.sizes()
    if current["dp_shard"] == current["dp"] and asked["dp_shard"] == asked["dp"]:  # ZeRO over all of dp: not named
        del current["dp_shard"], asked["dp_shard"]
    shown = ", ".join(f"{k}={v}" for k, v in current.items() if v != asked[k])
    wanted = ", ".join(f"{k}={v}" for k, v in asked.items() if v != current[k])
    raise ValueError(f"init_mesh({wanted}) while the mesh of {shown} is live: call destroy_mesh() first (layers "
                     f"built on the first mesh keep its groups), or pass replace=True")


def destroy_mesh() -> None:
    """Forget the current mesh and tear down the process group (tests, end of training).

    Optional: `init_mesh` registers it to run at interpreter exit (distributed/exit_teardown.py)."""
    global _CURRENT_MESH
    _CURRENT_MESH = None
    comm.destroy_process_group()


def _current_backend() -> str | None:
    return _CURRENT_MESH.backend if _CURRENT_MESH is not None else None
