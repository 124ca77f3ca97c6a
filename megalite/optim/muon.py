"""Muon: the hidden matrices' momentum, orthogonalised whole by a Newton-Schulz iteration.

The same update as torch.optim.Muon (Keller Jordan's Muon; Moonlight's distributed version,
arXiv 2502.16982), for a matrix W [A, B] with gradient G (already unscaled and clipped):

    B  <- lerp(B, G, 1 - mu)                      the momentum buffer, [A, B] fp32
    U  <- lerp(G, B, mu)  (Nesterov)  or  B
    O  <- NS_k(U): U in bfloat16, transposed to [min, max], divided by its Frobenius norm
          (>= eps), then k times  X <- a X + (b G + c G G) X  with G = X X^T
    W  <- W (1 - lr wd) - lr r(A, B) O,   r = 0.2 sqrt(max(A, B))  (match_rms_adamw, default)
                                           or sqrt(max(1, A / B))   (original)

Which matrices: the transformer blocks' 2-D weights (`default_hidden_matrix`); the embeddings,
the output layer, the router, norms and biases stay with AdamW in the same DistributedOptimizer
(param groups). A fused weight is several matrices, orthogonalised separately as the published
recipes do: its ShardSpec's blocks (q, k and v of the fused qkv; the gate and up halves of
SwiGLU's fc1), and every expert is its own parameter already.

Sharded exactly (the blueprint's decision 15): the momentum lives in this rank's shard like
Adam's moments (it IS the optimizer's exp_avg there), U is formed on the shard elementwise and cast
to bfloat16 there (what NS does first anyway: half the bytes on the wire), the data-parallel
wrapper's WholeMatrices gathers each parameter whole to one owner rank, which runs NS on each of
its blocks, and sends every rank its slice of O back; the update is then elementwise on the shard.
Owners come from megalite.plan.muon.assign_owners over the NS FLOPs (`ShardedMuon.describe`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megalite import errors
from megalite.distributed import comm
from megalite.parameters import params as P
from megalite.config.choices import MuonAdjustLR, MuonOwners
from megalite.data_parallel.whole_matrices import MatrixOwner, WholeMatrices
from megalite.plan.muon import assign_in_two_passes, describe_owners, is_hidden_matrix, ns_flops
from megalite.parameters.sharding import ShardSpec

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (torch.optim.Muon's defaults)
NS_EPS = 1e-7
GROUP_KEYS = ("momentum", "nesterov", "ns_steps", "ns_coefficients", "ns_eps", "adjust_lr_fn", "ns_dtype")


@dataclass(frozen=True)
class MuonSettings:
    """Muon's settings (the --muon-* flags); `lr`: the Muon group's own lr (None: the optimizer's)."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    adjust_lr: MuonAdjustLR = MuonAdjustLR.MATCH_RMS_ADAMW
    ns_eps: float = NS_EPS
    owners: MuonOwners = MuonOwners.BALANCED
    lr: float | None = None
    ns_dtype: torch.dtype = torch.bfloat16
    """bfloat16 (torch's and the recipes'), or float32: slower, but a float32 rounding difference of the
    momentum then stays one (in bfloat16 it may flip an element's rounding: the layout tests use float32)."""

    def __post_init__(self):
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"Muon momentum must be in [0, 1), got {self.momentum}")
        if not 1 <= self.ns_steps < 100:
            raise ValueError(f"Muon needs 1 to 99 Newton-Schulz steps, got {self.ns_steps}")
        if len(self.ns_coefficients) != 3:
            raise ValueError(f"Muon's Newton-Schulz coefficients are three numbers a b c, got {self.ns_coefficients}")

    def group(self) -> dict:
        """The keys a Muon param group carries (beside lr and weight_decay)."""
        return {"use_muon": True, "momentum": self.momentum, "nesterov": self.nesterov, "ns_steps": self.ns_steps,
                "ns_coefficients": tuple(self.ns_coefficients), "ns_eps": self.ns_eps,
                "adjust_lr_fn": str(self.adjust_lr), "ns_dtype": self.ns_dtype}


