"""AdamW with fp32 master weights and moments sharded over data parallelism (ZeRO 0/1/2).

Memory per parameter element on each rank (Ψ = this rank's parameter count, i.e. its tp
shard of its pipeline stage; padding: each bucket rounded up to a multiple of dp):

    | zero_stage | params (bf16) | main grads (fp32)          | master + exp_avg + exp_avg_sq (fp32) |
    | 0          | 2Ψ            | 4Ψ                          | 12Ψ                                 |
    | 1          | 2Ψ            | 4Ψ + 4Ψ/dp (reduced shard)  | 12Ψ/dp                              |
    | 2          | 2Ψ            | 4Ψ/dp after each bucket's   | 12Ψ/dp                              |
    |            |               | reduction (full bucket only |                                     |
    |            |               | while it fills in backward) |                                     |

One step (`step(lr)`):
1. `DataParallelGrads.finish_reduction()`: the bucketed dp reductions (most already started
   during the last microbatch's backward) complete. zero 0: all-reduce, every rank holds all
   summed gradients; zero 1/2: reduce-scatter, each rank holds the sum for its shard only.
2. Global grad norm over the whole mesh (`clip.py` rules, computed on the shard: each shard
   element is owned by exactly one dp rank). A non-finite norm means an inf/nan somewhere
   in the mesh: the step is skipped on every rank (and the fp16 loss scale backs off).
3. Gradients are divided by the loss scale and multiplied by the clip coefficient (one mul).
4. AdamW on the shard: the same math as `torch.optim.AdamW` (decoupled weight decay, bias
   correction), optionally on CPU (`offload_optimizer=True`).
5. Updated master weights are cast to the parameter dtype and all-gathered per bucket into
   the contiguous parameter buffer the model's parameters are views of; bucket b's gather is
   started as soon as its chunk is updated, overlapping the update of bucket b+1. With
   `overlap_param_gather=True` (zero >= 1) step() returns without waiting: buckets are
   updated and gathered in the order the next forward needs them, and a forward pre-hook on
   each module (`install_param_gather_hooks`) waits only for the buckets holding that
   module's own parameters, so the gathers run behind the next forward's first layers
   (Megatron's --overlap-param-gather). Anything else that reads the parameters between
   step() and the next forward (checkpoint save, replica check) calls `wait_for_params()`.

Weight decay: by default every parameter with fewer than two dimensions (biases, norm
weights) is excluded; pass `no_weight_decay=lambda name, param: ...` to change the rule.

Checkpointing (layout-free): `optimizer_state()` returns, per parameter name, the fp32
master/exp_avg/exp_avg_sq of the piece of that parameter's *flattened local tensor* this
rank owns, with its [start, end) range; `load_optimizer_state()` is the inverse. A
checkpoint engineer maps flat local ranges to full-tensor slices with `param.shard_spec`.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Iterable

import torch

from megalite import comm
from megalite.data_parallel.grads import DEFAULT_BUCKET_SIZE, DataParallelGrads
from megalite.mesh import Mesh
from megalite.optim.clip import clip_coefficient, counts_in_grad_norm, reduce_square_sum
from megalite.optim.loss_scaler import DynamicLossScaler

try:  # one fused Triton pass on GPUs; the plain torch ops below are the same math
    from megalite.kernels.adamw import adamw_step as fused_adamw_step
except ImportError:  # pragma: no cover - kernels are optional at import time
    fused_adamw_step = None


def default_no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Biases and norm weights (tensors with fewer than 2 dimensions) get no weight decay."""
    return param.dim() < 2


def _runs(pieces, flags) -> list[tuple[int, int]]:
    """Merge shard pieces whose flag is True into maximal contiguous [start, end) runs."""
    runs: list[list[int]] = []
    for piece, flag in zip(pieces, flags):
        if not flag:
            continue
        if runs and runs[-1][1] == piece.shard_start:
            runs[-1][1] = piece.shard_end
        else:
            runs.append([piece.shard_start, piece.shard_end])
    return [(a, b) for a, b in runs]


