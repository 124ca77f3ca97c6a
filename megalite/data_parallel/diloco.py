"""DiLoCo across replica groups (Douillard et al. 2023), streamed over fragments (Douillard et al. 2025).

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

Streaming (`--diloco-fragments F`): the parameters split into F fragments of contiguous layers
(megalite/config/diloco.py: the rule and the schedule); every H/F steps one fragment, in turn, takes
the outer step above on its own elements (its own θ_outer and momentum), so a sync all-reduces ~1/F
of the shard and the total per H steps is unchanged. F = 1 is the plain DiLoCo above.

`--diloco-reduce-dtype bf16`: each group all-reduces its own pseudo-gradient θ_outer - θ in bf16 instead
(half the bytes), and avg = θ_outer - mean Δ.
"""
from __future__ import annotations

import bisect

import torch

from megalite.config.diloco import parameter_fragment, synced_fragment
from megalite.distributed import comm


class DiLoCo:
    """The outer optimizer of one rank's shard (see the module docstring); `optimizer.outer` holds it and
    `train_step` calls `after_step` once per step."""

    def __init__(self, optimizer, *, inner_steps: int, outer_lr: float, outer_momentum: float, fragments: int = 1,
                 reduce_dtype: torch.dtype = torch.float32):
        if inner_steps < 1 or fragments < 1 or inner_steps % fragments:
            raise ValueError(f"DiLoCo needs inner_steps >= 1 divided by fragments >= 1, got {inner_steps} and "
                             f"{fragments}")
        if not optimizer.model.replicas_apart:
            raise ValueError("DiLoCo needs DataParallel(..., replicas_apart=True): the groups must not reduce "
                             "every step")
        self.optimizer, self.mesh = optimizer, optimizer.model.mesh
        self.inner_steps, self.outer_lr, self.momentum = inner_steps, outer_lr, outer_momentum
        self.fragments, self.reduce_dtype = fragments, reduce_dtype
        self.group = self.mesh.replicate_group  # None with one replica group
        self.groups = self.mesh.dp_replicate_size
        num_layers = optimizer.model.chunks[0].config.num_layers
        self.ranges, self.buckets = fragment_ranges(optimizer, num_layers=num_layers, fragments=fragments)
        with torch.no_grad():
            self.outer = [chunk.detach().clone() for chunk in optimizer.master_chunks()]  # fp32 θ_outer per bucket
            self.velocity = [torch.zeros_like(chunk) for chunk in self.outer]
        self.steps = 0

    @torch.no_grad()
    def after_step(self, group_tokens: float) -> float:
        """Count a step; run the outer step of the fragment due now, if any. Returns the step's tokens over
        every replica group (the loss is reported over all of them)."""
        self.steps += 1
        fragment = synced_fragment(self.steps, inner_steps=self.inner_steps, fragments=self.fragments)
        if fragment is not None:
            self._outer_step(fragment)
        if self.group is None:
            return group_tokens
        total = torch.tensor([group_tokens], dtype=torch.float64, device=self.mesh.device)
        return float(self.sum_over_groups(total).item())

    def sum_over_groups(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the replica groups, in place: DiLoCo's only traffic across them (the outer
        step's and the step's token count), one all-reduce over dp_replicate; the call a fault-tolerant
        replica link replaces."""
        if values.numel():  # (a shard position holding none of a fragment: so in every replica group)
            comm.all_reduce(values, self.group)
        return values

    def average_over_groups(self, values: torch.Tensor) -> torch.Tensor:
        """The fp32 mean over the replica groups of `values` ([n], fp32 or bf16; summed in place)."""
        return self.sum_over_groups(values).float().div_(self.groups)  # (fp32: in place, no copy)

    def _outer_step(self, fragment: int) -> None:
        lr, mu, ranges = self.outer_lr, self.momentum, self.ranges[fragment]
        masters = self.optimizer.master_chunks()
        outer, velocity = _take(self.outer, ranges), _take(self.velocity, ranges)  # [fragment's owned numel] fp32
        if self.reduce_dtype == torch.float32:  # the parameters' mean, then Δ from it
            average = self.average_over_groups(_take(masters, ranges))
            delta = outer - average  # the pseudo-gradient
        else:  # each group's pseudo-gradient in bf16 (small values: its rounding is relative), their mean
            delta = self.average_over_groups((outer - _take(masters, ranges)).to(self.reduce_dtype))
            average = outer - delta
        velocity.mul_(mu).add_(delta)
        new = average.add_(delta, alpha=1 - lr).add_(velocity, alpha=-lr * mu)
        for chunks, values in ((masters, new), (self.outer, new), (self.velocity, velocity)):
            _put(chunks, ranges, values)
        self._publish(self.buckets[fragment])

    def _publish(self, buckets: frozenset[int]) -> None:
        """Every rank's parameters of `buckets` from the new masters (gathers in the shard group); the other
        buckets' masters did not change."""
        model, masters = self.optimizer.model, self.optimizer.master_chunks()
        model.wait_for_params()
        for bucket in model.gather_order:
            if bucket in buckets:
                model.publish(bucket, masters[bucket])
        model.wait_for_params()

    def nbytes(self) -> int:
        """Bytes of θ_outer and the momentum (every fragment's), held for the whole run."""
        return sum(t.numel() * t.element_size() for t in self.outer + self.velocity)

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


