"""DiLoCo across replica groups (Douillard et al. 2023): H inner steps apart, then one outer step.

Under hybrid sharding (--dp-shard S) the dp/S replica groups normally all-reduce every step's
reduced shard. With `--diloco-inner-steps H` they do not: each group trains on its own batches
with its own inner optimizer (AdamW, its state kept across outer steps), its gradients reduced
within its shard group and normalised by its own tokens (DataParallel(replicas_apart=True)).
Every H steps each rank, for the shard it owns (its fp32 master chunks; the same position holds
the same elements in every group):

    avg   = mean over the replica groups of the inner parameters   (one all-reduce over dp_replicate)
    Δ     = θ_outer - avg                                           (the pseudo-gradient)
    m     = μ m + Δ
    θ     = θ_outer - lr (Δ + μ m)   computed as   avg + (1 - lr) Δ - lr μ m     (Nesterov SGD)

and θ becomes both the new outer parameters and every group's inner parameters (published, i.e.
gathered within the shard group). Written from `avg`, lr = 1 with μ = 0 gives `avg` bit for bit:
one replica group then trains exactly as without DiLoCo, and two give the mean of their own runs.
The replica links carry 4 bytes per owned element every H steps instead of the reduced gradient
shard every step: ~H x fewer bytes.
"""
from __future__ import annotations

import bisect

import torch

from megalite.distributed import comm


class DiLoCo:
    """The outer optimizer of one rank's shard (see the module docstring); `optimizer.outer` holds it and
    `train_step` calls `after_step` once per step."""

    def __init__(self, optimizer, *, inner_steps: int, outer_lr: float, outer_momentum: float):
        if inner_steps < 1:
            raise ValueError(f"DiLoCo needs inner_steps >= 1, got {inner_steps}")
        if not optimizer.model.replicas_apart:
            raise ValueError("DiLoCo needs DataParallel(..., replicas_apart=True): the groups must not reduce "
                             "every step")
        self.optimizer, self.mesh = optimizer, optimizer.model.mesh
        self.inner_steps, self.outer_lr, self.momentum = inner_steps, outer_lr, outer_momentum
        self.group = self.mesh.replicate_group  # None with one replica group
        self.groups = self.mesh.dp_replicate_size
        with torch.no_grad():
            self.outer = [chunk.detach().clone() for chunk in optimizer.master_chunks()]  # fp32 θ_outer per bucket
            self.velocity = [torch.zeros_like(chunk) for chunk in self.outer]
        self.steps = 0

    @torch.no_grad()
    def after_step(self, group_tokens: float) -> float:
        """Count a step; every `inner_steps` run the outer step. Returns the step's tokens over every
        replica group (the loss is reported over all of them)."""
        self.steps += 1
        if self.steps % self.inner_steps == 0:
            self._outer_step()
        if self.group is None:
            return group_tokens
        total = torch.tensor([group_tokens], dtype=torch.float64, device=self.mesh.device)
        comm.all_reduce(total, self.group)
        return float(total.item())

    def _outer_step(self) -> None:
        lr, mu = self.outer_lr, self.momentum
        for chunk, outer, velocity in zip(self.optimizer.master_chunks(), self.outer, self.velocity):
            average = chunk.clone()
            comm.all_reduce(average, self.group)  # [chunk numel] fp32, the only traffic across replica groups
            average.div_(self.groups)
            delta = outer - average  # the pseudo-gradient
            velocity.mul_(mu).add_(delta)
            new = average.add_(delta, alpha=1 - lr).add_(velocity, alpha=-lr * mu)
            chunk.copy_(new)
            outer.copy_(new)
        self.optimizer.publish_params()  # every rank's parameters from the new masters (gathers in the shard group)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "outer": [t.clone() for t in self.outer],
                "velocity": [t.clone() for t in self.velocity]}

    # ------------------------------------------------------------------ checkpoint API (layout-free)

    def _range(self, chunks: list[torch.Tensor], start: int, end: int) -> torch.Tensor:
        """Shard elements [start, end) (within one bucket's chunk) of per-bucket `chunks` (outer, velocity)."""
        offsets = [b.shard_offset for b in self.optimizer.model.layout.buckets]
        bucket = bisect.bisect_right(offsets, start) - 1
        return chunks[bucket][start - offsets[bucket]:end - offsets[bucket]]

    def checkpoint_state(self) -> dict:
        """{name: {'start', 'end', 'shape', 'diloco_outer', 'diloco_velocity'}}: θ_outer and the momentum of
        the flat ranges this rank owns, in model space like `DistributedOptimizer.optimizer_state` (fp32 CPU)."""
        opt, out = self.optimizer, {}
        for piece in opt.pieces:
            p = opt.params[piece.param]
            out[opt.names[piece.param]] = {
                "start": piece.local_start, "end": piece.local_end, "shape": tuple(p.shape),
                "diloco_outer": self._range(self.outer, piece.shard_start, piece.shard_end).cpu().clone(),
                "diloco_velocity": self._range(self.velocity, piece.shard_start, piece.shard_end).cpu().clone()}
        return out

    @torch.no_grad()
    def load_checkpoint_state(self, entries: dict | None, *, steps: int) -> None:
        """Inverse of `checkpoint_state` (entries cover this rank's owned ranges, read from any layout), with
        the step count that places the next outer step. entries None (a checkpoint without DiLoCo): the
        outer parameters restart from the loaded masters with zero momentum."""
        self.steps = steps
        if entries is None:
            for outer, velocity, chunk in zip(self.outer, self.velocity, self.optimizer.master_chunks()):
                outer.copy_(chunk)
                velocity.zero_()
            return
        opt = self.optimizer
        for piece in opt.pieces:
            entry = entries[opt.names[piece.param]]
            src = slice(piece.local_start - entry["start"], piece.local_end - entry["start"])
            for kind, chunks in (("diloco_outer", self.outer), ("diloco_velocity", self.velocity)):
                self._range(chunks, piece.shard_start, piece.shard_end).copy_(entry[kind][src])
