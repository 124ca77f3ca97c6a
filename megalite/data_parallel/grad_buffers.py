"""Data-parallel gradients: contiguous fp32 main grads, buckets, reduction overlapped with backward.

`GradBuffers` owns the gradients of one model replica's parameters (this rank's tp shards of
this pipeline stage); `DataParallel` (wrapper.py) builds it:

- Gradients accumulate in float32 main-grad buffers laid out by `layout.build_layout`
  (reverse order of use), whatever the parameters' dtype (bf16/fp16 training keeps fp32
  grads). megalite's Column/Row-parallel linears hand their weight gradients straight to
  the sink attached with `megalite.parameters.params.set_grad_destination` (see
  `weight_grad.py`); every other parameter's `.grad` is moved into the
  buffer by a post-accumulate-grad hook and freed.
- While the last microbatch runs backward, a bucket's reduction starts asynchronously the
  moment all of its gradients are final: an all-reduce (zero_stage 0) or a reduce-scatter
  into this rank's shard (zero_stage 1, 2). During accumulation microbatches (`no_sync()`
  or `set_last_microbatch(False)`) nothing is communicated.
- The reduction is a SUM over dp, never a mean: the loss is already divided by the global
  number of target tokens (all dp ranks, all microbatches), so summing per-rank gradients
  gives exactly the gradient of the global loss.
- Parameters declared `sequence_parallel_grad` hold partial gradients per tp rank; when a
  `tp_group` is given, they are summed over tp (one coalesced all-reduce per bucket) just
  before their bucket's dp reduction.
- Parameters declared `tied_across_stages` (the tied embedding on the first and the last
  pipeline stage) sit in a bucket of their own that launches only in `finish_reduction()`,
  right after their gradients are summed over `embedding_group`.
- Where the gradients live (the buffer, ZeRO-2's per-bucket storage, the shard): grad_storage.py.
- Expert parallelism (`expert_group`): experts' weights (declared `expert_parallel`) are replicated
  only over the expert-data-parallel group, so they sit in buckets of their own that reduce (and,
  under ZeRO, shard) over that group; every other bucket reduces over dp as before.
- Gradient compression (`compression=PowerSGDConfig(...)`, dp or expert-dp > 1): after the
  warm-up steps no bucket is reduced during backward; `finish_reduction()` hands the whole
  accumulated step to the PowerSGD compressor (powersgd.py), which replaces the all-reduce /
  reduce-scatter above with two all-reduces of low-rank factors per replica group (the experts'
  over `expert_group`) and writes the decompressed sums where the plain reduction would have
  (the main grads at zero_stage 0, this rank's shard at 1/2).
- Compression under hybrid sharding (`replicate_group` and `compression`): only the replicas' sum is
  compressed, where the bytes cross the far links. `finish_reduction()` first sums every whole
  accumulated gradient over `replicate_group` through the compressor (in place: each main grad then
  holds the decompressed sum over the replicas at its shard position), then runs the exact shard-group
  reduction (all-reduce at zero 0, reduce-scatter at 1/2) as without compression, and no replica
  all-reduce after it. PowerSGD needs whole matrices to factor, hence the replica sum first: the sum
  is the same (Σ_shard Σ_replica = Σ_replica Σ_shard), the shard group's reduction stays exact.

How "all of its gradients are final" is known: bucket_readiness.py (a first step counts the deliveries).
"""
from __future__ import annotations

import contextlib
import time
from typing import Sequence

import torch

from megalite.distributed import comm
from megalite.parameters import params as P
from megalite.data_parallel.bucket_readiness import BucketReadiness
from megalite.data_parallel.grad_storage import GradStorage
from megalite.data_parallel.layout import BufferLayout, build_layout
from megalite.data_parallel.powersgd import PowerSGD, PowerSGDConfig

DEFAULT_BUCKET_SIZE = 40_000_000  # elements (Megatron's default); buckets this big overlap only large models


def _checked_params(params: Sequence[torch.nn.Parameter], zero_stage: int,
                    grad_reduce_dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """The parameters that train, each once; a wrong stage or reduction dtype raises."""
    if zero_stage not in (0, 1, 2):
        raise ValueError(f"zero_stage must be 0, 1 or 2, got {zero_stage!r}")
    if grad_reduce_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"grad_reduce_dtype must be torch.float32 or torch.bfloat16, got {grad_reduce_dtype}")
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("GradBuffers needs at least one parameter with requires_grad=True")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("the same parameter was passed twice; pass each parameter once")
    return params

