"""Build this rank's model chunks and optimizer; run one training step; evaluate.

The loss is normalised once, globally: every microbatch's loss *sum* is scaled by
1 / (target tokens of the whole step, all microbatches and all dp ranks), so gradient
accumulation k and data parallelism n give the gradients of one batch k*n times larger, and
the dp reduction is a plain sum.

Context parallelism (cp > 1): train_step and evaluate take this dp rank's whole sequences and
hand the model this cp rank's zigzag chunks of them ([b, s] -> [b, s/cp]). Each cp rank counts
its own target tokens, so the global count is a sum over dp x cp, and the gradients of the
parameters (replicated across cp) are summed over dp x cp by the DataParallel wrapper.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from megalite.distributed import comm
from megalite.model.mtp import mtp_stats
from megalite.moe import bookkeeping as moe_bookkeeping
from megalite.context_parallel.document_split import local_tokens, split_order
from megalite.context_parallel.zigzag import split_sequence
from megalite.data_parallel.diloco import DiLoCo
from megalite.data.documents import check_position_ids
from megalite.data_parallel.powersgd import PowerSGDConfig
from megalite.data_parallel.wrapper import DataParallel
from megalite.model.fp8_convert import convert_to_fp8
from megalite.fp8.recipe import recipe_from
from megalite.distributed.mesh import Mesh
from megalite.config.model import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.optim.loss_scaler import DynamicLossScaler
from megalite.optim.muon import MuonSettings
from megalite.config.choices import CPSplit, GradCompression, OptimizerKind, Precision
from megalite.pipeline.executor import PipelineSpec, run_pipeline
from megalite.pipeline.p2p import is_first_chunk, is_last_chunk, last_chunk_location
from megalite.pipeline.partition import stage_layers
from megalite.pipeline.schedules import chunk_placement
from megalite.training.metrics import measured_attention_span
from megalite.training.step_result import PipelineTiming, StepResult
from megalite.distributed.host_reads import no_host_reads
from megalite.config import RunConfig


def build_model_chunks(model: GPTConfig, cfg: RunConfig, mesh: Mesh) -> list[GPTModel]:
    """This rank's model chunks: local chunk c holds model chunk c*pp + pp_rank (one chunk without interleaving;
    under DualPipeV model chunks pp_rank and 2pp-1-pp_rank)."""
    _check_same_experts(mesh, cfg, model)
    placement = chunk_placement(cfg.schedule)
    if mesh.pp_size == 1:
        ranges = [range(model.num_layers)]
    else:
        p = cfg.parallel
        ranges = stage_layers(model.num_layers, mesh.pp_size, p.virtual_stages, mesh.pp_rank,
                              p.decoder_first_stage_layers, p.decoder_last_stage_layers, p.pipeline_layout,
                              placement=placement)
    chunks = []
    for c, layer_ids in enumerate(ranges):
        first = is_first_chunk(mesh.pp_size, mesh.pp_rank, c)
        last = is_last_chunk(mesh.pp_size, len(ranges), mesh.pp_rank, c, placement)
        chunks.append(GPTModel(model, mesh, layer_ids=layer_ids, pre_process=first, post_process=last,
                               sequence_parallel=cfg.parallel.sequence_parallel, recompute=cfg.parallel.recompute,
                               seed=cfg.training.seed, fused_linear_cross_entropy=cfg.parallel.fused_linear_cross_entropy,
                               recompute_num_layers=cfg.parallel.recompute_num_layers,
                               dtype=cfg.precision.precision.torch_dtype, cp_comm_type=str(cfg.parallel.cp_comm_type),
                               cp_split=str(cfg.parallel.cp_split),
                               moe_dispatcher=str(cfg.parallel.moe_token_dispatcher_type),
                               device="meta" if cfg.parallel.zero == 3 else None))  # ZeRO-3: built unit by unit
        convert_to_fp8(chunks[-1], recipe_from(cfg), mesh.cp_group)  # --fp8-format: the blocks' linears in FP8
    return chunks


def build_data_parallel(chunks: list[GPTModel], cfg: RunConfig, mesh: Mesh) -> DataParallel:
    """The wrapper that owns this replica's parameters and gradients (buckets, ZeRO, overlap). At ZeRO-3
    it materialises the meta-built chunks one unit at a time."""
    p = cfg.parallel
    compression = PowerSGDConfig(p.powersgd_rank, p.powersgd_warmup_steps, p.powersgd_min_compression,
                                 seed=cfg.training.seed) if p.grad_compression == GradCompression.POWERSGD else None
    return DataParallel(chunks, mesh, zero_stage=p.zero, bucket_size=p.ddp_bucket_size,
                        grad_reduce_dtype=cfg.precision.grad_reduce_dtype.torch_dtype,
                        overlap_param_gather=p.overlap_param_gather, prefetch=p.zero3_prefetch,
                        reshard_after_forward=p.zero3_reshard_after_forward,
                        keep_gathered_in_step=p.zero3_keep_gathered_in_step,
                        grad_compression=compression, dp_reduction="sum",  # the loss: / global tokens
                        fp8_param_gather=cfg.precision.fp8_param_gather,
                        replicas_apart=p.diloco_inner_steps > 0,  # DiLoCo: no replica all-reduce per step
                        diloco_fragments=p.diloco_fragments if p.diloco_inner_steps else 1)


def build_optimizer(model: DataParallel, cfg: RunConfig) -> DistributedOptimizer:
    """AdamW over the shard `model` hands it, with the fp16 loss scaler when training in fp16."""
    prec, opt = cfg.precision, cfg.optimizer
    scaler = DynamicLossScaler(initial_scale=prec.initial_loss_scale, growth_interval=prec.loss_scale_window,
                               hysteresis=prec.hysteresis, backoff_factor=prec.loss_scale_backoff) \
        if prec.precision == Precision.FP16 else None
    muon = MuonSettings(momentum=opt.muon_momentum, nesterov=opt.muon_nesterov, ns_steps=opt.muon_ns_steps,
                        ns_coefficients=tuple(opt.muon_ns_coefficients), adjust_lr=opt.muon_adjust_lr,
                        owners=opt.muon_owners, lr=opt.muon_lr,
                        ns_dtype=torch.float32 if opt.muon_ns_dtype == Precision.FP32 else torch.bfloat16) \
        if opt.optimizer == OptimizerKind.MUON else None
    optimizer = DistributedOptimizer(model, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                                     weight_decay=opt.weight_decay, clip_grad=opt.clip_grad,
                                     offload_optimizer=cfg.parallel.offload_optimizer, loss_scaler=scaler, muon=muon)
    p = cfg.parallel
    if p.diloco_inner_steps:  # the outer step across replica groups, run by train_step
        optimizer.outer = DiLoCo(optimizer, inner_steps=p.diloco_inner_steps, outer_lr=p.diloco_outer_lr,
                                 outer_momentum=p.diloco_outer_momentum, fragments=p.diloco_fragments,
                                 reduce_dtype=p.diloco_reduce_dtype.torch_dtype)
    return optimizer


def activation_shape(model: GPTConfig, cfg: RunConfig, seq_length: int) -> tuple[int, int, int]:
    """What crosses a pipeline boundary for sequences of `seq_length` tokens: this cp rank's
    [s/cp, b, h], or its sequence shard [s/(cp*tp), b, h] under SP."""
    s = seq_length // cfg.parallel.cp
    s = s // cfg.parallel.tp if cfg.parallel.sequence_parallel else s
    return (s, cfg.training.micro_batch_size, model.hidden_size)


def context_parallel_chunks(microbatches: list[dict[str, torch.Tensor]], mesh: Mesh,
                            split: CPSplit = CPSplit.ZIGZAG) -> list[dict[str, torch.Tensor]]:
    """This cp rank's part of every microbatch: its tokens of the ids and labels, [b, s] -> [b, s/cp]:
    its two zigzag chunks (context_parallel.zigzag), or under --cp-split documents, for a microbatch
    with position ids, its chunks of every document (context_parallel.document_split, the order the
    model derives from the same position ids). The position ids stay whole. The microbatches at cp = 1."""
    if mesh.cp_size == 1:
        return microbatches
    chunks = []
    for mb in microbatches:
        split_documents = split == CPSplit.DOCUMENTS and "position_ids" in mb
        order = split_order(mb["position_ids"], mesh.cp_size) if split_documents else None
        chunks.append({key: _rank_tokens(value, order, mesh) if key in ("input_ids", "labels") else value
                       for key, value in mb.items()})
    return chunks


def _rank_tokens(tensor: torch.Tensor, order: torch.Tensor | None, mesh: Mesh) -> torch.Tensor:
    """[b, s] -> this cp rank's [b, s/cp]: its zigzag chunks, or its tokens of the per-document `order`."""
    if order is None:
        return split_sequence(tensor, mesh.cp_rank, mesh.cp_size, dim=1)
    return local_tokens(tensor, order, cp_rank=mesh.cp_rank, cp=mesh.cp_size)


