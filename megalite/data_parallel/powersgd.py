"""PowerSGD: the data-parallel gradient reduction as rank-r factors, with error feedback
(Vogels, Karimireddy, Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient Compression").

`GradBuffers` (grad_buffers.py) hands this compressor the step's accumulated fp32 main grads
once per step, in `finish_reduction()`, instead of starting its per-bucket all-reduce
(ZeRO 0) or reduce-scatter (ZeRO 1/2). That reduction is what is replaced; the ZeRO 1/2
parameter all-gather after the update is not touched.

One step, for every compressed gradient (this rank's tp shard, viewed as M [n, m]; see
megalite.plan.compression for which ones are) of replica w (a rank of the parameter's replica
group: dp x cp for the dense parameters; for the experts of an MoE model whose replicas are
apart (ep > 1, or whole experts on every tp rank at etp 1), the expert-data-parallel group,
mesh.expert_dp_group, whose members hold the same experts):

    M_w  = G_w + s * E_w              G_w: this step's gradient; E_w: w's error (residual) buffer;
                                      s: the fp16 loss scale of this step's backward (1 otherwise)
    P    = sum_w M_w Q                all-reduce #1: P [n, r] (plus every uncompressed gradient)
    P^   = orthonormal columns of P   (QR; the same on every rank: P is)
    Q_w  = M_w^T P^ ;  Q = sum_w Q_w  all-reduce #2: Q [m, r]
    M^   = P^ Q^T                     the decompressed SUM: what the optimizer gets (clip included)
    E_w <- (M_w - P^ Q_w^T) / s       = (I - P^ P^T) M_w / s: w's part of what was not sent
    Q   kept for the next step        (warm start: one power iteration per step)

The reductions are sums, not means (the loss is divided once by the global token count, so
summing gives the global gradient). Everything the algorithm computes depends on the replicas'
M_w only through their sum S = sum_w M_w: P = S Q, Q = S^T P^, M^ = P^ P^T S. The residual
is therefore exact in aggregate: sum_w E_w = (S - M^) / s, the part of (this step's summed
gradient + the summed old residual) that the step did not apply. Each rank keeps only its own
share (I - P^ P^T) M_w, which stays as small as one gradient (keeping M_w - M^/dp instead,
as torch's hook does with means, would also be exact in sum, but lets each rank's share
drift with the replicas' differences). A checkpoint may therefore redistribute the shares
freely: only their sum matters (checkpoint/compression_state.py).

Batching: per replica group, one all-reduce carries every P and every uncompressed gradient, a
second every Q, whatever the number of buckets: the dense gradients' pair over dp x cp, the
experts' pair over expert-dp (each expert's sums, residual shares and Q are its replicas'
alone; an expert-dp group of one member reduces nothing, so its experts are not compressed);
the tied embedding of a pipeline (first and last stage) has its own pair, so both stages sum
exactly the same buffers and their copies stay identical. The pairs run in one fixed order on
every rank (dense, tied, experts).
Before those, one 1-element all-reduce over the world (the group the optimizer's skip decision
spans): when any rank's gradient is not finite (an fp16 overflow), no factor is sent, the
reduced gradients are NaN (the optimizer skips the step everywhere, as it would have), and
E and Q stay exactly as they were. A step the caller skips for its own reason (a non-finite
loss) is not compressed either.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import torch

from megalite.distributed import comm
from megalite.plan.compression import compresses, effective_rank, matrix_view

# Where a reduced gradient goes: (start, end) of its flattened local tensor -> a flat destination.
Pieces = Sequence[tuple[int, int, torch.Tensor]]


@dataclass(frozen=True)
class PowerSGDConfig:
    """rank: r of the factors; warmup_steps: the first steps reduce uncompressed;
    min_compression: smallest n*m / (r(n+m)) worth compressing; seed: of the first Q."""

    rank: int = 4
    warmup_steps: int = 0
    min_compression: float = 2.0
    seed: int = 0

    def __post_init__(self):
        if self.rank < 1 or self.warmup_steps < 0 or self.min_compression < 0:
            raise ValueError(f"PowerSGD needs rank >= 1, warmup_steps >= 0 and min_compression >= 0, got {self}")


@dataclass(frozen=True)
class _Matrix:
    """One compressed gradient: parameter `index` viewed as [n, m], rank r; its slices of the
    error buffer and of Q."""

    index: int
    n: int
    m: int
    r: int
    error_offset: int
    q_offset: int


@dataclass
class _Batch:
    """Gradients reduced by one pair of all-reduces over `group`: matrices (P, then Q) and
    uncompressed ones (with P)."""

    group: object
    matrices: list[_Matrix] = field(default_factory=list)
    uncompressed: list[int] = field(default_factory=list)
    p_numel: int = 0
    q_numel: int = 0


def orthonormal(x: torch.Tensor) -> torch.Tensor:
    """[k, r] (k >= r) -> [k, r] with orthonormal columns spanning (at least) x's column space.

    Householder QR: a zero or rank-deficient x still gets orthonormal columns (no division by a
    vanishing norm, which Gram-Schmidt needs an epsilon against)."""
    return torch.linalg.qr(x).Q


def first_q(m: int, r: int, seed: int) -> torch.Tensor:
    """The random Q [m, r] a matrix starts from: seeded by (seed, m, r) only, so every replica,
    and both copies of a tied embedding, start from the same one."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"powersgd:{seed}:{m}:{r}".encode()))
    return torch.randn(m, r, generator=generator)