# ---------------------------------------------------------------------- fragments in the shard

def fragment_ranges(optimizer, *, num_layers: int, fragments: int
                    ) -> tuple[list[tuple[tuple[int, int, int], ...]], list[frozenset[int]]]:
    """Per fragment: the (bucket, start, end) ranges of this rank's master chunks it owns (its parameters'
    owned pieces, adjacent ones merged, padding in none), and the buckets holding any of its parameters
    (the same on every rank of a shard group: the buckets to publish after its outer step)."""
    layout, names = optimizer.model.layout, optimizer.names
    offsets = [b.shard_offset for b in layout.buckets]
    ranges: list[list[tuple[int, int, int]]] = [[] for _ in range(fragments)]
    for piece in optimizer.pieces:
        fragment = parameter_fragment(names[piece.param], num_layers=num_layers, fragments=fragments)
        bucket = bisect.bisect_right(offsets, piece.shard_start) - 1
        start, end = piece.shard_start - offsets[bucket], piece.shard_end - offsets[bucket]
        mine = ranges[fragment]
        if mine and mine[-1][0] == bucket and mine[-1][2] == start:
            mine[-1] = (bucket, mine[-1][1], end)
        else:
            mine.append((bucket, start, end))
    buckets = [set() for _ in range(fragments)]
    for bucket in layout.buckets:
        for index in bucket.params:
            buckets[parameter_fragment(names[index], num_layers=num_layers, fragments=fragments)].add(bucket.index)
    return [tuple(r) for r in ranges], [frozenset(b) for b in buckets]


def fragment_tags(named, chunks, fragments: int) -> list[int] | None:
    """The fragment of each of `named`'s (logical name, parameter), for the gradient buffers to cut buckets
    at fragment boundaries (layout.build_layout's tags): every rank then owns ~1/S of each fragment, and a
    fragment's outer step publishes its own buckets only. None at F = 1 (the buckets as without DiLoCo)."""
    if fragments == 1:
        return None
    num_layers = chunks[0].config.num_layers
    return [parameter_fragment(name, num_layers=num_layers, fragments=fragments) for name, _ in named]


def _take(chunks: list[torch.Tensor], ranges) -> torch.Tensor:
    """A new flat tensor of `chunks`' elements in `ranges` ((bucket, start, end) each), in order."""
    if not ranges:
        return chunks[0].new_empty(0) if chunks else torch.empty(0)
    return torch.cat([chunks[bucket][start:end] for bucket, start, end in ranges])


def _put(chunks: list[torch.Tensor], ranges, values: torch.Tensor) -> None:
    """Inverse of `_take`: write `values` back into `chunks`' ranges."""
    offset = 0
    for bucket, start, end in ranges:
        chunks[bucket][start:end].copy_(values[offset:offset + end - start])
        offset += end - start
