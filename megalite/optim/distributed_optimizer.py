"""AdamW over the shard a `DataParallel` wrapper hands it (ZeRO 0/1/2/3), fp32 master weights.

The wrapper (megalite/data_parallel/wrapper.py) owns the parameters and gradients: it lays
them out in buckets (ZeRO-3: one per unit), reduces the gradients over dp and gathers the
parameters. This optimizer owns only the state of the elements this rank updates (all of
them at ZeRO 0, a 1/dp shard at ZeRO 1/2/3): Adam moments, and an fp32 master only where this
rank's chunk of the parameters is not itself fp32 (no redundant copy: fp32 training, and
ZeRO-3's fp32 shard in every precision, are updated in place). It never re-points a
parameter. Memory per parameter element on each rank (Ψ = this rank's parameter count, i.e.
its tp shard of its pipeline stage; padding: each bucket rounded up to a multiple of dp):

    | zero_stage | params (bf16; fp32: x2) | main grads (fp32)          | [master] + exp_avg + exp_avg_sq  |
    | 0          | 2Ψ                      | 4Ψ                          | 12Ψ (fp32: 8Ψ)                  |
    | 1          | 2Ψ                      | 4Ψ + 4Ψ/dp (reduced shard)  | 12Ψ/dp (fp32: 8Ψ/dp)            |
    | 2          | 2Ψ                      | 4Ψ/dp after each bucket's   | 12Ψ/dp (fp32: 8Ψ/dp)            |
    |            |                         | reduction (full bucket only |                                 |
    |            |                         | while it fills in backward) |                                 |
    | 3          | 4Ψ/dp (fp32 shard) +    | 4Ψ/dp + a unit or two while | 8Ψ/dp                           |
    |            | the units gathered      | they are reduce-scattered   |                                 |

One step (`step()`, each group's lr; or `step(lr=...)`, every group at lr; `step(closure)` returns the
closure's loss, as torch.optim does; what the step did is `last_step`, an `OptimizerStep`):
1. `DataParallel.finish_grad_sync()`: the bucketed dp reductions (most already started
   during the last microbatch's backward) complete. zero 0: all-reduce, every rank holds all
   summed gradients; zero 1/2: reduce-scatter, each rank holds the sum for its shard only.
2. Global grad norm over the whole mesh (`clip.py` rules, computed on the shard: each shard
   element is owned by exactly one dp rank). A non-finite norm means an inf/nan somewhere
   in the mesh: the step is skipped on every rank (and the fp16 loss scale backs off).
3. Gradients are divided by the loss scale and multiplied by the clip coefficient (one mul).
4. AdamW on the shard: the same math as `torch.optim.AdamW` (decoupled weight decay, bias
   correction), optionally on CPU (`offload_optimizer=True`).
5. Each bucket's updated chunk goes back to the wrapper (`DataParallel.publish`; ZeRO-3: it is
   the shard itself and nothing is gathered), which casts
   it to the parameter dtype and all-gathers the bucket over dp, bucket b's gather running
   while bucket b+1 is updated; buckets go in the order the next forward first reads them.
   With the wrapper's overlap_param_gather the gathers are still running when step() returns
   and finish behind the next forward (the wrapper's read guard makes every read wait for its
   own bucket). Anything else that reads the parameters between step() and the next forward
   (checkpoint save, replica check) calls `wait_for_params()`.

Parameter groups (torch.optim's): `params=` takes group dicts over the wrapped model's
parameters, each with its own lr, weight_decay, betas, eps (optim/param_groups.py maps them to
runs of the shard). Without them, two groups: weight decay except on parameters with fewer than
two dimensions (biases, norm weights); pass `no_weight_decay=lambda name, param: ...` to change
the rule. The update runs over a whole bucket chunk at once when the groups share lr, betas and
eps (the usual case, and what an LR scheduler keeps), else run by run: the same numbers.

`state_dict()` / `load_state_dict()` are torch's, with whole tensors keyed by logical name
(optim/state_dict.py); `optimizer_state()` / `load_optimizer_state()` are the checkpoint's, this rank's
pieces of each parameter's flattened local tensor, no gather (optim/rank_state.py). The AdamW
arithmetic itself is optim/adamw.py.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable

import torch

from megalite.data_parallel.wrapper import DataParallel
from megalite.optim.adamw import adamw_update
from megalite.optim.compact_state import CompactState, merged
from megalite.optim.clip import clip_coefficient, counts_in_grad_norm, reduce_square_sum, square_sum
from megalite.optim.loss_scaler import DynamicLossScaler
from megalite.optim.muon import MuonSettings, ShardedMuon, default_hidden_matrix, muon_groups
from megalite.optim.param_groups import as_group_list, check_cover, clip_runs, default_groups, group_runs, same_update
from megalite.optim.rank_state import load_rank_state, rank_state
from megalite.optim.state_dict import full_state_dict, load_full_state_dict


@dataclass(frozen=True)
class OptimizerStep:
    """What one `DistributedOptimizer.step` did (its `last_step`).

    grad_norm: the global norm of the true (unscaled, unclipped) gradients; skipped: no update (a
    non-finite norm, or the caller's `skip`); loss_scale: the fp16 loss scale the gradients carried
    (1.0 without a scaler), before this step's update of it.
    """

    grad_norm: float
    skipped: bool
    loss_scale: float


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


def _initial_groups(names: list[str], trained: list[torch.Tensor], params, *, weight_decay: float, no_weight_decay,
                    muon: MuonSettings | None, hidden_matrix) -> list[dict]:
    """The param groups: the caller's, or the default two; with Muon, its group over the hidden matrices."""
    groups = default_groups(names, trained, weight_decay, no_weight_decay) if params is None else as_group_list(params)
    if muon is not None or any(g.get("use_muon") for g in groups):  # Muon on the hidden matrices (optim/muon.py)
        groups = muon_groups(groups, names, trained, muon or MuonSettings(), hidden_matrix, from_default=params is None)
    check_cover(groups, names, trained)
    return groups


def _check_arguments(model, clip_grad: float, offload_optimizer: bool) -> None:
    """The constructor's refusals, before anything is allocated."""
    if not isinstance(model, DataParallel):  # a bare module has no gradient buffers or shards to update
        raise TypeError(f"DistributedOptimizer takes the DataParallel wrapper, not a bare "
                        f"{type(model).__name__}: model = DataParallel(my_model, mesh); "
                        f"DistributedOptimizer(model, ...)")
    if clip_grad < 0:
        raise ValueError(f"--clip-grad must be >= 0 (0 disables clipping), got {clip_grad}")
    if offload_optimizer and model.param_buffer.overlap:
        raise ValueError("overlap_param_gather does not combine with offload_optimizer (the host update "
                         "must finish before the step returns); drop one of them")


class DistributedOptimizer(torch.optim.Optimizer):
    """AdamW over the elements of `model` (a DataParallel wrapper) that this rank updates, shaped as a
    torch.optim.Optimizer: `param_groups`, `state_dict` / `load_state_dict`, `zero_grad`, `step()`.

    Args:
        model: the DataParallel wrapper; its zero_stage decides the shard (everything at 0).
        params: None (every parameter the wrapper trains, in two groups: weight decay except where
            `no_weight_decay` says, none there), or torch.optim's params: tensors of the wrapped
            model, or group dicts over them with their own "lr", "weight_decay", "betas", "eps".
        lr, betas, eps, weight_decay: the defaults of every group (torch.optim.AdamW meaning).
        clip_grad: clip the global grad norm (whole mesh) to this value; 0 disables clipping.
        offload_optimizer: keep master weights and moments in (pinned, with CUDA) CPU memory
            and run the update there.
        loss_scaler: a DynamicLossScaler for fp16 (the caller scales the loss with it).
        no_weight_decay: (name, param) -> True to exclude a parameter from weight decay (params=None).
        muon: MuonSettings: Muon on the hidden matrices (`hidden_matrix(name, param)`, params=None: their own
            group, first), AdamW on the rest; or mark a group dict {"use_muon": True}. optim/muon.py.

    `step()` reads each group's "lr", so a torch.optim.lr_scheduler (or `ScheduledLR`, the
    training loop's own schedule) drives it; `step(lr)` sets every group's lr first (the older form).
    """

    def __init__(self, model: DataParallel, params=None, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, clip_grad: float = 0.0, offload_optimizer: bool = False,
                 loss_scaler: DynamicLossScaler | None = None,
                 no_weight_decay: Callable[[str, torch.Tensor], bool] = default_no_weight_decay,
                 muon: MuonSettings | None = None,
                 hidden_matrix: Callable[[str, torch.Tensor], bool] = default_hidden_matrix):
        _check_arguments(model, clip_grad, offload_optimizer)
        self.model, self.mesh, self.zero_stage = model, model.mesh, model.zero_stage
        self.clip_grad = clip_grad
        self.loss_scaler, self.offload = loss_scaler, offload_optimizer
        self.params, self.names = model.params, model.names  # buffer order (reverse of model order)
        groups = _initial_groups(self.names, self.params, params, weight_decay=weight_decay,
                                 no_weight_decay=no_weight_decay, muon=muon, hidden_matrix=hidden_matrix)
        super().__init__(groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.pieces = model.owned_pieces()
        self._group_runs = group_runs(self.param_groups, self.params, self.pieces)
        over_replicas = self.zero_stage == 0 and self.mesh.ep_size > 1  # ep > 1 sums the norm over the world
        self.replicas_apart = model.replicas_apart  # DiLoCo: each replica group clips by its own norm
        counted = [counts_in_grad_norm(self.params[x.param], self.mesh, over_replicas, sharded=self.zero_stage > 0,
                                       replicas_apart=self.replicas_apart) for x in self.pieces]
        self._norm_runs = _runs(self.pieces, counted)
        self._other_runs = _runs(self.pieces, [not c for c in counted])
        self.device = model.param_buffer.device
        state_device = torch.device("cpu") if offload_optimizer else self.device
        pin = offload_optimizer and torch.cuda.is_available()
        shard_numel = model.layout.shard_numel

        def state_tensor() -> torch.Tensor:
            t = torch.zeros(shard_numel, dtype=torch.float32, device=state_device)
            return t.pin_memory() if pin else t

        buckets = model.layout.buckets
        # No redundant master copy: when this rank's chunk of the parameters is fp32 (fp32 training: its
        # slot of the buffer; ZeRO-3 in any precision: its shard) and the state stays on its device,
        # that chunk IS the master.
        self.shares_master = not offload_optimizer and model.owned_params(0).dtype == torch.float32
        self.master = None if self.shares_master else state_tensor()
        self._masters = [model.owned_params(b.index) if self.shares_master else self._chunk(self.master, b.index)
                         for b in buckets]  # per bucket: this rank's fp32 master chunk
        if not self.shares_master:
            for bucket in buckets:  # master := fp32 copy of the parameters this rank owns
                self._masters[bucket.index].copy_(model.owned_params(bucket.index).float())
        self._shard_offsets = [b.shard_offset for b in buckets]
        # per bucket, per group: views of the master chunk that the group's weight decay scales, made
        # once: the step then decays them with one foreach op per group instead of a slice and a mul_ per run
        self._group_views = [[[self._masters[b.index][a:z] for a, z in clip_runs(runs, *self._bounds(b.index))]
                              for runs in self._group_runs] for b in buckets]
        # Muon's momentum is exp_avg on its elements; the second moment then exists for AdamW's elements only
        self.exp_avg, self.exp_avg_sq = state_tensor(), self._second_moment(state_tensor, state_device, pin)
        self.step_count = 0
        self.last_step: OptimizerStep | None = None  # what the latest step() did
        self.muon = ShardedMuon(self, owners=(muon or MuonSettings()).owners) if self._has_muon() else None

    def _has_muon(self) -> bool:
        return any(g.get("use_muon") for g in self.param_groups)

    def _second_moment(self, state_tensor, device: torch.device, pin: bool):
        """Adam's exp_avg_sq: shard-sized, or with Muon groups a CompactState over the AdamW groups' runs."""
        if not self._has_muon():
            return state_tensor()
        adam = [run for g, runs in zip(self.param_groups, self._group_runs) if not g.get("use_muon") for run in runs]
        return CompactState(merged(adam), device=device, pin=pin)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_group_runs", None) is not None:  # after construction the shard's runs are fixed
            raise ValueError("DistributedOptimizer's param groups are fixed when it is built (they decide the "
                             "shard's update runs); pass every group to the constructor")
        super().add_param_group(param_group)

    def group_runs_of(self, group: int) -> list[tuple[int, int]]:
        """The [start, end) shard runs of param group `group`'s parameters on this rank."""
        return self._group_runs[group]

    def _bounds(self, bucket: int) -> tuple[int, int]:
        b = self.model.layout.buckets[bucket]
        return b.shard_offset, b.shard_offset + b.chunk_numel

    def _chunk(self, state: torch.Tensor, bucket: int) -> torch.Tensor:
        """This rank's chunk of `bucket` within a shard-sized tensor."""
        lo, hi = self._bounds(bucket)
        return state[lo:hi]

    def master_chunks(self) -> list[torch.Tensor]:
        """Per bucket, this rank's fp32 master chunk (updated in place; `publish_params` spreads it)."""
        return list(self._masters)

    def master_range(self, start: int, end: int) -> torch.Tensor:
        """The fp32 master of shard elements [start, end) (within one bucket's chunk)."""
        bucket = bisect.bisect_right(self._shard_offsets, start) - 1
        offset = self._shard_offsets[bucket]
        return self._masters[bucket][start - offset:end - offset]

    # ------------------------------------------------------------------ the step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the wrapper's gradient buffers (they are reused: there is nothing to set to None)."""
        self.model.zero_grad()

    def _global_norm_of_shard(self, grad: torch.Tensor) -> torch.Tensor:
        """Global L2 norm of the (loss-scaled) gradients; non-finite if any rank overflowed."""
        # square_sum squares no whole run: `run.square().sum()` would allocate a square of the run, at
        # worst a second fp32 copy of this rank's gradients at the step's peak (what --simulate found)
        square = torch.zeros((), dtype=torch.float32, device=grad.device)
        for start, end in self._norm_runs:
            square += square_sum(grad[start:end])
        for start, end in self._other_runs:  # not counted, but an inf/nan there must still show up
            square += square_sum(grad[start:end]) * 0.0
        return reduce_square_sum(square, self.mesh, sharded_over_dp=self.zero_stage > 0,
                                 replicas_apart=self.replicas_apart).sqrt()

    @torch.no_grad()
    def step(self, closure: Callable | None = None, *, lr: float | None = None, skip: bool = False):
        """Finish the dp reduction, clip, update, publish; returns the closure's loss (None without one),
        as torch.optim's step does. What the step did (grad norm, skipped, loss scale) is `last_step`.

        Each group's update reads its own "lr" (set by an LR scheduler); `lr`, when given, is first
        written into every group. `skip`: the caller saw a non-finite loss (all ranks agree): no update.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_step = self._update(lr, skip)
        return loss

    def _update(self, lr: float | None, skip: bool) -> OptimizerStep:
        """The step itself (module docstring, steps 1-5)."""
        if lr is not None:
            for group in self.param_groups:
                group["lr"] = lr
        self.model.wait_for_params()  # gathers of buckets the last forward never touched (params unused)
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        self.model.finish_grad_sync(fill_param_grads=False, grad_scale=scale, skip=skip)
        grad = self.model.grad_shard  # fp32 [shard_numel]
        grad_norm = float(self._global_norm_of_shard(grad)) / scale
        found_inf = skip or not math.isfinite(grad_norm)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        result = OptimizerStep(grad_norm=grad_norm, skipped=found_inf, loss_scale=scale)
        if found_inf:
            return result
        factor = 1.0 / scale
        if self.clip_grad > 0:
            factor *= float(clip_coefficient(torch.tensor(grad_norm), self.clip_grad))
        if factor != 1.0:
            grad.mul_(factor)
        if self.offload:
            grad = grad.to("cpu", non_blocking=True)
            if grad.device != self.model.grad_shard.device:
                torch.cuda.synchronize()
        self.step_count += 1
        one_pass = self.muon is None and same_update(self.param_groups)
        if self.muon is not None:  # every hidden matrix orthogonalised on its owner (collective over the stage)
            self.muon.prepare(grad, self.exp_avg)
        for bucket in self.model.gather_order:  # the next forward's order: its first gathers land first
            self._update_bucket(bucket, grad, one_pass)
            self.model.publish(bucket, self._masters[bucket])
        if self.muon is not None:
            self.muon.release()
        self.model.published()
        if self.offload and self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # pinned master chunks are read by async H2D copies
        return result

    def _update_bucket(self, bucket: int, grad: torch.Tensor, one_pass: bool) -> None:
        """Decoupled weight decay per group (before the Adam update, as torch does), then AdamW on one
        bucket's chunk: in one pass when every group's update reads the same lr, betas and eps, else
        per group run (elementwise either way: the same numbers)."""
        lo, hi = self._bounds(bucket)
        master = self._masters[bucket]
        for group, views in zip(self.param_groups, self._group_views[bucket]):
            if group["weight_decay"] != 0.0 and views:  # the same float32 product as a mul_ per run
                torch._foreach_mul_(views, 1 - group["lr"] * group["weight_decay"])
        if one_pass:
            self._adam(master, grad[lo:hi], lo, hi, self.param_groups[0])
            return
        for g, (group, runs) in enumerate(zip(self.param_groups, self._group_runs)):
            if group.get("use_muon"):
                self.muon.apply(master, g, lo, hi)
                continue
            for a, z in clip_runs(runs, lo, hi):
                self._adam(master[a:z], grad[lo + a:lo + z], lo + a, lo + z, group)

    def _adam(self, master: torch.Tensor, grad: torch.Tensor, start: int, end: int, group: dict) -> None:
        beta1, beta2 = group["betas"]
        adamw_update(master, grad, self.exp_avg[start:end], self.exp_avg_sq[start:end], lr=group["lr"],
                     beta1=beta1, beta2=beta2, eps=group["eps"], step=self.step_count)

    def wait_for_params(self) -> None:
        """Complete the parameter all-gathers still in flight (see DataParallel.wait_for_params)."""
        self.model.wait_for_params()

    def publish_params(self) -> None:
        """Write the fp32 master shard into the parameters: cast, then all-gather per bucket over dp."""
        self.model.wait_for_params()
        for bucket in self.model.gather_order:
            self.model.publish(bucket, self._masters[bucket])
        self.model.wait_for_params()

    # ------------------------------------------------------------------ torch's state dict (layout-free)

    def state_dict(self) -> dict:
        """torch's shape keyed by logical parameter name, every tensor whole (see optim/state_dict.py).
        Collective: every rank of the mesh calls it."""
        return full_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """`state_dict()`'s output from any layout; this rank keeps the pieces it owns."""
        load_full_state_dict(self, state_dict)

    # ------------------------------------------------------------------ checkpoint API (layout-free)

    def optimizer_state(self) -> dict:
        """This rank's optimizer state in model space (optim/rank_state.py)."""
        return rank_state(self)

    def owned_ranges(self) -> dict[str, tuple[int, int]]:
        """{name: (start, end)} of each parameter's flattened local tensor this rank owns."""
        return {self.names[x.param]: (x.local_start, x.local_end) for x in self.pieces}

    def load_optimizer_state(self, state: dict) -> None:
        """Inverse of `optimizer_state` (optim/rank_state.py); then the parameters are set from the
        loaded master weights."""
        load_rank_state(self, state)
        self.publish_params()

    # ------------------------------------------------------------------ metrics

    def memory_report(self) -> dict[str, int]:
        """Per-rank bytes: parameters and gradient storage held now (the wrapper's), optimizer state."""
        state = sum(t.numel() * t.element_size() for t in (self.master, self.exp_avg, self.exp_avg_sq) if t is not None)
        outer = getattr(self, "outer", None)  # DiLoCo's θ_outer and momentum (data_parallel/diloco.py)
        state += outer.nbytes() if outer is not None else 0
        return {**self.model.memory_report(), "optimizer_state_bytes": state}