class PowerSGD:
    """The compressor of one GradBuffers (see the module docstring).

    Args:
        shapes: the parameters' shapes, in GradBuffers order (reverse order of use).
        groups: the replica group of each kind of parameter: (dp x cp,) or (dp x cp, expert-dp).
        skip_group: the group over which a non-finite gradient skips the step (the world).
        separate: indices reduced in their own pair of all-reduces (the tied embedding).
        kinds: each parameter's kind, an index into `groups` (default: all 0).
    A parameter whose group has one member is not reduced, so not compressed (it keeps no state).
    """

    def __init__(self, shapes: Sequence[tuple[int, ...]], config: PowerSGDConfig, groups: Sequence, skip_group,
                 device: torch.device, separate: frozenset[int] = frozenset(), kinds: Sequence[int] | None = None):
        self.config, self.groups, self.skip_group, self.device = config, tuple(groups), skip_group, device
        self.kinds = list(kinds) if kinds is not None else [0] * len(shapes)
        self.steps_done = 0  # finished reductions, compressed or not (the warm-up counts them)
        self.matrices: dict[int, _Matrix] = {}
        batches: dict[tuple[int, bool], _Batch] = {}  # (kind, separate) -> its batch
        error_numel = q_numel = 0
        for index, shape in enumerate(tuple(s) for s in shapes):
            group = self.groups[self.kinds[index]]
            batch = batches.setdefault((self.kinds[index], index in separate), _Batch(group))
            if comm.group_size(group) == 1 or not compresses(shape, config.rank, config.min_compression):
                batch.uncompressed.append(index)
                batch.p_numel += math.prod(shape)
                continue
            n, m = matrix_view(shape)
            r = effective_rank(n, m, config.rank)
            matrix = _Matrix(index, n, m, r, error_numel, q_numel)
            self.matrices[index] = matrix
            batch.matrices.append(matrix)
            batch.p_numel += n * r
            batch.q_numel += m * r
            error_numel += n * m
            q_numel += m * r
        # the same order on every rank (dense, tied, experts): collectives over different groups never cross
        self.batches = [batches[key] for key in sorted(batches)]
        self.error = torch.zeros(error_numel, dtype=torch.float32, device=device)  # E_w, unscaled
        self.q = torch.empty(q_numel, dtype=torch.float32, device=device)
        for matrix in self.matrices.values():
            self.q_of(matrix.index).copy_(first_q(matrix.m, matrix.r, config.seed))
        self.last_sent_bytes = 0

    # ------------------------------------------------------------------ state

    @property
    def active(self) -> bool:
        """Whether this step's reduction is compressed (the warm-up steps are over)."""
        return self.steps_done >= self.config.warmup_steps

    def error_of(self, index: int) -> torch.Tensor:
        """This rank's residual share E_w of compressed parameter `index`, [n, m] (unscaled)."""
        x = self.matrices[index]
        return self.error[x.error_offset:x.error_offset + x.n * x.m].view(x.n, x.m)

    def q_of(self, index: int) -> torch.Tensor:
        """The warm-start Q [m, r] of compressed parameter `index` (the same on every replica)."""
        x = self.matrices[index]
        return self.q[x.q_offset:x.q_offset + x.m * x.r].view(x.m, x.r)

    def group_of(self, index: int):
        """The replica group parameter `index`'s gradient is summed over (its E_w: w's rank there)."""
        return self.groups[self.kinds[index]]

    def state_bytes(self) -> int:
        """This rank's bytes of compressor state: its residual shares and the Q's (fp32)."""
        return (self.error.numel() + self.q.numel()) * 4

    # ------------------------------------------------------------------ one step

    @torch.no_grad()
    def reduce(self, grads: Sequence[torch.Tensor], outputs: Sequence[Pieces], grad_scale: float = 1.0) -> bool:
        """Sum `grads` (every parameter's accumulated local gradient, full local shape) over the
        replica group, compressed, into `outputs[i]`: pieces (start, end, destination) of the
        flattened reduced gradient of parameter i (its whole tensor at ZeRO 0, where the
        destination may be the gradient itself; this rank's shard pieces at ZeRO 1/2).

        Returns False when some rank's gradient was not finite: nothing was sent, every output
        is NaN, and the error buffers and Q are unchanged. The compressed gradients are left
        holding M_w (gradient + scaled residual) unless they are their own output.
        """
        self.last_sent_bytes = 0
        bad = torch.stack([torch.isfinite(g).all() for g in grads]).all().logical_not().float().reshape(1)
        if float(comm.all_reduce(bad, self.skip_group, op="max").item()) > 0:
            for pieces in outputs:
                for _, _, destination in pieces:
                    destination.fill_(float("nan"))
            return False
        for batch in self.batches:
            if not self._reduce_batch(batch, grads, outputs, grad_scale):
                for index in batch.uncompressed + [x.index for x in batch.matrices]:
                    for _, _, destination in outputs[index]:
                        destination.fill_(float("nan"))  # the optimizer skips; nothing is committed
        return True

    def _reduce_batch(self, batch: _Batch, grads, outputs, scale: float) -> bool:
        p_all = torch.empty(batch.p_numel, dtype=torch.float32, device=self.device)  # [P_1 | ... | uncompressed]
        q_all = torch.empty(batch.q_numel, dtype=torch.float32, device=self.device)  # [Q_1 | ...]
        views, offset = [], 0
        for x in batch.matrices:
            m_w = grads[x.index].view(x.n, x.m)                           # [n, m]: G_w, this rank's tp shard
            m_w.add_(self.error_of(x.index), alpha=scale)                 # M_w = G_w + s * E_w
            p = p_all[offset:offset + x.n * x.r].view(x.n, x.r)
            torch.mm(m_w, orthonormal(self.q_of(x.index)), out=p)         # [n, m] @ [m, r] -> [n, r]
            views.append((x, m_w, p))
            offset += x.n * x.r
        for index in batch.uncompressed:
            numel = grads[index].numel()
            p_all[offset:offset + numel].copy_(grads[index].reshape(-1))
            offset += numel
        comm.all_reduce(p_all, batch.group)                               # P = sum_w M_w Q (+ plain sums)
        replicated = comm.group_size(batch.group) > 1  # else nothing travels (and nothing is compressed)
        self.last_sent_bytes += p_all.numel() * 4 if replicated else 0
        q_offset, factors = 0, []
        for x, m_w, p in views:
            p_hat = orthonormal(p)                                        # [n, r]
            q = q_all[q_offset:q_offset + x.m * x.r].view(x.m, x.r)
            torch.mm(m_w.t(), p_hat, out=q)                               # Q_w = M_w^T P^ : [m, r]
            factors.append((x, m_w, p_hat, q))
            q_offset += x.m * x.r
        q_local = q_all.clone()                                           # Q_w, for this rank's residual
        if batch.matrices:
            comm.all_reduce(q_all, batch.group)                           # Q = sum_w Q_w
            self.last_sent_bytes += q_all.numel() * 4
        if not (torch.isfinite(p_all).all() and torch.isfinite(q_all).all()):
            return False  # an overflow of the sums themselves: commit nothing
        q_offset = 0
        for x, m_w, p_hat, q in factors:
            q_w = q_local[q_offset:q_offset + x.m * x.r].view(x.m, x.r)
            error = self.error_of(x.index)
            torch.addmm(m_w, p_hat, q_w.t(), alpha=-1.0, out=error)       # M_w - P^ Q_w^T
            if scale != 1.0:
                error.div_(scale)                                         # kept unscaled: s may change
            torch.div(q, scale, out=self.q_of(x.index))                  # warm start (unscaled, as E)
            _write_low_rank(p_hat, q, x.m, outputs[x.index])              # M^ = P^ Q^T, pieces only
            q_offset += x.m * x.r
        offset = sum(x.n * x.r for x in batch.matrices)
        for index in batch.uncompressed:
            summed = p_all[offset:offset + grads[index].numel()]
            for start, end, destination in outputs[index]:
                destination.copy_(summed[start:end])
            offset += grads[index].numel()
        return True

    def end_step(self) -> None:
        """A reduction finished (compressed or not, skipped or not): the warm-up counts it."""
        self.steps_done += 1


def _write_low_rank(p_hat: torch.Tensor, q: torch.Tensor, m: int, pieces: Pieces) -> None:
    """Write the flat range [start, end) of P^ Q^T ([n, r] @ [r, m]) into each destination,
    computing only the rows the range touches (a ZeRO shard decompresses its own rows)."""
    for start, end, destination in pieces:
        first_row, last_row = start // m, -(-end // m)
        rows = torch.mm(p_hat[first_row:last_row], q.t())                # [rows, m]
        destination.copy_(rows.view(-1)[start - first_row * m:end - first_row * m])