def adamw_update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 *, lr: float, beta1: float, beta2: float, eps: float, step: int) -> None:
    """One AdamW update of flat fp32 tensors in place (weight decay applied by the caller).

    Same operation order as torch.optim.AdamW's single-tensor path, so float32 results agree.
    On CUDA it runs megalite.kernels.adamw_step (fused, same math) instead.
    """
    if fused_adamw_step is not None and master.is_cuda:
        fused_adamw_step(master, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, 0.0, step)
        return
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


class DistributedOptimizer:
    """AdamW over this rank's shard of a model replica's parameters.

    Args:
        named_params: (name, param) of this rank's parameters in model order (all one dtype).
        mesh: the Mesh (dp_group for reductions, tp/pp for the global norm).
        zero_stage: 0 (plain data parallel), 1 (sharded optimizer state), 2 (+ sharded grads).
        betas, eps, weight_decay: AdamW hyper-parameters (torch.optim.AdamW meaning).
        clip_grad: clip the global grad norm to this value; 0 disables clipping.
        bucket_size, grad_reduce_dtype: see DataParallelGrads.
        offload_optimizer: keep master weights and moments in (pinned, with CUDA) CPU memory
            and run the update there.
        overlap_param_gather: leave the parameter all-gathers running after step(), waited for
            by forward pre-hooks (`install_param_gather_hooks`); zero_stage >= 1 only.
        loss_scaler: a DynamicLossScaler for fp16 (the caller scales the loss with it).
        no_weight_decay: (name, param) -> True to exclude a parameter from weight decay.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], mesh: Mesh, *, zero_stage: int = 1,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 clip_grad: float = 0.0, bucket_size: int = DEFAULT_BUCKET_SIZE,
                 grad_reduce_dtype: torch.dtype = torch.float32, offload_optimizer: bool = False,
                 loss_scaler: DynamicLossScaler | None = None,
                 no_weight_decay: Callable[[str, torch.Tensor], bool] = default_no_weight_decay,
                 overlap_param_gather: bool = False):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        if clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0 (0 disables clipping), got {clip_grad}")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise ValueError(f"parameters have mixed dtypes {sorted(map(str, dtypes))}; cast the model to one "
                             f"dtype (model.to(torch.bfloat16)) before building the optimizer")
        if overlap_param_gather and zero_stage == 0:
            raise ValueError("overlap_param_gather needs zero_stage >= 1: at zero 0 nothing is gathered")
        if overlap_param_gather and offload_optimizer:
            raise ValueError("overlap_param_gather does not combine with offload_optimizer (the host update "
                             "must finish before the step returns); drop one of them")
        self.mesh, self.zero_stage, self.overlap_param_gather = mesh, zero_stage, overlap_param_gather
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay, self.clip_grad = eps, weight_decay, clip_grad
        self.loss_scaler, self.offload = loss_scaler, offload_optimizer
        self.grads = DataParallelGrads([p for _, p in named], mesh.dp_group, bucket_size=bucket_size,
                                       grad_reduce_dtype=grad_reduce_dtype, zero_stage=zero_stage,
                                       tp_group=mesh.tp_group, defer_shared_embedding=mesh.pp_size > 1)
        names_by_param = {id(p): n for n, p in named}
        self.params = self.grads.params  # buffer order (reverse of model order)
        self.names = [names_by_param[id(p)] for p in self.params]
        layout = self.grads.layout
        self.device, self.param_dtype = self.params[0].device, self.params[0].dtype

        # The model's parameters become views of one contiguous buffer (same layout as the grads),
        # so a per-bucket all-gather writes updated weights straight into them.
        self.param_buffer = torch.zeros(layout.numel, dtype=self.param_dtype, device=self.device)
        for p, slot in zip(self.params, layout.slots):
            view = self.param_buffer[slot.start:slot.end]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view(p.shape)

        self.pieces = layout.owned_pieces(self.grads.shard_rank)
        self._decay_runs = _runs(self.pieces, [not no_weight_decay(self.names[x.param], self.params[x.param])
                                               for x in self.pieces])
        self._norm_runs = _runs(self.pieces, [counts_in_grad_norm(self.params[x.param], mesh) for x in self.pieces])
        self._other_runs = _runs(self.pieces, [not counts_in_grad_norm(self.params[x.param], mesh)
                                               for x in self.pieces])

        state_device = torch.device("cpu") if offload_optimizer else self.device
        pin = offload_optimizer and torch.cuda.is_available()
        shard_numel = layout.shard_numel

        def state_tensor() -> torch.Tensor:
            t = torch.zeros(shard_numel, dtype=torch.float32, device=state_device)
            return t.pin_memory() if pin else t

        self.master, self.exp_avg, self.exp_avg_sq = state_tensor(), state_tensor(), state_tensor()
        for bucket in layout.buckets:  # master := fp32 copy of the parameters this rank owns
            start, end = bucket.owned(self.grads.shard_rank)
            self.master[bucket.shard_offset:bucket.shard_offset + bucket.chunk_numel].copy_(
                self.param_buffer[start:end].float())
        self.step_count = 0
        self._gather_wait_total = 0.0  # host seconds ever spent waiting for parameter all-gathers
        self._gather_wait_reported = 0.0  # ... up to the last exposed_comm_seconds()
        self._pending: dict[int, object] = {}  # bucket index -> all-gather handle still in flight
        self._hooks_installed = False
        # Buckets in the order a forward first uses them (reverse of the buffer's backward order);
        # install_param_gather_hooks refines it from the model's structure.
        self._gather_order = list(reversed(range(len(layout.buckets))))

    # ------------------------------------------------------------------ the step

    def zero_grad(self) -> None:
        self.grads.zero_grad()

    def _global_norm_of_shard(self, grad: torch.Tensor) -> torch.Tensor:
        """Global L2 norm of the (loss-scaled) gradients; non-finite if any rank overflowed."""
        square = torch.zeros((), dtype=torch.float32, device=grad.device)
        for start, end in self._norm_runs:
            square += grad[start:end].square().sum()
        for start, end in self._other_runs:  # not counted, but an inf/nan there must still show up
            square += grad[start:end].square().sum() * 0.0
        return reduce_square_sum(square, self.mesh, sharded_over_dp=self.zero_stage > 0).sqrt()

    @torch.no_grad()
    def step(self, lr: float, skip: bool = False) -> dict:
        """Finish the dp reduction, clip, update, gather. Returns {'grad_norm', 'skipped', 'loss_scale'}.

        `grad_norm` is the global norm of the true (unscaled, unclipped) gradients.
        """
        if self.overlap_param_gather and not self._hooks_installed:
            raise RuntimeError("overlap_param_gather=True leaves the parameter all-gathers running after step(); call "
                               "optimizer.install_param_gather_hooks(model_chunks) first, or the next forward reads "
                               "half-gathered weights")
        self.wait_for_params()  # gathers of buckets the last forward never touched (params unused)
        self.grads.finish_reduction()
        grad = self.grads.grad_shard  # fp32 [shard_numel]
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        grad_norm = float(self._global_norm_of_shard(grad)) / scale
        found_inf = skip or not math.isfinite(grad_norm)  # skip: the caller saw a non-finite loss (all ranks agree)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        result = {"grad_norm": grad_norm, "skipped": found_inf, "loss_scale": scale}
        if found_inf:
            return result
        factor = 1.0 / scale
        if self.clip_grad > 0:
            factor *= float(clip_coefficient(torch.tensor(grad_norm), self.clip_grad))
        if factor != 1.0:
            grad.mul_(factor)
        if self.offload:
            grad = grad.to("cpu", non_blocking=True)
            if grad.device != self.grads.grad_shard.device:
                torch.cuda.synchronize()

        self.step_count += 1
        # Bucket by bucket: update the shard's chunk, then start its all-gather at once, so the
        # gather of bucket b runs while the update of bucket b+1 computes.
        handles = {}
        for index in self._gather_order:
            bucket = self.grads.layout.buckets[index]
            lo, hi = bucket.shard_offset, bucket.shard_offset + bucket.chunk_numel
            if self.weight_decay != 0.0:
                for start, end in self._decay_runs:  # decoupled decay, before the Adam update (as torch does)
                    start, end = max(start, lo), min(end, hi)
                    if start < end:
                        self.master[start:end].mul_(1 - lr * self.weight_decay)
            adamw_update(self.master[lo:hi], grad[lo:hi], self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi], lr=lr,
                         beta1=self.beta1, beta2=self.beta2, eps=self.eps, step=self.step_count)
            handles[index] = self._publish_bucket(bucket)
        if self.overlap_param_gather and not self.offload:
            self._pending = handles  # waited for by the forward pre-hooks, bucket by bucket
            return result
        self._wait_gathers(handles.values())
        if self.offload and self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # pinned master chunks are read by async H2D copies
        return result

    def _publish_bucket(self, bucket):
        """Cast this rank's updated chunk of `bucket` to the param dtype and start its all-gather."""
        chunk = self.master[bucket.shard_offset:bucket.shard_offset + bucket.chunk_numel]
        chunk = chunk.to(self.device, self.param_dtype, non_blocking=True)
        out = self.param_buffer[bucket.start:bucket.end]  # [bucket numel] = every rank's chunk, rank-major
        if self.zero_stage == 0:
            out.copy_(chunk)
            return None
        return comm.all_gather_into(out, chunk, self.grads.dp_group, async_op=True)

    def _wait_gathers(self, handles) -> None:
        started = time.perf_counter()
        for handle in handles:
            if handle is not None:
                handle.wait()
        self._gather_wait_total += time.perf_counter() - started  # only the part not hidden behind other work

    def wait_for_params(self, buckets: Iterable[int] | None = None) -> None:
        """Complete the parameter all-gathers still in flight (of `buckets`, default all)."""
        if not self._pending:
            return
        indices = list(self._pending) if buckets is None else [b for b in buckets if b in self._pending]
        self._wait_gathers([self._pending.pop(b) for b in indices])

    def install_param_gather_hooks(self, chunks: list[torch.nn.Module]) -> list:
        """With overlap_param_gather: a forward pre-hook on every module that owns parameters
        waits for the buckets holding them; the gather order becomes the forward's order of
        first use. `chunks`: this rank's model chunks in execution order. Returns the hook handles.

        Contract: a parameter is read inside its owning module's forward, or after that module
        (or an ancestor owning it) has run in this forward, as megalite's layers do; a model
        that reads a weight from elsewhere (e.g. a functional call on a sibling's parameter
        before the sibling runs) must call `wait_for_params()` itself.
        """
        slot_of = {id(p): slot for p, slot in zip(self.params, self.grads.layout.slots)}
        first_use: dict[int, int] = {}  # bucket -> position of its first parameter in forward order
        handles = []
        position = 0
        for chunk in chunks:
            for module in chunk.modules():  # pre-order: a parent's forward starts before its children's
                buckets = sorted({slot_of[id(p)].bucket for p in module.parameters(recurse=False) if id(p) in slot_of})
                for bucket in buckets:
                    first_use.setdefault(bucket, position)
                position += 1
                if buckets and self.overlap_param_gather:
                    handles.append(module.register_forward_pre_hook(
                        lambda _module, _args, buckets=tuple(buckets): self.wait_for_params(buckets)))
        unused = [b for b in range(len(self.grads.layout.buckets)) if b not in first_use]
        self._gather_order = sorted(first_use, key=first_use.get) + unused
        self._hooks_installed = True
        return handles

    def publish_params(self) -> None:
        """Write the fp32 master shard into the parameters: cast, then all-gather per bucket over dp."""
        self.wait_for_params()
        self._wait_gathers([self._publish_bucket(bucket) for bucket in self.grads.layout.buckets])

    # ------------------------------------------------------------------ checkpoint API (layout-free)

    def optimizer_state(self) -> dict:
        """This rank's optimizer state in model space, independent of dp/bucket layout.

        Returns {'step': int, 'loss_scaler': dict | None, 'params': {name: {
            'start', 'end': the range of the flattened local parameter tensor this rank owns,
            'numel', 'shape': of the local tensor (its tp shard),
            'master', 'exp_avg', 'exp_avg_sq': fp32 CPU tensors of length end - start}}}.
        Parameters of which this rank owns nothing are absent; over the dp group the ranges
        of one parameter tile [0, numel) exactly once (once per rank at zero_stage 0).
        """
        params = {}
        for piece in self.pieces:
            p = self.params[piece.param]
            sl = slice(piece.shard_start, piece.shard_end)
            params[self.names[piece.param]] = {
                "start": piece.local_start, "end": piece.local_end, "numel": p.numel(), "shape": tuple(p.shape),
                "master": self.master[sl].detach().cpu().clone(), "exp_avg": self.exp_avg[sl].detach().cpu().clone(),
                "exp_avg_sq": self.exp_avg_sq[sl].detach().cpu().clone(),
            }
        return {"step": self.step_count, "params": params,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def owned_ranges(self) -> dict[str, tuple[int, int]]:
        """{name: (start, end)} of each parameter's flattened local tensor this rank owns."""
        return {self.names[x.param]: (x.local_start, x.local_end) for x in self.pieces}

    def load_optimizer_state(self, state: dict) -> None:
        """Inverse of `optimizer_state`; then the parameters are set from the loaded master weights.

        Each entry's [start, end) must cover this rank's owned range of that parameter (an
        entry covering the whole local tensor, start=0, end=numel, always works), so a
        checkpoint written under another dp size or zero stage loads here.
        """
        for piece in self.pieces:
            name = self.names[piece.param]
            if name not in state["params"]:
                raise KeyError(f"optimizer state has no entry for parameter {name!r}")
            entry = state["params"][name]
            if entry["start"] > piece.local_start or entry["end"] < piece.local_end:
                raise ValueError(f"optimizer state for {name!r} covers [{entry['start']}, {entry['end']}) but this "
                                 f"rank owns [{piece.local_start}, {piece.local_end}); provide the whole local tensor")
            src = slice(piece.local_start - entry["start"], piece.local_end - entry["start"])
            dst = slice(piece.shard_start, piece.shard_end)
            for key, tensor in (("master", self.master), ("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                tensor[dst].copy_(entry[key][src])
        self.step_count = int(state["step"])
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.publish_params()

    # ------------------------------------------------------------------ metrics

    def exposed_comm_seconds(self) -> float:
        """Host seconds of the last step spent in dp communication not hidden behind other work:
        the wait in finish_reduction() (plus buckets launched there) and the waits for parameter
        all-gathers since the previous call (with overlap_param_gather, in this step's forward)."""
        gather = self._gather_wait_total - self._gather_wait_reported
        self._gather_wait_reported = self._gather_wait_total
        return self.grads.exposed_seconds + gather

    def memory_report(self) -> dict[str, int]:
        """Per-rank bytes: parameters, gradient storage held now, optimizer state."""
        state = sum(t.numel() * t.element_size() for t in (self.master, self.exp_avg, self.exp_avg_sq))
        return {"param_bytes": self.param_buffer.numel() * self.param_buffer.element_size(),
                "grad_bytes": self.grads.grad_bytes(), "optimizer_state_bytes": state}