def default_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """Muon's share: 2-D weights that are not an embedding, the output layer or a router."""
    return is_hidden_matrix(name, param.dim())


def muon_groups(groups: list[dict], names: list[str], params: list[torch.Tensor], settings: MuonSettings,
                hidden_matrix, *, from_default: bool) -> list[dict]:
    """The optimizer's param groups with Muon. From the default groups: the hidden matrices
    (`hidden_matrix(name, param)`) leave their AdamW group for a Muon group (first, with the decayed
    group's weight decay and `settings.lr` if given). Groups given by the caller: each marked
    {"use_muon": True} gets the Muon keys it lacks from `settings`. Muon groups hold 2-D tensors only."""
    if from_default:
        hidden = [p for n, p in zip(names, params) if hidden_matrix(n, p)]
        if not hidden:
            raise errors.UsageError(f"--optimizer muon: the model has no 2-D hidden matrices for Muon (its "
                                    f"{len(params)} parameters are embeddings, norms, biases or an output "
                                    f"layer); use --optimizer adamw")
        taken = {id(p) for p in hidden}
        decay = max((g["weight_decay"] for g in groups), default=0.0)
        muon = {"params": hidden, "weight_decay": decay, **settings.group()}
        if settings.lr is not None:
            muon["lr"] = settings.lr
        rest = [{**g, "params": [p for p in g["params"] if id(p) not in taken]} for g in groups]
        groups = [muon] + [g for g in rest if g["params"]]
    else:
        groups = [{**settings.group(), **g} if g.get("use_muon") else g for g in groups]
    name_of = {id(p): n for n, p in zip(names, params)}
    for group in groups:
        flat = [p for p in group["params"] if group.get("use_muon") and p.dim() != 2]
        if flat:
            raise ValueError(f"Muon updates 2-D matrices; {name_of.get(id(flat[0]), 'a parameter')} has shape "
                             f"{tuple(flat[0].shape)}: put it in an AdamW group")
    return groups


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[A, B] -> [A, B] in `dtype`, roughly U V^T of its SVD; in bfloat16 the same operations as
    torch.optim.Muon's."""
    a, b, c = coefficients
    x = update.to(dtype, copy=True)  # scaled in place below: never the caller's tensor
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T  # [min, max]: the Gram matrix is the small one
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def update_ratio(rule: str, rows: int, cols: int) -> float:
    """r(A, B): the factor on the learning rate of an [A, B] matrix (torch.optim.Muon's adjust_lr_fn)."""
    if rule == MuonAdjustLR.MATCH_RMS_ADAMW:
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def matrix_blocks(spec: ShardSpec) -> list[tuple[int, int, int]]:
    """The logical matrices of a 2-D parameter: (dim, start, size) slices of its full tensor, one per
    fused block along the tp-split dim (q, k, v; gate, up), else the whole tensor."""
    if spec.dim is not None and spec.blocks is not None:
        starts = [sum(spec.blocks[:j]) for j in range(len(spec.blocks))]
        return [(spec.dim, start, size) for start, size in zip(starts, spec.blocks)]
    return [(0, 0, spec.full_shape[0])]


def orthogonalise(full: torch.Tensor, spec: ShardSpec, group: dict) -> torch.Tensor:
    """NS of each logical matrix of a parameter's full tensor (its momentum), block by block."""
    out = torch.empty(full.shape, dtype=group["ns_dtype"], device=full.device)
    for dim, start, size in matrix_blocks(spec):
        block = full.narrow(dim, start, size).contiguous()
        out.narrow(dim, start, size).copy_(newton_schulz(block, group["ns_coefficients"], group["ns_steps"],
                                                         group["ns_eps"], group["ns_dtype"]))
    return out


