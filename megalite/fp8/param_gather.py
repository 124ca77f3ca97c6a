"""ZeRO-3's parameter all-gather with the FP8 layers' weights in FP8 (--fp8-param-gather).

A unit's flat buffer [N] (N = n chunks of c elements, rank q owning chunk q) holds weights its
layers cast to FP8 tensorwise and other parameters (norms, biases, embeddings) that stay in the
training dtype. Each rank sends one byte string per gather:

    wire [K + O * esize] uint8 = [ its FP8 elements, cast with their weight's scale (K bytes, padded)
                                 | its other elements in the training dtype (O elements, padded) ]

K, O: the most FP8 / other elements any rank's chunk holds (static, from the layout). A weight's
scale is 448 / amax of the *whole logical weight*: its chunks' amaxes are MAX-reduced over the
gather group, then over the weight's tp group (one small all-reduce each, [weights of the unit]
fp32), the same scale the layer computes, so the layer's own cast of the gathered (dequantised)
weight gives back exactly these FP8 values. The full buffer receives the dequantised weights:
the bytes on the wire shrink (about 1/2 of bf16, 1/4 of fp32), the gathered memory does not.
"""
from __future__ import annotations

import torch

from megalite.distributed import comm
from megalite.parameters import params as P
from megalite.fp8.scaling import cast, scale_of

FP8 = torch.float8_e4m3fn  # weights are forward operands: e4m3 in both formats


