"""DataParallel: the wrapper that owns a model replica's parameters and gradients.

    model = DataParallel(chunks, mesh, zero_stage=1, bucket_size=..., overlap_param_gather=True)
    optimizer = DistributedOptimizer(model, weight_decay=0.1)   # updates the shard the wrapper hands it
    # or, at zero_stage 0, any torch optimizer: torch.optim.AdamW(model.parameters())

It decides where bytes live and when they move (docs/architecture/decisions.md, "Data parallelism owns
parameters and gradients"):
- gradients (`GradBuffers`): fp32 main-grad buffers in buckets, each reduced over dp as soon
  as its gradients are final in the last microbatch's backward (all-reduce at ZeRO 0,
  reduce-scatter into this rank's shard at ZeRO 1/2; ZeRO-2 frees a bucket's full storage
  after its reduction); sequence-parallel grads summed over tp first; the tied embedding's
  grad summed over the embedding group first (pipeline parallelism);
- parameters (`ParamBuffer`): views of one contiguous buffer with the same layout, refilled
  bucket by bucket by all-gathers after a sharded update; with `overlap_param_gather` the
  gathers finish behind the next forward and `ReadGuard` guarantees that nothing reads a
  parameter before its gather completes;
- gradient compression (`grad_compression`, zero 0-2): PowerSGD (powersgd.py) replaces the
  gradients' all-reduce / reduce-scatter with two all-reduces of low-rank factors per step
  (under hybrid sharding only the replicas' sum: the shard group's reduction stays exact).

It takes any modules: megalite's layers (whose linears hand weight gradients straight to the
main-grad buffer) or plain torch modules (caught by post-accumulate-grad hooks). `chunks`
are one model replica's pieces on this rank, in execution order (pipeline model chunks, or
just the model).

ZeRO-3 (`zero_stage=3`) is a mode of this wrapper, not another optimizer: parameters live as
flat per-unit shards (`unit_params.py`), each unit is gathered before its forward and freed
after it, gathered again for its backward, and its gradient reduce-scattered into an fp32
shard when its backward is done (`zero3.py`, `unit_grads.py`). The optimizer's side of the
contract (owned pieces, `owned_params`, `publish`, `grad_shard`) is the same as at ZeRO 1/2,
with one bucket per unit and nothing gathered after the step.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch import nn

from megalite.distributed import comm
from megalite.parameters import params as P
from megalite.data_parallel.diloco import fragment_tags
from megalite.data_parallel.grad_buffers import DEFAULT_BUCKET_SIZE, GradBuffers
from megalite.data_parallel.layout import OwnedPiece, build_unit_layout
from megalite.data_parallel.powersgd import PowerSGD, PowerSGDConfig
from megalite.data_parallel.param_buffer import ParamBuffer, ReadGuard
from megalite.data_parallel.unit_grads import UnitGrads
from megalite.data_parallel.unit_params import UnitParams
from megalite.data_parallel.units import Unit, resolve_units, split_tied
from megalite.data_parallel.whole_matrices import MatrixOwner, WholeMatrices
from megalite.data_parallel.wrapper_checks import check_arguments
from megalite.data_parallel.zero3 import Zero3Schedule
from megalite.distributed.mesh import Mesh


def named_parameters_of(chunks: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(name, param) in model order: megalite models' layout-free logical names; plain modules'
    own names (prefixed `chunk{c}.` when there are several chunks)."""
    named = []
    for c, chunk in enumerate(chunks):
        if hasattr(chunk, "logical_parameters"):
            named += list(chunk.logical_parameters())
        else:
            prefix = f"chunk{c}." if len(chunks) > 1 else ""
            named += [(prefix + n, p) for n, p in chunk.named_parameters()]
    return named


