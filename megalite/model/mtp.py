"""Multi-token prediction (DeepSeek-V3 report, section 2.2): D sequential modules after the last block.

Depth k (1..D) combines the previous depth's hidden state h^{k-1}_i (h^0: the last block's output,
before the final norm) with the embedding of token t_{i+k}, and predicts t_{i+k+1}:

    h'_i = M_k [RMSNorm_e(Emb(t_{i+k})); RMSNorm_h(h^{k-1}_i)]       M_k [h, 2h]
    h^k  = Block_k(h')                                                a transformer block of its own
    P^k  = softmax(OutHead(RMSNorm_k(h^k)))                           the model's embedding and head, shared
    L^k  = -(1/T) sum_i log P^k_i[t_{i+k+1}],  loss += (lambda / D) sum_k L^k

The report runs depth k on the T-k positions that have both tokens; megalite keeps the whole sequence
(the ids and the labels rolled k to the left, the last k labels masked): causal attention makes the
first T-k positions the report's, and every layout keeps its shapes. T is the step's target-token
count, the main loss's normaliser (decision 4).

The MTP terms join the loss's gradient without changing its value (Megatron's MTPLossAutoScaler):
the forward returns main + (mtp - mtp.detach()), so the step's reported loss stays the language
model's and each depth's loss is reported on its own (`MultiTokenPrediction.step_sums`).
Built on the last pipeline stage, which at pp > 1 holds its own copy of the word embedding, tied to
stage 0's (GPTModel.mtp_on_last_stage). Under cp the rolled ids and labels come from the whole sequences
(`mtp_losses`).
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.context_parallel.document_split import SplitDocumentMask, gather_tokens, local_tokens
from megalite.context_parallel.zigzag import gather_sequence, split_sequence
from megalite.data_parallel.units import Unit
from megalite.distributed import comm
from megalite.config.model import GPTConfig
from megalite.distributed.layer_groups import LayerGroups
from megalite.model.documents import local_positions
from megalite.model.transformer import Norm, TransformerBlock
from megalite.tensor_parallel import mappings
from megalite.tensor_parallel.layers import ColumnParallelLinear
from megalite.tensor_parallel.mlp import normal_init


class MTPDepth(nn.Module):
    """One depth: enorm, hnorm [h], eh_proj M_k [h, 2h] (column-parallel, its output gathered), block, norm [h]."""

    def __init__(self, config: GPTConfig, groups: LayerGroups, *, sequence_parallel: bool, layer_number: int,
                 moe_dispatcher: str, dtype=None, device=None):
        super().__init__()
        h = config.hidden_size
        self.tp_group, self.sequence_parallel = groups.tp, sequence_parallel
        self.enorm = Norm(config, sequence_parallel, dtype, device)
        self.hnorm = Norm(config, sequence_parallel, dtype, device)
        self.eh_proj = ColumnParallelLinear(2 * h, h, bias=False, tp_group=groups.tp,
                                            sequence_parallel=sequence_parallel,
                                            init_method=normal_init(config.init_std), dtype=dtype, device=device)
        self.block = TransformerBlock(config, groups, sequence_parallel=sequence_parallel, layer_number=layer_number,
                                      moe_dispatcher=moe_dispatcher, dtype=dtype, device=device)
        self.final_norm = Norm(config, sequence_parallel, dtype, device)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope, rng, documents=None) -> torch.Tensor:
        """hidden, embedded [s', b, h] (s' = s/tp under SP) -> this depth's hidden state, the same shape;
        documents: the model's blocks' attention mask (packed documents), None for plain causal attention."""
        combined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)  # [s', b, 2h]
        x = self.eh_proj(combined)  # [s, b, h/tp]
        x = mappings.gather_from_tensor_parallel_region(x, self.tp_group)  # [s, b, h], every rank alike
        if self.sequence_parallel:
            x = mappings.scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/tp, b, h]
        return self.block(x, rope, rng, documents)


def rolled(t: torch.Tensor, k: int, fill: int | None = None) -> torch.Tensor:
    """[b, s] -> [b, s] shifted k to the left: position i holds t[:, i + k]; the last k positions wrap
    around, or hold `fill` when given (labels: -100, no target there)."""
    out = torch.roll(t, -k, dims=1)
    if fill is not None and k > 0:
        out[:, -k:] = fill
    return out


class MultiTokenPrediction(nn.Module):
    """The D depths of a model (GPTModel.mtp). `depth_losses(...)` runs them; `step_sums` holds each depth's
    summed cross entropy over this step's forwards (device tensors, read once per step)."""

    def __init__(self, depths: list[MTPDepth], scaling_factor: float):
        super().__init__()
        self.depths = nn.ModuleList(depths)
        self.scaling_factor = scaling_factor
        self.step_sums: list[torch.Tensor | float] = [0.0] * len(depths)

    def loss_term(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """lambda / D * sum_k L^k (each L^k a sum over this rank's targets)."""
        return sum(losses) * (self.scaling_factor / len(self.depths))

    @torch.no_grad()
    def record(self, losses: list[torch.Tensor]) -> None:
        self.step_sums = [total + loss.detach().double() for total, loss in zip(self.step_sums, losses)]

    def take_step_sums(self) -> list[float]:
        """Each depth's summed loss since the last call (host floats: once per step), then reset."""
        sums = [float(t) for t in self.step_sums]
        self.step_sums = [0.0] * len(self.depths)
        return sums


def mtp_losses(model, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, rope, *,
               position_ids: torch.Tensor | None = None, documents=None) -> list:
    """Each depth's summed cross entropy over this rank's targets: hidden [s', b, h] the last block's output,
    input_ids and labels [b, s]. `model`: the GPTModel (its embedding, head and cross entropy).

    Packed documents (position_ids [b, s] restarting at 0, `documents` the blocks' mask, a window's too):
    the depths attend within documents (and the window) as the blocks do, and depth k's target at position i
    is kept only where token i+k is in i's document (its position is i's plus k): Emb(t_{i+k}) never comes
    from the next document. The target itself, t_{i+k+1}, follows the main loss's labels (eod_mask_loss
    masks the same ones).

    Context parallelism: this rank holds its zigzag chunks of the ids and labels (or, under the per-document
    split, its tokens of every document in the split's order: `documents` is then a SplitDocumentMask), so
    the tokens k ahead of its positions live on other ranks; the whole sequences are gathered once ([b, s]
    integers over the cp group), rolled, and this rank's tokens cut again by the same split. The position ids
    are the whole sequence's already (GPTModel.forward), so the document test runs on the whole sequence
    before the cut."""
    cp, cp_rank = model.cp_size, model.cp_rank
    order = documents.order if isinstance(documents, SplitDocumentMask) else None  # None: the zigzag split
    whole_ids, whole_labels = (_whole_sequence(t, model.groups.cp, cp, order) for t in (input_ids, labels))
    my_positions = local_positions(position_ids, cp_rank, cp, documents=documents)  # whole [b, s] -> mine
    losses = []
    for k, depth in enumerate(model.mtp.depths, start=1):
        ids_ahead = _my_chunks(rolled(whole_ids, k), cp_rank, cp, order)  # t_{i+k} [b, s/cp]
        embedded = model.embed(ids_ahead, my_positions)  # Emb(t_{i+k}) [s', b, h], at token i's position
        hidden = depth(hidden, embedded, rope, model.rng, documents)
        targets = rolled(whole_labels, k, fill=-100)  # [b, s]: labels[:, i + k] = t_{i+k+1}
        if position_ids is not None:  # on the whole sequence: token i+k may lie in another rank's chunk
            targets = targets.masked_fill(rolled(position_ids, k) != position_ids + k, -100)
        losses.append(model.head_losses(depth.final_norm(hidden), _my_chunks(targets, cp_rank, cp, order)).sum())
    return losses


def _whole_sequence(chunks: torch.Tensor, cp_group, cp: int, order: torch.Tensor | None) -> torch.Tensor:
    """[b, s/cp] this cp rank's tokens -> [b, s] the whole sequences (the tensor itself at cp 1): its zigzag
    chunks, or with the per-document split's order [b, s] its tokens of every document."""
    if cp == 1:
        return chunks
    shards = list(comm.all_gather(chunks, cp_group, dim=1).chunk(cp, dim=1))  # by cp rank
    return gather_sequence(shards, dim=1) if order is None else gather_tokens(shards, order)


def _my_chunks(whole: torch.Tensor, cp_rank: int, cp: int, order: torch.Tensor | None) -> torch.Tensor:
    """The inverse of _whole_sequence: [b, s] -> this rank's [b, s/cp] under the same split."""
    if cp == 1:
        return whole
    return split_sequence(whole, cp_rank, cp, dim=1) if order is None else local_tokens(whole, order,
                                                                                          cp_rank=cp_rank, cp=cp)


def mtp_units(mtp: MultiTokenPrediction, build) -> list[Unit]:
    """ZeRO-3's units of the depths: each depth, and an MoE depth's experts (a unit of their own over the
    expert-data-parallel group). build(k) -> depth k rebuilt from its seeded stream (a meta-built model
    materialises one unit at a time).

    The depths branch off the last block's output beside the head, so they are not links of ZeRO-3's
    chain of entries (each entry's backward starts when the next one's input gradient is complete: the
    head's would wait for the depths'). Their units are therefore started by a read (no module), which
    makes the head's entry, running when they are first read, borrow them: gathered again at the start
    of the backward with the head and reduced at its end (data_parallel/zero3.py)."""
    units = []
    for k, depth in enumerate(mtp.depths, start=1):
        experts = depth.block.mlp.experts if depth.block.is_moe else None
        expert_ids = {id(p) for p in experts.parameters()} if experts is not None else set()
        units.append(Unit(f"mtp.depths.{k - 1}", [p for p in depth.parameters() if id(p) not in expert_ids], (),
                          lambda k=k: _depth_tensors(build(k), experts=False)))
        if experts is not None:
            units.append(Unit(f"mtp.depths.{k - 1}.experts", list(experts.parameters()), (),
                              lambda k=k: _depth_tensors(build(k), experts=True), kind=1))
    return units


def _depth_tensors(depth: MTPDepth, *, experts: bool) -> list[torch.Tensor]:
    expert_ids = {id(p) for p in depth.block.mlp.experts.parameters()} if depth.block.is_moe else set()
    return [p.detach() for p in depth.parameters() if (id(p) in expert_ids) == experts]


def mtp_stats(chunks, token_count: float, mesh) -> dict[str, float]:
    """{"mtp_loss_k": depth k's mean loss over the step's targets, every dp rank's} for the metrics; {} without
    MTP. The sums live on the tp rank 0 of the stage holding MTP (one scalar all-reduce each)."""
    holders = [c.mtp for c in chunks if getattr(c, "mtp", None) is not None]
    depths = getattr(chunks[0].config, "mtp_num_layers", 0)  # a user's own model (ProvidedModelConfig) has none
    if depths == 0:
        return {}
    sums = holders[0].take_step_sums() if holders and comm.group_rank(mesh.tp_group) == 0 else [0.0] * depths
    total = torch.tensor(sums, dtype=torch.float64, device=mesh.device)
    comm.all_reduce(total, comm.world_group())
    return {f"mtp_loss_{k + 1}": float(v) / max(token_count, 1.0) for k, v in enumerate(total.tolist())}