def _check_same_experts(mesh: Mesh, cfg: RunConfig, model: GPTConfig) -> None:
    """The mesh's expert groups are the ones the configuration's experts need (a mesh built from sizes
    without the model's num_experts has none: its MoE layers would run another layout than the planned one)."""
    whole = model.moe is not None and cfg.parallel.etp < cfg.parallel.tp
    if (mesh.ep_size, mesh.experts_whole) != (cfg.parallel.ep, whole):
        raise ValueError(f"the mesh has ep={mesh.ep_size} and {'whole' if mesh.experts_whole else 'no whole'} experts "
                         f"under tp, the configuration ep={cfg.parallel.ep} and {'whole' if whole else 'no whole'} "
                         f"experts (--etp {cfg.parallel.etp}, --tp {cfg.parallel.tp}); build the mesh from the "
                         f"configuration: init_mesh(layout=cfg.layout())")


def document_inputs(microbatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's keyword for packed documents: {"position_ids": [b, s]} when the microbatch has them."""
    return {"position_ids": microbatch["position_ids"]} if "position_ids" in microbatch else {}


def check_documents(microbatches: list[dict[str, torch.Tensor]]) -> None:
    """Restarting position ids, checked on the loader's host tensors before any collective (DataError)."""
    for microbatch in microbatches:
        if "position_ids" in microbatch:
            check_position_ids(microbatch["position_ids"])


def _check_same_cp(mesh: Mesh, cfg: RunConfig) -> None:
    if mesh.cp_size != cfg.parallel.cp:
        raise ValueError(f"the mesh has cp={mesh.cp_size} but the configuration cp={cfg.parallel.cp}; build the mesh "
                         f"from the configuration: init_mesh(..., cp=cfg.parallel.cp)")


class GlobalTokens:
    """Target tokens (labels != -100) of the whole step: all microbatches of all dp ranks (and
    cp ranks: each counts the labels of its own chunks; one all-reduce over dp x cp).

    The all-reduce is started here and waited for only when the loss scale is first needed,
    just before the first loss is scaled: the first microbatch's forward runs meanwhile. That
    matters with --overlap-param-gather: the parameter all-gathers of the last step are queued
    on the same dp group before this all-reduce, so waiting for it at the start of the step
    would wait for every gather and hide none of them behind the forward.
    """

    def __init__(self, microbatches: list[dict[str, torch.Tensor]], mesh: Mesh, group=None):
        local = sum(int((mb["labels"] != -100).sum()) for mb in microbatches)  # on the loader's CPU tensors
        self._count = torch.tensor([float(local)], dtype=torch.float64, device=mesh.device)
        # group: dp x cp, or under DiLoCo one replica group's ranks (DataParallel.data_group)
        self._handle = comm.all_reduce(self._count, mesh.dp_cp_group if group is None else group, async_op=True)
        self.wait_seconds = 0.0  # host time blocked in the wait: mostly gathers queued before it

    def _wait(self) -> torch.Tensor:
        if self._handle is not None:
            started = time.perf_counter()
            self._handle.wait()
            self.wait_seconds = time.perf_counter() - started
            self._handle = None
        return self._count

    def loss_scale(self, scale: float) -> torch.Tensor:
        """scale / tokens as a float32 device scalar: never read on the host (on CUDA a read would
        stall the first forward; under --cuda-graph the scale is a captured input). The same
        float32 value as the Python float it once was: the quotient in float64, rounded once."""
        count = self._wait()
        return (scale / count.clamp(min=1.0)).float().reshape(())

    def value(self) -> float:
        return float(self._wait().item())


def global_target_tokens(microbatches: list[dict[str, torch.Tensor]], mesh: Mesh) -> float:
    """Target tokens (labels != -100) of the whole step: all microbatches of all dp (x cp) ranks."""
    return GlobalTokens(microbatches, mesh).value()


def _global_loss(loss_sum: float, tokens: float, mesh: Mesh, cfg: RunConfig) -> float:
    """The step's mean loss over every target token, the same on every rank (one scalar all-reduce). The
    loss sums are the stage's holding the last model chunk (the last stage; stage 0 under DualPipeV)."""
    return _world_loss_sum(loss_sum, mesh, cfg) / max(tokens, 1.0)


def _world_loss_sum(loss_sum: float, mesh: Mesh, cfg: RunConfig) -> float:
    """The summed loss of every rank's microbatches (this world's), the same on every rank."""
    loss_stage = last_chunk_location(mesh.pp_size, cfg.parallel.virtual_stages if mesh.pp_size > 1 else 1,
                                     chunk_placement(cfg.schedule))[0]
    mine = loss_sum if (mesh.pp_rank == loss_stage and mesh.tp_rank == 0) else 0.0
    total = torch.tensor([mine], dtype=torch.float64, device=mesh.device)
    comm.all_reduce(total, comm.world_group())
    return float(total.item())


def _share_with_replicas(model: DataParallel, loss_sum: float, tokens: GlobalTokens, mesh: Mesh, cfg: RunConfig):
    """--ft-replica-groups: the replica link (megalite/replicas/trainer.py), given the group's (loss sum,
    target tokens) to carry with its gradient across the live groups; None without."""
    link = getattr(model.grads, "replica_link", None)
    if link is not None:
        link.totals = (_world_loss_sum(loss_sum, mesh, cfg), tokens.value())
    return link


def _step_loss(link, loss_sum: float, tokens: float, mesh: Mesh, cfg: RunConfig) -> tuple[float, float]:
    """The step's (mean loss, target tokens): this world's, or (a replica link) the surviving samples' of the
    live replica groups."""
    if link is None:
        return _global_loss(loss_sum, tokens, mesh, cfg), tokens
    return link.surviving[0] / max(link.surviving[1], 1.0), link.surviving[1]


@contextlib.contextmanager
def _no_timer(name: str):
    yield


def _to_device(microbatches, device):
    return [{k: v.to(device, non_blocking=True) for k, v in mb.items()} for mb in microbatches]


def _forward_backward(model: DataParallel, microbatches, mesh: Mesh, cfg: RunConfig, seq_length: int,
                      loss_scale, phase, check_host_reads: bool, graphs) -> tuple[Any, PipelineTiming | None]:
    """Every microbatch's forward and backward: replayed graphs (pp = 1), the plain loop, or (pp > 1)
    the pipeline schedule (its chunks' graphs replayed under --cuda-graph). Returns (the loss sum, a
    device scalar or 0.0; at pp > 1 the schedule run and its instructions' seconds, else None)."""
    if graphs is not None and mesh.pp_size == 1:
        with phase("forward_backward"):  # one replayed graph per microbatch
            return graphs.run(microbatches, loss_scale), None
    if mesh.pp_size == 1:
        with no_host_reads() if check_host_reads else contextlib.nullcontext():
            return _accumulate_microbatches(model, microbatches, loss_scale, phase), None
    model.set_last_microbatch(False)  # each chunk's buckets reduce during that chunk's last backward
    spec = pipeline_spec(model.chunks[0].config, cfg, len(microbatches), seq_length)
    if graphs is not None:  # first step: warm-up; later: the captured pipeline, or refused
        graphs.begin_step(spec, microbatches)
    stats: dict = {}
    with phase("pipeline"):  # forward and backward interleaved by the schedule
        loss_sum = run_pipeline(spec, list(model.chunks), microbatches, mesh, loss_scale, grad_sync=model,
                                stats=stats, check_host_reads=check_host_reads, graphs=graphs)
    model.set_last_microbatch(True)
    return loss_sum, PipelineTiming(spec, stats["compute_s"])


def train_step(model: DataParallel, optimizer: DistributedOptimizer, microbatches: list[dict[str, torch.Tensor]],
               mesh: Mesh, cfg: RunConfig, lr: float | None, guard=None, timer=None, *,
               check_host_reads: bool = False, graphs=None) -> StepResult:
    """Forward and backward of every microbatch, dp reduction, clipping, optimizer step; returns a StepResult.

    microbatches: this dp rank's, whole sequences {"input_ids", "labels"} [b, s]; under context
    parallelism each cp rank keeps its zigzag chunks of them (`context_parallel_chunks`).

    guard: a `training.guards.NonFiniteGuard`; a non-finite loss on any rank then skips the
    update on every rank (non-finite gradients are always skipped by the optimizer).
    timer: a `training.metrics.TimeBreakdown` to fill with forward / backward (or, under pp,
    the interleaved "pipeline") / optimizer seconds.
    check_host_reads: run every forward and backward under `host_reads.no_host_reads()`: a
    tensor value read into Python there raises HostReadError (the tests; --cuda-graph's check).
    graphs: a `training.cuda_graph.StepGraphs` (--cuda-graph, pp = 1) or, at pp > 1, a
    `training.pipeline_graphs.PipelineGraphs`: the microbatches' forward and backward are replayed
    CUDA graphs (captured at the first step).
    """
    _check_same_cp(mesh, cfg)
    check_documents(microbatches)
    span = measured_attention_span(microbatches, model.chunks[0].config.window_size)  # the MFU's attention work
    seq_length = microbatches[0]["input_ids"].shape[1]  # the whole sequence; this cp rank holds s/cp of it
    microbatches = context_parallel_chunks(microbatches, mesh, cfg.parallel.cp_split)
    if graphs is not None:  # a shape the graphs cannot replay: refused before the token count's all-reduce
        graphs.check_shapes(microbatches)
    # in flight while the first forward runs; under DiLoCo one replica group's tokens
    tokens = GlobalTokens(microbatches, mesh, group=model.data_group if getattr(model, "replicas_apart", False) else None)
    microbatches = _to_device(microbatches, mesh.device)
    scale = optimizer.loss_scaler.scale if optimizer.loss_scaler is not None else 1.0
    optimizer.zero_grad()
    model.train()
    # The balancing losses are averaged over every forward of the step (microbatches x dp ranks; the
    # cp ranks of one forward each hold a share of its losses)
    moe_bookkeeping.set_loss_scale(model.chunks, scale / (len(microbatches) * mesh.dp_size))
    phase = timer.phase if timer is not None else _no_timer
    loss_sum, pipeline = _forward_backward(model, microbatches, mesh, cfg, seq_length, lambda: tokens.loss_scale(scale),
                                           phase, check_host_reads, graphs)
    loss_sum = float(loss_sum)  # one host sync per step
    loss_finite = guard.loss_is_finite(loss_sum) if guard is not None else True  # one scalar all-reduce
    link = _share_with_replicas(model, loss_sum, tokens, mesh, cfg)  # --ft-replica-groups (else None)
    with phase("optimizer"):
        optimizer.step(lr=lr, skip=not loss_finite)
        update = optimizer.last_step
        if not update.skipped:
            moe_bookkeeping.update_expert_biases(model.chunks, mesh)
    moe_stats = moe_bookkeeping.moe_stats(model.chunks, mesh)  # {} without experts
    token_count = tokens.value()
    mtp = mtp_stats(model.chunks, token_count, mesh)  # {} without MTP
    outer = getattr(optimizer, "outer", None)  # DiLoCo: the outer step every H steps (data_parallel/diloco.py)
    if outer is not None:
        token_count = outer.after_step(token_count)  # the loss below: over every replica group's tokens
    compression, exposed = model.compression_stats(), model.exposed_comm_seconds()  # compression: --grad-compression's
    loss, token_count = _step_loss(link, loss_sum, token_count, mesh, cfg)
    return StepResult(loss=loss, grad_norm=update.grad_norm,
                      skipped=update.skipped, loss_scale=update.loss_scale, tokens=token_count,
                      loss_finite=loss_finite, lr=optimizer.param_groups[0]["lr"], exposed_dp_comm_s=sum(exposed.values()) + tokens.wait_seconds,
                      exposed_grad_reduce_s=exposed["grad_reduce"], exposed_param_gather_s=exposed["param_gather"],
                      exposed_token_count_s=tokens.wait_seconds, moe=moe_stats, mtp=mtp,
                      pipeline=pipeline,  # for the measured bubble (pipeline.stages.measured_bubble), read when logging
                      attention_span=span, **compression)


def _accumulate_microbatches(model: DataParallel, microbatches, loss_scale, phase) -> torch.Tensor:
    """pp == 1: forward and backward of each microbatch; the dp reductions start, bucket by bucket,
    during the last one's backward. Returns the summed loss on the device (a float() per
    microbatch would stall the host on every one)."""
    # float64: the sum of microbatch losses must not depend on how many microbatches a rank runs
    # (an elastic resize from dp 2 to 1 moves a microbatch's loss from the all-reduce into this sum)
    loss_sum = torch.zeros((), dtype=torch.float64, device=model.mesh.device)
    for i, mb in enumerate(microbatches):
        model.set_last_microbatch(i == len(microbatches) - 1)
        with phase("forward"):
            loss = model(mb["input_ids"], mb["labels"], reduction="sum", **document_inputs(mb))
        if i == 0:
            loss_scale = loss_scale()  # the token count's all-reduce, overlapped with this forward
        with phase("backward"):
            (loss * loss_scale).backward()
        loss_sum += loss.detach().double()
    return loss_sum


def pipeline_spec(model: GPTConfig, cfg: RunConfig, num_microbatches: int, seq_length: int) -> PipelineSpec:
    """The pipeline of one step over sequences of `seq_length` tokens (the whole sequence: under
    context parallelism the stages exchange each cp rank's [s/cp, b, h])."""
    return PipelineSpec(cfg.schedule, num_microbatches, activation_shape(model, cfg, seq_length),
                        cfg.precision.precision.torch_dtype, cfg.parallel.virtual_stages)


@torch.no_grad()
def evaluate(chunks: list[GPTModel], microbatches: list[dict[str, torch.Tensor]], mesh: Mesh,
             cfg: RunConfig) -> float:
    """Mean loss over every target token of `microbatches` (all dp ranks), the same on every rank.

    Forward only; with pipeline parallelism the schedule's forward-only variant runs. Like
    train_step, it takes whole sequences and keeps this cp rank's chunks.
    """
    _check_same_cp(mesh, cfg)
    seq_length = microbatches[0]["input_ids"].shape[1]
    microbatches = context_parallel_chunks(microbatches, mesh, cfg.parallel.cp_split)
    tokens = global_target_tokens(microbatches, mesh)  # counted where the loader put them (CPU): no GPU sync
    microbatches = _to_device(microbatches, mesh.device)
    for chunk in chunks:
        chunk.eval()
    if mesh.pp_size == 1:
        loss_sum = sum(float(chunks[0](mb["input_ids"], mb["labels"], reduction="sum", **document_inputs(mb)))
                       for mb in microbatches)
    else:
        spec = pipeline_spec(chunks[0].config, cfg, len(microbatches), seq_length)
        loss_sum = run_pipeline(spec, chunks, microbatches, mesh, forward_only=True)
    return _global_loss(loss_sum, tokens, mesh, cfg)