class DataParallel(nn.Module):
    """One model replica's parameters and gradients over `mesh.dp_cp_group` (see the module docstring).

    Parameters are replicated over data and context parallelism alike (cp ranks hold other
    tokens of the same sequences), so gradients reduce, and ZeRO shards, over dp x cp; at cp = 1
    that group is `mesh.dp_group` itself. "dp" below means that group. Under hybrid sharding
    (mesh.dp_replicate_size > 1, --dp-shard S) ZeRO shards over `mesh.zero_group` (S dp ranks x cp)
    instead: gradients reduce-scatter there, then the shard (zero 0: the whole gradient) is
    all-reduced over `mesh.replicate_group` (the dp/S ranks holding the same shard), and parameters
    gather within the shard group only. Under expert parallelism
    (mesh.ep_size > 1), or with whole experts on every tp rank (etp = 1), the experts are replicated over
    `mesh.expert_dp_group` (expert-dp, x tp at etp = 1): their buckets reduce, shard and gather there
    (grad_buffers.py; ZeRO 0-2; ZeRO-3's expert units likewise).

    zero_stage: 0 (gradients all-reduced; every rank updates everything), 1 (reduce-scatter: this
        rank's optimizer updates a 1/dp shard), 2 (also frees the full gradient per bucket),
        3 (also shards the parameters, unit by unit; see the module docstring).
    bucket_size: elements per bucket; grad_reduce_dtype: float32, or bfloat16 on the wire.
    overlap_param_gather (zero 1/2): leave the parameter all-gathers running after the step.
    grad_compression: a PowerSGDConfig: the dp reduction sends low-rank factors (zero 0-2; see
        powersgd.py; experts apart reduce theirs over expert-dp); the compressor's state is
        `self.compression`.
    ZeRO-3 only: units (default: the model's `zero3_units()`, else `units.default_units`; or a
        list of submodules / `Unit`s), prefetch (units gathered ahead), reshard_after_forward,
        keep_gathered_in_step (gather each unit once per step, hold it until the optimizer).
    dp_reduction: how the loss each rank backpropagates is normalised, hence how gradients combine:
        "mean" (default, torch DDP's convention): the model returns the mean loss of this rank's
            own batch, so the reduced gradients are averaged over the dp (x cp) ranks;
        "sum" (megalite's GPT training): the loss is already divided by the whole step's global
            token count (all microbatches, all dp ranks), so the gradients are summed.
        Either way every rank ends with the gradient of one big batch, for its convention.
    """

    def __init__(self, chunks: nn.Module | Sequence[nn.Module], mesh: Mesh, *, zero_stage: int = 0,
                 bucket_size: int = DEFAULT_BUCKET_SIZE, grad_reduce_dtype: torch.dtype = torch.float32,
                 overlap_param_gather: bool = False, units: Sequence[nn.Module | Unit] | None = None,
                 prefetch: int = 1, reshard_after_forward: bool = True, keep_gathered_in_step: bool = False,
                 grad_compression: PowerSGDConfig | None = None, dp_reduction: str = "mean",
                 fp8_param_gather: bool = False, replicas_apart: bool = False, diloco_fragments: int = 1):
        super().__init__()
        # DiLoCo (data_parallel/diloco.py): each replica group trains on its own between outer steps, so
        # gradients reduce within the shard group only and a step's tokens are the group's
        self.replicas_apart = replicas_apart
        self.data_group = mesh.zero_group if replicas_apart else mesh.dp_cp_group
        self.chunks = nn.ModuleList([chunks] if isinstance(chunks, nn.Module) else list(chunks))
        check_arguments(self.chunks, mesh, zero_stage=zero_stage, dp_reduction=dp_reduction,
                        grad_compression=grad_compression, overlap_param_gather=overlap_param_gather,
                        fp8_param_gather=fp8_param_gather)
        self._fp8_param_gather, self.dp_reduction = fp8_param_gather, dp_reduction
        self.mesh, self.zero_stage = mesh, zero_stage
        self.schedule: Zero3Schedule | None = None
        self.units: list[Unit] = []  # ZeRO-3's units (one bucket each)
        if zero_stage == 3:
            self._init_zero3(units, grad_reduce_dtype, prefetch, reshard_after_forward, keep_gathered_in_step)
            return
        named = [(n, p) for n, p in named_parameters_of(self.chunks) if p.requires_grad]
        replica_group = mesh.zero_group  # dp x cp, or the shard group under hybrid sharding
        self.grads = GradBuffers([p for _, p in named], replica_group, bucket_size=bucket_size,
                                 grad_reduce_dtype=grad_reduce_dtype, zero_stage=zero_stage, tp_group=mesh.tp_group,
                                 embedding_group=mesh.embedding_group if mesh.pp_size > 1 else None,
                                 compression=grad_compression, skip_group=comm.world_group(),
                                 expert_group=mesh.expert_zero_group if mesh.expert_replicas_apart else None,
                                 replicate_group=None if replicas_apart else mesh.replicate_group,
                                 bucket_tags=fragment_tags(named, self.chunks, diloco_fragments))
        name_of = {id(p): n for n, p in named}
        self.params = self.grads.params  # buffer order (reverse of model order)
        self.names = [name_of[id(p)] for p in self.params]
        self.layout = self.grads.layout
        self.param_buffer = ParamBuffer(self.params, self.layout, replica_group, self.grads.shard_rank,
                                        overlap=overlap_param_gather, groups=self.grads.groups,
                                        shard_ranks=self.grads.shard_ranks)
        self.gather_order = self._forward_bucket_order()
        self._guard = ReadGuard(self.param_buffer)
        self._guard_depth = 0
        for chunk in self.chunks:
            chunk.register_forward_pre_hook(self._enter_guard)
            chunk.register_forward_hook(self._exit_guard, always_call=True)

    def _init_zero3(self, units, grad_reduce_dtype, prefetch, reshard_after_forward, keep_gathered_in_step) -> None:
        """Units, their flat layout (one bucket each), sharded storage, gradients and the schedule."""
        mesh = self.mesh
        group = mesh.zero_group  # the shards span dp x cp (or a shard group: hybrid sharding), as ZeRO 1/2
        tied_split = mesh.pp_size > 1  # the tied embedding: one unit per stage, same layout on both
        self.units = split_tied(resolve_units(self.chunks, units), tied_split)
        expert_group = mesh.expert_zero_group  # expert units (kind 1) shard over the ranks holding the same experts
        groups = (group, expert_group)
        self.layout = build_unit_layout([[p.numel() for p in u.params] for u in self.units], comm.group_size(group),
                                        [u.kind for u in self.units], (comm.group_size(expert_group),))
        self.param_buffer = UnitParams(self.units, self.layout, group, comm.group_rank(group), mesh.device, groups,
                                       tuple(comm.group_rank(g) for g in groups), self._fp8_param_gather)
        if self.param_buffer.replaced:  # parameters built on the meta device: swap in the real ones
            for chunk in self.chunks:
                for module in chunk.modules():
                    for key, p in list(module._parameters.items()):
                        if p is not None and id(p) in self.param_buffer.replaced:
                            module._parameters[key] = self.param_buffer.replaced[id(p)]
        self.params = self.param_buffer.params  # unit order (forward order)
        name_of = {id(p): n for n, p in named_parameters_of(self.chunks)}
        self.names = [name_of[id(p)] for p in self.params]
        self.grads = UnitGrads(self.params, self.layout, group, grad_reduce_dtype=grad_reduce_dtype,
                               tp_group=mesh.tp_group,
                               embedding_group=mesh.embedding_group if mesh.pp_size > 1 else None, groups=groups,
                               replicate_group=None if self.replicas_apart else mesh.replicate_group)
        self.gather_order = list(range(len(self.layout.buckets)))
        self.schedule = Zero3Schedule(self.units, self.chunks, self.param_buffer, self.grads, prefetch=prefetch,
                                      reshard_after_forward=reshard_after_forward,
                                      keep_gathered_in_step=keep_gathered_in_step)

    # ------------------------------------------------------------------ forward

    def forward(self, *args, **kwargs):
        """Call the model (single-chunk replicas; pipeline executors call the chunks themselves)."""
        if len(self.chunks) != 1:
            raise RuntimeError(f"this replica has {len(self.chunks)} pipeline chunks; run them through "
                               f"megalite.pipeline.run_pipeline (or call model.chunks[c])")
        return self.chunks[0](*args, **kwargs)

    def _enter_guard(self, _module, _args) -> None:
        if self._guard_depth or self.param_buffer.pending:
            if self._guard_depth == 0:
                self._guard.__enter__()
            self._guard_depth += 1

    def _exit_guard(self, _module, _args, _output) -> None:
        if self._guard_depth:
            self._guard_depth -= 1
            if self._guard_depth == 0:
                self._guard.__exit__(None, None, None)

    def _forward_bucket_order(self) -> list[int]:
        """Buckets in the order a forward first touches them (modules in pre-order: a parent's
        forward starts before its children's), then any bucket no module owns directly."""
        slot_of = {id(p): slot for p, slot in zip(self.params, self.layout.slots)}
        order: list[int] = []
        for chunk in self.chunks:
            for module in chunk.modules():
                for p in module.parameters(recurse=False):
                    if id(p) in slot_of and slot_of[id(p)].bucket not in order:
                        order.append(slot_of[id(p)].bucket)
        return order + [b for b in range(len(self.layout.buckets)) if b not in order]

    # ------------------------------------------------------------------ gradients (the train step)

    def zero_grad(self) -> None:
        """Clear every gradient before the next step's first microbatch."""
        self.grads.zero_grad()

    def set_last_microbatch(self, is_last: bool, chunk: int | None = None) -> None:
        """True before the backward that completes the step's gradients (of local `chunk`, default
        all): buckets then reduce as soon as they are final; False accumulates locally.
        ZeRO-3 reduce-scatters every microbatch's gradients (see unit_grads.py): no effect."""
        if self.zero_stage == 3:
            return
        params = None if chunk is None else list(self.chunks[chunk].parameters())
        self.grads.set_last_microbatch(is_last, params)

    def no_sync(self):
        """Context manager: accumulation microbatches reduce nothing (ZeRO-3: no effect)."""
        return contextlib.nullcontext() if self.zero_stage == 3 else self.grads.no_sync()

    def before_last_backward(self, chunk: int) -> None:
        """The pipeline executor's hook: chunk `chunk`'s next backward is its last of the step."""
        self.set_last_microbatch(True, chunk)

    def reduces_tied_grads(self) -> bool:
        return True  # GradBuffers / UnitGrads sum them over the embedding group in finish_reduction()

    def after_weight_grads(self, chunk: int) -> None:
        """The pipeline executor's hook after a zero-bubble W pass of `chunk` (ZeRO-3 reduces then)."""
        if self.schedule is not None:
            self.schedule.after_weight_grads(chunk)

    def finish_grad_sync(self, fill_param_grads: bool = True, *, grad_scale: float = 1.0, skip: bool = False) -> None:
        """Complete every bucket's reduction (idempotent within a step).

        At zero_stage 0 with fill_param_grads, each `param.grad` is then its reduced gradient (a
        view of the fp32 main grad when the dtypes match, a cast copy otherwise), so any torch
        optimizer can step; megalite's DistributedOptimizer reads `grad_shard` instead.
        Gradient compression only: `grad_scale` is the fp16 loss scale in the gradients; `skip`
        (every rank drops this step) leaves the compressor's state untouched.
        """
        if self.grads.reduction_pending():
            if self.schedule is not None:  # ZeRO-3 (never compressed)
                self.grads.finish_reduction()
            else:
                self.grads.finish_reduction(grad_scale, skip)
            replicas = comm.group_size(self.data_group)
            if self.dp_reduction == "mean" and replicas > 1:  # summed over the replicas -> their mean
                self.grads.grad_shard.div_(replicas)  # every gradient this rank's optimizer reads (zero 0: all)
        if self.schedule is not None:
            self.schedule.end_step()  # before the optimizer: no unit stays gathered
        if fill_param_grads and self.zero_stage == 0:
            for i, p in enumerate(self.params):
                grad = self.grads.main_grad(i)
                p.grad = grad if grad.dtype == p.dtype else grad.to(p.dtype)

    @property
    def compression(self) -> PowerSGD | None:
        """The PowerSGD compressor (error buffers, Q), or None (no compression, one replica, or ZeRO-3)."""
        return None if self.schedule is not None else self.grads.compressor

    def compression_stats(self) -> dict[str, float | int | None]:
        """The last step's gradient reduction on the dp group, and the experts' on expert-dp (compression
        only): bytes sent, and the bytes the uncompressed reduction sends over them (None when nothing was sent)."""
        if self.compression is None:
            return {}
        sent, uncompressed = self.grads.last_reduction_bytes
        return {"grad_reduce_bytes": sent, "grad_compression_ratio": uncompressed / sent if sent else None}

    @property
    def grad_shard(self) -> torch.Tensor:
        """fp32 [shard numel]: the reduced gradients of the elements this rank updates."""
        return self.grads.grad_shard

    # ------------------------------------------------------------------ parameters (the optimizer)

    @property
    def shard_rank(self) -> int:
        return self.grads.shard_rank

    def owned_pieces(self) -> list[OwnedPiece]:
        """The pieces of parameters (`self.params[piece.param]`) this rank's shard holds, in shard order."""
        return self.layout.owned_pieces(self.grads.shard_ranks)  # experts: their expert-dp rank

    def owned_params(self, bucket: int) -> torch.Tensor:
        """This rank's chunk of `bucket` as the parameters hold it now (param dtype)."""
        return self.param_buffer.owned_chunk(bucket)

    def publish(self, bucket: int, chunk: torch.Tensor) -> None:
        """Hand back this rank's updated chunk of `bucket`; its all-gather over dp starts at once."""
        self.param_buffer.publish(bucket, chunk)

    def published(self) -> None:
        """Every bucket is handed back: wait for the gathers, unless they overlap the next forward."""
        self.param_buffer.published()

    def wait_for_params(self) -> None:
        """Complete every parameter all-gather in flight: before reading parameters outside a
        forward (checkpoint snapshot, replica check, export). At ZeRO-3 the parameters are
        the shards (`param_buffer.shard`); a unit's full values exist only while it is gathered."""
        if self.schedule is not None:
            for unit in list(self.param_buffer.pending):
                self.param_buffer.wait(unit)
            return
        self.param_buffer.wait()

    def shard_home(self, index: int) -> tuple:
        """(the group parameter `index` is sharded over, its number of shards: 1 at ZeRO 0)."""
        bucket = self.layout.buckets[self.layout.slots[index].bucket]
        return self.grads.groups[bucket.kind], bucket.shard_count

    def whole_matrices(self, owners: dict[int, MatrixOwner]) -> WholeMatrices:
        """The exchange that hands each parameter in `owners` whole to its owner rank and its results back
        (whole_matrices.py; the blueprint's decision 15). Same `owners` on every rank of the stage."""
        return WholeMatrices(layout=self.layout, params=self.params, groups=self.grads.groups,
                             shard_ranks=self.grads.shard_ranks, tp_group=self.mesh.tp_group, owners=owners)

    def tp_replicated_pieces(self) -> list[tuple[str, torch.Tensor]]:
        """ZeRO-3: (name, this rank's shard piece) of every parameter each tp rank holds whole; the tp
        ranks of one dp rank hold the same pieces (the replica check compares them). Experts are left
        out: split over tp (etp = tp), or whole but sharded over expert-dp x tp (etp = 1)."""
        shard, params = self.param_buffer.shard, self.params
        return [(self.names[x.param], shard[x.shard_start:x.shard_end]) for x in self.owned_pieces()
                if not P.shard_spec(params[x.param]).is_tp_sharded and not P.is_expert_parallel(params[x.param])]

    def shard_pieces(self) -> list[tuple[str, torch.Tensor]]:
        """ZeRO-3: (name, this rank's shard piece) of every parameter it holds a piece of; under hybrid
        sharding the ranks of one replica group (`mesh.replicate_group`) hold the same pieces."""
        shard = self.param_buffer.shard
        return [(self.names[x.param], shard[x.shard_start:x.shard_end]) for x in self.owned_pieces()]

    @contextlib.contextmanager
    def gathered(self, units: Sequence[int] | None = None):
        """ZeRO-3: hold units (default all) gathered for reads outside a forward, e.g.
        `with model.gathered(): print(model.chunks[0].head.weight)`; a no-op below ZeRO-3.
        Writes inside are not kept: the shard is the parameters' only home."""
        if self.schedule is None:
            self.wait_for_params()
            yield
            return
        chosen = range(len(self.units)) if units is None else list(units)
        self.param_buffer.exact_gathers = True  # a reader sees the master weights, not their FP8 casts
        try:
            for unit in chosen:
                self.param_buffer.acquire(unit)
        finally:
            self.param_buffer.exact_gathers = False
        try:
            for unit in chosen:
                self.param_buffer.wait(unit)
            yield
        finally:
            for unit in chosen:
                self.param_buffer.release(unit)

    # ------------------------------------------------------------------ metrics

    def exposed_comm_seconds(self) -> dict[str, float]:
        """Host seconds of the last step blocked in dp communication (not hidden behind compute):
        the gradient reduction's wait in finish_grad_sync(), and the parameter gathers' waits
        since the previous call."""
        gather = self.param_buffer.wait_seconds
        self.param_buffer.wait_seconds = 0.0
        return {"grad_reduce": self.grads.exposed_seconds, "param_gather": gather}

    def memory_report(self) -> dict[str, int]:
        """Per-rank bytes of the parameters and of the gradient storage held now; at ZeRO-3 also the
        peak bytes of gathered units since construction (`peak_gathered_bytes`)."""
        report = {"param_bytes": self.param_buffer.nbytes(), "grad_bytes": self.grads.grad_bytes()}
        if self.schedule is not None:
            report["peak_gathered_bytes"] = self.param_buffer.peak_gathered_bytes
        return report