class Fp8UnitGather:
    """Run tables of one unit (bucket) and its FP8 gather. `params`/`slots`: the unit's parameters
    and their ParamSlots; `bucket`: its layout.Bucket; `shard_rank`: this rank's chunk.

    Each FP8 weight is one contiguous run of the unit's buffer, so chunk q's FP8 elements are a few
    runs (a weight cut by the chunk's ends), each with one scale, and its other elements the runs
    between: held as Python tuples (a handful per chunk), not as an index per element on the device,
    which cost 24 to 40 bytes per parameter of every unit (docs/fp8.md). The price: a gather copies
    run by run, a few small copies per chunk (n x runs, then one dequantisation per weight)."""

    def __init__(self, params, slots, bucket, shard_rank: int, dtype: torch.dtype, device):
        n, c = bucket.shard_count, bucket.chunk_numel
        self.n, self.c, self.shard_rank, self.dtype = n, c, shard_rank, dtype
        self.amax_groups = []  # per FP8 weight: the group its amax also spans (tp), or None
        self.weights = []  # per FP8 weight: (parameter, [start, end) in the unit's buffer)
        for p, slot in zip(params, slots):
            group = P.info(p).fp8_amax_group
            if group is not None:
                self.amax_groups.append(group[0])
                self.pow2_scales = group[1]  # the run's recipe: the same for every FP8 weight
                self.weights.append((p, slot.start - bucket.start, slot.end - bucket.start))
        spans = sorted((start, end, k) for k, (_, start, end) in enumerate(self.weights))
        # per chunk q, chunk-relative: FP8 runs (start, end, weight) and other runs (start, end), in order
        self.fp8_runs, self.other_runs = [], []
        for q in range(n):
            low, high = q * c, (q + 1) * c
            fp8, other, at = [], [], low
            for start, end, k in spans:
                start, end = max(start, low), min(end, high)
                if start < end:
                    if at < start:
                        other.append((at - low, start - low))
                    fp8.append((start - low, end - low, k))
                    at = end
            if at < high:
                other.append((at - low, high - low))
            self.fp8_runs.append(fp8)
            self.other_runs.append(other)
        self.K = max(sum(e - s for s, e, _ in runs) for runs in self.fp8_runs)
        self.O = max(sum(e - s for s, e in runs) for runs in self.other_runs)
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.wire_bytes = self.K + self.O * self.esize  # per rank
        mine = self.fp8_runs[shard_rank]
        self.mine_weight = torch.tensor([k for _, _, k in mine], dtype=torch.long, device="cpu").to(device)

    def scales(self, chunk: torch.Tensor, group) -> torch.Tensor:
        """[weights] fp32 cast-scales from this rank's chunk (training dtype, [c]): amax MAX-reduced
        over the gather `group`, then over each weight's tp group."""
        count = len(self.amax_groups)
        local = torch.zeros(count, dtype=torch.float32, device=chunk.device)
        mine = self.fp8_runs[self.shard_rank]
        if mine:  # each run's amax into its weight's slot (a weight cut by the chunk's ends: one run)
            runs = torch.stack([chunk[s:e].abs().amax() for s, e, _ in mine]).float()
            local.scatter_reduce_(0, self.mine_weight, runs, reduce="amax")
        comm.all_reduce(local, group, op="max")
        for tp_group in dict.fromkeys(g for g in self.amax_groups if comm.group_size(g) > 1):
            members = torch.tensor([k for k, g in enumerate(self.amax_groups) if g is tp_group], device=chunk.device)
            part = local[members].contiguous()
            local[members] = comm.all_reduce(part, tp_group, op="max")
        return scale_of(local, FP8, self.pow2_scales)

    def pack(self, chunk: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """This rank's wire [K + O*esize] uint8 from its chunk (training dtype, [c])."""
        wire = torch.zeros(self.wire_bytes, dtype=torch.uint8, device=chunk.device)
        at = 0
        for s, e, k in self.fp8_runs[self.shard_rank]:
            wire[at:at + e - s] = cast(chunk[s:e], scales[k], FP8).view(torch.uint8)
            at += e - s
        at = self.K
        for s, e in self.other_runs[self.shard_rank]:
            wire[at:at + (e - s) * self.esize] = chunk[s:e].contiguous().view(torch.uint8)
            at += (e - s) * self.esize
        return wire

    def unpack(self, gathered: torch.Tensor, scales: torch.Tensor, full: torch.Tensor) -> None:
        """Write the gathered wires [n * (K + O*esize)] uint8 into the unit's full buffer [N], and
        hand each FP8 weight its gathered FP8 values with their scale (`params.fp8_gathered`): its
        layer casts nothing and reduces no amax, and computes with exactly the bits the single
        process would (a re-cast of the dequantised weight can round its scale by an ulp, and one
        ulp in a GEMM's output flips later casts)."""
        rows = gathered.view(self.n, self.wire_bytes)
        other = rows[:, self.K:].contiguous().view(self.dtype)  # [n, O]
        inv = scales.reciprocal()
        full_q = torch.zeros(full.numel(), dtype=torch.uint8, device=full.device)  # [N], FP8 bits where FP8
        for q in range(self.n):
            base, at = q * self.c, 0
            for s, e, _ in self.fp8_runs[q]:
                full_q[base + s:base + e] = rows[q, at:at + e - s]
                at += e - s
            at = 0
            for s, e in self.other_runs[q]:
                full[base + s:base + e] = other[q, at:at + e - s]
                at += e - s
        for k, (p, start, end) in enumerate(self.weights):  # each weight whole now: dequantised at once
            values = full_q[start:end].view(FP8)
            full[start:end] = (values.float() * inv[k]).to(self.dtype)
            P.set_fp8_gathered(p, (values.view(p.shape), inv[k]))

    def forget(self) -> None:
        """The unit is freed: its weights' FP8 copies go with it."""
        for p, _, _ in self.weights:
            P.set_fp8_gathered(p, None)


def unit_gathers(units, layout, shard_ranks, dtype, device) -> list[Fp8UnitGather | None]:
    """One Fp8UnitGather per unit holding an FP8 weight, None for the others (gathered as before)."""
    out = []
    for unit, bucket in zip(units, layout.buckets):
        has_fp8 = any(P.info(p).fp8_amax_group is not None for p in unit.params)
        slots = [layout.slots[i] for i in bucket.params]
        out.append(Fp8UnitGather(unit.params, slots, bucket, shard_ranks[bucket.kind], dtype, device)
                   if has_fp8 else None)
    return out