# A backward after the step's reduction without zero_grad(): the buffers hold the previous step's
# REDUCED gradient (summed over dp at ZeRO 0, a shard at ZeRO 1-2), so adding local gradients to it
# would give another wrong result at every layout. torch would accumulate; megalite refuses.
FORGOT_ZERO_GRAD = ("a backward after the optimizer step without zero_grad(): call optimizer.zero_grad() (or "
                    "model.zero_grad()) before each step's first backward; gradients are not carried over steps")


class GradBuffers:
    """Gradient buffers and bucketed, overlapped dp reduction for one model replica.

    Args:
        params: this rank's parameters in model (forward) order; laid out reversed.
        dp_group: the data-parallel group (None: dp=1, reductions are no-ops).
        bucket_size: target elements per bucket.
        grad_reduce_dtype: torch.float32, or torch.bfloat16 to halve dp traffic (the
            reduced result is written back to the fp32 buffers).
        zero_stage: 0 all-reduce; 1 reduce-scatter, full buffer kept; 2 reduce-scatter,
            full buffer freed per bucket after its reduction.
        tp_group: sums `sequence_parallel_grad` params' grads over tp before dp reduction.
        embedding_group: with pipeline parallelism, the first and last stage: tied parameters'
            grads are summed over it in `finish_reduction()`, before their (own) bucket launches.
        compression: a PowerSGDConfig to reduce compressed (zero_stage 0-2, fp32 reduction);
            skip_group: the group a non-finite gradient skips the step over (the world).
        expert_group: the expert-data-parallel group of `expert_parallel` parameters (ep > 1);
            None: every parameter reduces over dp_group.
        replicate_group: hybrid sharding: the ranks holding the same shard of dp_group's (and
            expert_group's) buckets; each reduced shard (zero 0: bucket) is then all-reduced over it.
        bucket_tags: one int per parameter (in `params`' order): parameters with different tags never
            share a bucket (streaming DiLoCo's fragments).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], dp_group, *, bucket_size: int = DEFAULT_BUCKET_SIZE,
                 grad_reduce_dtype: torch.dtype = torch.float32, zero_stage: int = 0, tp_group=None,
                 embedding_group=None, compression: PowerSGDConfig | None = None, skip_group=None,
                 expert_group=None, replicate_group=None, bucket_tags: Sequence[int] | None = None):
        params = _checked_params(params, zero_stage, grad_reduce_dtype)
        # Hybrid sharding: dp_group (and expert_group) is a shard group; its replicas sum there after.
        self.replicate_group = replicate_group if comm.group_size(replicate_group) > 1 else None
        self.compress_replicas = compression is not None and self.replicate_group is not None  # only their sum
        self.params = list(reversed(params))  # reverse order of use: backward fills bucket 0 first
        self.dp_group, self.tp_group, self.embedding_group = dp_group, tp_group, embedding_group
        self.dp_size, self.dp_rank = comm.group_size(dp_group), comm.group_rank(dp_group)
        self.zero_stage, self.grad_reduce_dtype = zero_stage, grad_reduce_dtype
        self.shard_count = self.dp_size if zero_stage > 0 else 1
        self.shard_rank = self.dp_rank if zero_stage > 0 else 0
        self.device = self.params[0].device
        deferred = frozenset(i for i, p in enumerate(self.params)
                             if embedding_group is not None and P.is_tied_across_stages(p))
        # kind 0: replicated over dp_group; kind 1: experts, replicated over expert_group
        kinds = [int(expert_group is not None and P.is_expert_parallel(p)) for p in self.params]
        expert_size, expert_rank = comm.group_size(expert_group), comm.group_rank(expert_group)
        self.groups = (dp_group, expert_group)  # by kind
        self.shard_ranks = (self.shard_rank, expert_rank if zero_stage > 0 else 0)  # by kind
        self.layout: BufferLayout = build_layout([p.numel() for p in self.params], bucket_size, self.shard_count,
                                                 deferred, kinds, (expert_size if zero_stage > 0 else 1,),
                                                 list(reversed(bucket_tags)) if bucket_tags else None)
        self._deferred_buckets = {self.layout.slots[i].bucket for i in deferred}
        self.readiness = BucketReadiness(self.layout, self._deferred_buckets)
        buckets = self.layout.buckets

        self.storage = GradStorage(self.params, self.layout, zero_stage=zero_stage, device=self.device)
        self.grad_shard = self.storage.grad_shard  # this rank's reduced gradients (zero 0: the whole buffer)

        self._sp_params = [[i for i in b.params if P.is_sequence_parallel_grad(self.params[i])] for b in buckets]
        self.compressor = self._make_compressor(compression, skip_group, deferred, kinds)
        self._owned = self.layout.owned_pieces(self.shard_ranks)
        self._sent_bytes = 0  # on the dp group, this step
        self.last_reduction_bytes = (0, 0)  # (sent, sent uncompressed) by the last finish_reduction()
        self._shard_group_bytes = 0  # compression under hybrid sharding: the shard group's part of this step
        self._pending: list[tuple[int, object, torch.Tensor | None, torch.Tensor | None]] = []
        self.replica_link = None  # --ft-replica-groups: the replicas' sum over the link (replicas/trainer.py)
        self._sync = [True] * len(self.params)  # per parameter: is this backward its last of the step?
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.exposed_seconds = 0.0  # host time of the last finish_reduction(): communication not hidden by backward
        self._finished = False  # finish_reduction() ran and no gradient arrived since
        self._stale = False  # finish_reduction() ran and zero_grad() did not since: a gradient now is a mistake
        self._hooks = []
        for index, p in enumerate(self.params):
            P.set_grad_destination(p, self._make_sink(index), P.main_grad(p))
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(index)))

    def _make_compressor(self, config: PowerSGDConfig | None, skip_group, tied: frozenset[int],
                         kinds: list[int]) -> PowerSGD | None:
        # hybrid sharding: every kind's replicas across the replica groups are its replicate_group
        groups = (self.replicate_group,) * 2 if self.compress_replicas else self.groups
        if config is None or all(comm.group_size(g) == 1 for g in groups):  # nothing is reduced
            return None
        if self.grad_reduce_dtype != torch.float32:
            raise ValueError("PowerSGD reduces its factors in fp32; pass grad_reduce_dtype=torch.float32")
        return PowerSGD([tuple(p.shape) for p in self.params], config, groups, skip_group, self.device,
                        separate=tied, kinds=kinds)  # experts (kind 1) over expert_group

    @property
    def compressing(self) -> bool:
        """Whether this step's dp reduction is PowerSGD's (compression on, warm-up over)."""
        return self.compressor is not None and self.compressor.active

    # ------------------------------------------------------------------ accumulation

    def _make_sink(self, index: int):
        def sink(param: torch.Tensor, grad: torch.Tensor) -> None:
            self._accumulate(index, grad)
        return sink

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if param.grad is None:  # autograd got None back (the gradient went to the sink instead)
                return
            grad, param.grad = param.grad, None  # the fp32 buffer is the only copy
            self._accumulate(index, grad)
        return hook

    def main_grad(self, param_index: int) -> torch.Tensor:
        """The fp32 gradient buffer of `self.params[param_index]` (allocating it under ZeRO-2)."""
        return self.storage.main_grad(param_index)

    def _accumulate(self, index: int, grad: torch.Tensor) -> None:
        if self._stale:
            raise RuntimeError(FORGOT_ZERO_GRAD)
        bucket = self.layout.slots[index].bucket
        if self.readiness.launched[bucket]:
            raise RuntimeError(
                f"parameter {index} (shape {tuple(self.params[index].shape)}) received a gradient after its "
                f"bucket's dp reduction started; it is used more often in this backward than in the first "
                f"(calibration) step; keep the graph the same every step or call finish_reduction() per step")
        self.storage.add(index, grad)
        self._finished = False
        if not self._sync[index]:
            return
        if self.readiness.deliver(index):
            self._launch(bucket)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulation microbatches: gradients accumulate locally, nothing is reduced."""
        previous, self._sync = self._sync, [False] * len(self.params)
        try:
            yield
        finally:
            self._sync = previous

    def set_last_microbatch(self, is_last: bool, params: Sequence[torch.Tensor] | None = None) -> None:
        """True (default) before the backward that completes the step's gradients.

        `params`: only these parameters (e.g. one model chunk of an interleaved pipeline,
        whose last backward comes before another chunk's); default all.
        """
        if params is None:
            self._sync = [bool(is_last)] * len(self.params)
            return
        for p in params:
            if id(p) in self._index:
                self._sync[self._index[id(p)]] = bool(is_last)

    # ------------------------------------------------------------------ reduction

    def _all_reduce_views(self, indices: Sequence[int], group) -> None:
        """Sum the main grads of params `indices` over `group` (one coalesced all-reduce)."""
        if not indices or comm.group_size(group) == 1:
            return
        views = [self.main_grad(i).view(-1) for i in indices]
        flat = torch.cat(views)
        comm.all_reduce(flat, group)
        offset = 0
        for view in views:
            view.copy_(flat[offset:offset + view.numel()])
            offset += view.numel()

    def _launch(self, bucket: int, after_compression: bool = False) -> None:
        """Start bucket `bucket`'s dp reduction (asynchronously); after_compression: the shard group's
        exact reduction of a bucket whose replicas the compressor already summed (hybrid sharding)."""
        if not after_compression:
            self.readiness.launched[bucket] = True
            self._all_reduce_views(self._sp_params[bucket], self.tp_group)
        if self.compressing and not after_compression:  # the compressor reduces the whole step in finish_reduction()
            return
        data = self.storage.bucket(bucket)  # fp32 [bucket numel]
        send = data if self.grad_reduce_dtype == torch.float32 else data.to(self.grad_reduce_dtype)
        b = self.layout.buckets[bucket]
        group = self.groups[b.kind]  # dp, or the expert-data-parallel group for experts
        self._sent_bytes += send.numel() * send.element_size() if comm.group_size(group) > 1 else 0
        if self.zero_stage == 0:
            handle = comm.all_reduce(send, group, async_op=True)
            self._pending.append((bucket, handle, send, None))
            return
        shard = self.grad_shard[b.shard_offset:b.shard_offset + b.chunk_numel]
        out = shard if self.grad_reduce_dtype == torch.float32 else torch.empty_like(shard, dtype=send.dtype)
        handle = comm.reduce_scatter_into(out, send, group, async_op=True)
        self._pending.append((bucket, handle, send, out))

    def finish_reduction(self, grad_scale: float = 1.0, skip: bool = False) -> None:
        """Launch every bucket not yet reduced (in bucket order), wait for all, finalise.

        After it returns, `grad_shard` holds this rank's summed gradients: the whole buffer
        (zero_stage 0) or this rank's chunks (zero_stage 1, 2). Ends a first (calibration) step.
        With compression: `grad_scale` is the loss scale the gradients carry (fp16), and `skip`
        (the caller drops this step, on every rank) leaves them unreduced and the compressor's
        state untouched.
        """
        if not all(self._sync):
            raise RuntimeError("finish_reduction() inside no_sync()/set_last_microbatch(False); "
                               "run the last microbatch's backward with synchronisation on first")
        started = time.perf_counter()
        for bucket in self._deferred_buckets:  # the tied embedding: summed over its two stages first
            for index in self.layout.buckets[bucket].params:
                comm.all_reduce(self.main_grad(index), self.embedding_group)
        compressing = self.compressing
        for bucket in range(len(self.layout.buckets)):
            if not self.readiness.launched[bucket]:
                self._launch(bucket)
        if compressing:
            self._reduce_compressed(grad_scale, skip)
        for bucket, handle, send, out in self._across_replicas(self._pending):
            handle.wait()
            b = self.layout.buckets[bucket]
            if self.zero_stage == 0 and send is not self.storage.buckets[bucket]:
                self.storage.buckets[bucket].copy_(send)  # bf16 all-reduce result back into fp32
            elif self.zero_stage > 0 and out.dtype != torch.float32:
                self.grad_shard[b.shard_offset:b.shard_offset + b.chunk_numel].copy_(out)
            if self.zero_stage == 2:
                self.storage.free(bucket)
        self._pending.clear()
        if self.replica_link is not None:  # across the live replica groups (each its own world), in one collective
            self.replica_link.reduce(self.grad_shard)
        self._finished = True
        self._stale = True  # reduced: the next step's backward must start from zero_grad()
        self.exposed_seconds = time.perf_counter() - started
        uncompressed = self._plain_bytes() if compressing and self._sent_bytes else self._sent_bytes
        if compressing and self.compress_replicas:  # the shard group's as sent, the replicas' plain shard
            uncompressed = self._shard_group_bytes + 4 * self.grad_shard.numel()
        self.last_reduction_bytes, self._sent_bytes = (self._sent_bytes, uncompressed), 0
        if self.compressor is not None:
            self.compressor.end_step()
        self.readiness.end_step()

    def _across_replicas(self, pending: list) -> list:
        """Hybrid sharding's second stage: as each bucket's shard-group reduction lands, start the
        all-reduce of its result (zero 0: the bucket, else this rank's chunk) over the replicas;
        returns the entries to wait for. Only the 1/S shard crosses the replica links."""
        if self.replicate_group is None or (self.compress_replicas and self.compressor.active):
            return pending  # (compressed: the compressor summed the replicas before the shard group)
        second = []
        for bucket, handle, send, out in pending:
            handle.wait()
            result = send if self.zero_stage == 0 else out
            self._sent_bytes += result.numel() * result.element_size()
            second.append((bucket, comm.all_reduce(result, self.replicate_group, async_op=True), send, out))
        return second

    def _plain_bytes(self) -> int:
        """Bytes the uncompressed reduction sends per step: every bucket over a group of several ranks, fp32."""
        return 4 * sum(b.numel for b in self.layout.buckets if comm.group_size(self.groups[b.kind]) > 1)

    def _reduce_compressed(self, grad_scale: float, skip: bool) -> None:
        """The step's dp reduction through the compressor: decompressed sums into the main grads
        (zero_stage 0) or into this rank's shard pieces (1, 2); ZeRO-2 then frees the buckets."""
        if self.compress_replicas:
            self._compress_replicas_first(grad_scale, skip)
            return
        if not skip:
            grads = [self.main_grad(i) for i in range(len(self.params))]
            if self.zero_stage == 0:
                outputs = [[(0, g.numel(), g.view(-1))] for g in grads]
            else:
                outputs = [[] for _ in self.params]
                for x in self._owned:
                    outputs[x.param].append((x.local_start, x.local_end, self.grad_shard[x.shard_start:x.shard_end]))
            self.compressor.reduce(grads, outputs, grad_scale)
            self._sent_bytes += self.compressor.last_sent_bytes
        if self.zero_stage == 2:
            self.storage.free_all()

    def _compress_replicas_first(self, grad_scale: float, skip: bool) -> None:
        """Hybrid sharding: the compressed sum over the replicas, in place into every main grad (whole
        tensors), then each bucket's exact shard-group reduction, waited for by finish_reduction()."""
        if skip:  # every rank drops this step: nothing is reduced
            if self.zero_stage == 2:
                self.storage.free_all()
            return
        grads = [self.main_grad(i) for i in range(len(self.params))]
        self.compressor.reduce(grads, [[(0, g.numel(), g.view(-1))] for g in grads], grad_scale)
        before = self._sent_bytes
        for bucket in range(len(self.layout.buckets)):
            self._launch(bucket, after_compression=True)
        self._shard_group_bytes = self._sent_bytes - before
        self._sent_bytes += self.compressor.last_sent_bytes

    def reduction_pending(self) -> bool:
        """False once finish_reduction() has run and no gradient arrived since (a second call would
        reduce the same gradients twice)."""
        return not self._finished

    def zero_grad(self) -> None:
        """Clear every gradient before the next step's first microbatch."""
        if self._pending:
            raise RuntimeError("zero_grad() while dp reductions are in flight; call finish_reduction() first")
        self.storage.zero()
        for p in self.params:
            p.grad = None
        self._finished = False
        self._stale = False
        self.readiness.new_step()

    # ------------------------------------------------------------------ metrics

    def grad_bytes(self) -> int:
        """Bytes of gradient storage this rank holds right now (full buffers + shard + PowerSGD's
        residual share and Q)."""
        return self.storage.bytes() + (self.compressor.state_bytes() if self.compressor is not None else 0)

    def remove_hooks(self) -> None:
        """Detach from the parameters (hooks and sinks); the buffers stay readable."""
        P.detach_grad_destinations(self.params, self._hooks)