def _local_runs(spec: ShardSpec, rule: str) -> list[tuple[int, int, float]]:
    """(start, end, r) over the flattened tp-local tensor: which update ratio each element takes."""
    rows, cols = spec.local_shape()
    blocks = matrix_blocks(spec)
    if len(blocks) == 1:
        return [(0, rows * cols, update_ratio(rule, *spec.full_shape))]
    full_sizes = [(size, spec.full_shape[1]) if dim == 0 else (spec.full_shape[0], size) for dim, _, size in blocks]
    local = [size // spec.tp_size for _, _, size in blocks]
    ratios = [update_ratio(rule, *shape) for shape in full_sizes]
    if blocks[0][0] == 0:  # row blocks: contiguous runs of rows
        starts = [sum(local[:j]) for j in range(len(local))]
        return [(s * cols, (s + n) * cols, r) for s, n, r in zip(starts, local, ratios)]
    return [(row * cols + sum(local[:j]), row * cols + sum(local[:j + 1]), ratios[j])  # column blocks: per row
            for row in range(rows) for j in range(len(local))]


class ShardedMuon:
    """The Muon half of a DistributedOptimizer: owners, the whole-matrix exchange and the update runs.

    `optimizer`: the DistributedOptimizer (its model, params, pieces, param_groups and group runs).
    `exchange`: a WholeMatrices-shaped object (default: the wrapper's own, `model.whole_matrices`).
    """

    def __init__(self, optimizer, *, owners: MuonOwners = MuonOwners.BALANCED, exchange=None):
        self.optimizer = optimizer
        model, params = optimizer.model, optimizer.params
        self.groups = [g for g, group in enumerate(optimizer.param_groups) if group.get("use_muon")]
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.matrices = sorted(i for i, p in enumerate(params) if group_of[id(p)] in self.groups)
        self.group_of = {i: group_of[id(params[i])] for i in self.matrices}
        self.costs = [sum(ns_flops(*_block_shape(P.shard_spec(params[i]), b),
                                   optimizer.param_groups[self.group_of[i]]["ns_steps"])
                          for b in matrix_blocks(P.shard_spec(params[i]))) for i in self.matrices]
        self.candidates = [_candidates(model, i) for i in self.matrices]
        self.sizes = [params[i].numel() for i in self.matrices]  # what a zero home receives per rank
        self.chosen = self._assign(model, owners)
        self.owners = {i: choices[c][1] for i, choices, c in zip(self.matrices, self.candidates, self.chosen)}
        self.exchange = exchange or model.whole_matrices(self.owners)
        pieces = {g: [] for g in self.groups}
        for x in optimizer.pieces:
            if x.param in self.group_of:
                pieces[self.group_of[x.param]].append(x)
        self.runs = {g: self._apply_runs(pieces[g], optimizer.param_groups[g]["adjust_lr_fn"]) for g in self.groups}
        self.update: torch.Tensor | None = None  # [shard numel]: this step's O on the Muon elements
        # NS casts its input first: cast on the shard, and send half the bytes, when every group runs in bfloat16
        self.wire_dtype = torch.bfloat16 if all(optimizer.param_groups[g]["ns_dtype"] == torch.bfloat16
                                                for g in self.groups) else torch.float32

    def _assign(self, model, policy: MuonOwners) -> list[int]:
        """Owners of the dense matrices, then of the experts starting from the dense load. In two passes
        because ranks of other ep ranks hold other experts: a joint pass would let their experts move the
        dense owners apart (every rank of the stage must agree on those)."""
        ranks = [[c for c, _, _ in choices] for choices in self.candidates]
        homes = [[h for _, _, h in choices] for choices in self.candidates]
        expert = [P.is_expert_parallel(model.params[i]) for i in self.matrices]
        return assign_in_two_passes(self.costs, ranks, expert=expert, policy=policy, sizes=self.sizes, homes=homes)

    def _apply_runs(self, pieces, rule: str) -> list[tuple[int, int, float]]:
        """(shard start, shard end, r) of this rank's pieces of a group's matrices."""
        out = []
        for x in pieces:
            for a, z, r in _local_runs(P.shard_spec(self.optimizer.params[x.param]), rule):
                lo, hi = max(a, x.local_start), min(z, x.local_end)
                if lo < hi:
                    out.append((x.shard_start + lo - x.local_start, x.shard_start + hi - x.local_start, r))
        return out

    def describe(self) -> str:
        """The owner assignment: one line per matrix, then the NS GFLOP per rank."""
        names = [self.optimizer.names[i] for i in self.matrices]
        return describe_owners(names, self.costs, [[c for c, _, _ in choices] for choices in self.candidates],
                               self.chosen)

    def prepare(self, grad: torch.Tensor, momentum: torch.Tensor) -> None:
        """Momentum and Nesterov on the shard, then every matrix orthogonalised on its owner (collective
        over the stage: every rank calls it each step). grad, momentum: fp32 [shard numel]."""
        values = torch.zeros(grad.shape, dtype=self.wire_dtype, device=grad.device)
        for g in self.groups:
            group = self.optimizer.param_groups[g]
            mu = group["momentum"]
            for a, z in self.optimizer.group_runs_of(g):
                buf = momentum[a:z]
                buf.lerp_(grad[a:z], 1 - mu)
                values[a:z] = grad[a:z].lerp(buf, mu) if group["nesterov"] else buf
        device = self.optimizer.device  # the transport's device (offloaded state lives on the host)
        params, group_of, param_groups = self.optimizer.params, self.group_of, self.optimizer.param_groups

        def orthogonalised(i: int, full: torch.Tensor) -> torch.Tensor:
            return orthogonalise(full, P.shard_spec(params[i]), param_groups[group_of[i]])

        self.update = self.exchange.apply(values.to(device), orthogonalised).to(grad.device)

    def release(self) -> None:
        """Frees this step's O once every bucket is updated (it would otherwise live through the next
        forward and backward: the planner counts it only inside the optimizer step)."""
        self.update = None

    def apply(self, master: torch.Tensor, g: int, lo: int, hi: int) -> None:
        """master[a - lo: z - lo] -= lr r O for group g's runs inside the bucket chunk [lo, hi) (weight decay
        is the caller's, before this, as in torch)."""
        lr = self.optimizer.param_groups[g]["lr"]
        for a, z, r in self.runs[g]:
            a, z = max(a, lo), min(z, hi)
            if a < z:
                master[a - lo:z - lo].add_(self.update[a:z], alpha=-lr * r)


def _block_shape(spec: ShardSpec, block: tuple[int, int, int]) -> tuple[int, int]:
    dim, _, size = block
    return (size, spec.full_shape[1]) if dim == 0 else (spec.full_shape[0], size)


def _candidates(model, index: int) -> list[tuple[tuple[int, ...], MatrixOwner, tuple[int, ...]]]:
    """Where parameter `index` may be assembled: (the global ranks that would compute it, its owner, the
    global ranks its ZeRO hop lands on: its home) per choice (plan/muon_ranks.py's `_candidates` is the
    same arithmetic over the layout, for the planner).

    Ranks are global, so a rank's load counts once whatever kind of parameter puts it there. Members of
    a shard group that leaves tp out share this rank's tp rank, and a tp group is consecutive global
    ranks (tp varies fastest, the blueprint's decision 1)."""
    group, shards = model.shard_home(index)
    tp_group = model.mesh.tp_group
    tp_rank, tp_size = comm.group_rank(tp_group), comm.group_size(tp_group)
    members = comm.group_ranks(group) if shards > 1 else [comm.global_rank()]
    spans_tp = shards > 1 and set(comm.group_ranks(tp_group)) <= set(members)
    split = P.shard_spec(model.params[index]).is_tp_sharded
    out = []
    for d, member in enumerate(members):
        tp_ranks = tuple(member - tp_rank + t for t in range(tp_size))  # the member's tp group
        if split:  # assembled on one tp rank of the member's tp group; every tp rank's member is a home
            out += [((member - tp_rank + t,), MatrixOwner(d, t), tp_ranks) for t in range(tp_size)]
        elif spans_tp or tp_size == 1:  # the shard group already holds every copy: one rank
            out.append(((member,), MatrixOwner(d, None), (member,)))
        else:  # whole on every tp rank: each tp rank's member computes its copy
            out.append((tp_ranks, MatrixOwner(d, None), tp_ranks))
    return out
