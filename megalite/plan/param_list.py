"""Every parameter one rank of a pipeline stage holds, as the data-parallel wrapper lays it out.

The wrapper (megalite/data_parallel/grad_buffers.py) puts a rank's trainable parameters in one flat
buffer in reverse model order, cut into buckets by `layout.build_layout`, and the bucket chunks decide
which elements each ZeRO shard updates. To count a rank's own Muon and AdamW elements (plan/muon_shards.py)
the planner builds the same list: each parameter's logical name (which decides its optimizer: plan/muon.py's
`is_hidden_matrix`), its full shape and tp split (ShardSpec's fields), whether it is an expert's (sharded
over expert-dp) and whether it is tied across stages (a bucket of its own). The order is GPTModel's
`named_parameters`: a module's own parameters before its children's, children in the order they are
built (model/gpt.py, model/transformer.py, model/mla.py, model/mtp.py, moe/layer.py); chunk after chunk.
tests/plan/test_param_list.py holds it equal to real models built on the meta device.
Pure arithmetic, no torch.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megalite.config.model import GPTConfig
from megalite.pipeline.p2p import is_first_chunk, is_last_chunk
from megalite.pipeline.partition import stage_layers as partition_stage_layers
from megalite.plan.layout import chunk_placement_of
from megalite.plan.muon import is_hidden_matrix

if TYPE_CHECKING:
    from megalite.config import RunConfig


@dataclass(frozen=True)
class PlannedParam:
    """One parameter: megalite.parameters.sharding.ShardSpec's fields, plus its kind."""

    name: str
    full_shape: tuple[int, ...]
    dim: int | None = None
    """The dimension split over `ranks` tp ranks (declared at every tp, as the spec's); None: whole."""
    ranks: int = 1
    blocks: tuple[int, ...] | None = None
    """Fused blocks along `dim`, each split over tp alone (q, k, v; gate, up)."""
    padded: int | None = None
    expert: bool = False
    tied: bool = False
    """Tied across pipeline stages (the embedding's two copies): a bucket of its own at pp > 1."""
    numel: int = field(init=False)
    """Elements one rank holds (its tp shard)."""
    hidden: bool = field(init=False)
    """Muon's by default (plan/muon.py's `is_hidden_matrix`), else AdamW's."""

    def __post_init__(self):  # derived once: the planner reads them for every rank of every layout it tries
        object.__setattr__(self, "numel", math.prod(self.local_shape))
        object.__setattr__(self, "hidden", is_hidden_matrix(self.name, len(self.full_shape)))

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = sum(b // self.ranks for b in self.blocks or (self.padded or self.full_shape[self.dim],))
        return tuple(shape)


    @property
    def split(self) -> bool:
        """Split over tp (ShardSpec.is_tp_sharded)."""
        return self.dim is not None and self.ranks > 1

    def matrices(self) -> tuple[tuple[int, int], ...]:
        """[rows, cols] of each logical matrix of a 2-D parameter (optim/muon.py's `matrix_blocks`)."""
        rows, cols = self.full_shape
        if self.dim is not None and self.blocks is not None:
            return tuple((b, cols) if self.dim == 0 else (rows, b) for b in self.blocks)
        return ((rows, cols),)


@dataclass(frozen=True)
class Degrees:
    """The parallel degrees a stage's parameters depend on."""

    tp: int
    etp: int
    ep: int
    pp: int

    @classmethod
    def of(cls, cfg: RunConfig) -> Degrees:
        return cls(cfg.parallel.tp, cfg.etp_size, cfg.parallel.ep, cfg.parallel.pp)


def _column(name: str, rows: int, cols: int, tp: int, *, bias: bool, blocks: tuple[int, ...] | None = None,
            expert: bool = False) -> list[PlannedParam]:
    """ColumnParallelLinear: weight [rows, cols] split by rows (blocks default: one), bias [rows]."""
    blocks = blocks or (rows,)
    out = [PlannedParam(f"{name}.weight", (rows, cols), 0, tp, blocks, expert=expert)]
    return out + ([PlannedParam(f"{name}.bias", (rows,), 0, tp, blocks)] if bias else [])


def _row(name: str, rows: int, cols: int, tp: int, *, bias: bool) -> list[PlannedParam]:
    """RowParallelLinear: weight [rows, cols] split by columns, bias [rows] whole."""
    return [PlannedParam(f"{name}.weight", (rows, cols), 1, tp)] + ([PlannedParam(f"{name}.bias", (rows,))] if bias else [])


def _norm(name: str, model: GPTConfig, width: int | None = None) -> list[PlannedParam]:
    """Norm (LayerNorm's weight and bias for gpt2, RMSNorm's weight), or a latent/head norm's weight (width)."""
    h = width or model.hidden_size
    bias = width is None and model.flavour == "gpt2"
    return [PlannedParam(f"{name}.weight", (h,))] + ([PlannedParam(f"{name}.bias", (h,))] if bias else [])


def _mlp(name: str, model: GPTConfig, ffn: int, tp: int, *, bias: bool) -> list[PlannedParam]:
    gated, h = model.flavour != "gpt2", model.hidden_size
    return (_column(f"{name}.fc1", 2 * ffn if gated else ffn, h, tp, bias=bias, blocks=(ffn, ffn) if gated else None)
            + _row(f"{name}.fc2", h, ffn, tp, bias=bias))


def _attention(name: str, model: GPTConfig, tp: int) -> list[PlannedParam]:
    h, d, nq, nkv = model.hidden_size, model.head_dim, model.num_attention_heads, model.num_query_groups
    mla = model.mla
    if mla is None:
        out = _column(f"{name}.qkv", (nq + 2 * nkv) * d, h, tp, bias=model.qkv_bias, blocks=(nq * d, nkv * d, nkv * d))
        out += _row(f"{name}.proj", h, nq * d, tp, bias=model.proj_bias)
        return out + (_norm(f"{name}.q_norm", model, d) + _norm(f"{name}.k_norm", model, d) if model.qk_layernorm else [])
    # own parameters (the replicated down-projections) first, then the modules in the order built
    out = [PlannedParam(f"{name}.q_down", (mla.q_lora_rank, h))] if mla.q_lora_rank is not None else []
    out.append(PlannedParam(f"{name}.kv_down", (mla.kv_lora_rank + mla.qk_pos_emb_head_dim, h)))
    if mla.q_lora_rank is not None:
        out += _norm(f"{name}.q_norm", model, mla.q_lora_rank)
    out += _column(f"{name}.q_up", nq * mla.qk_dim, mla.q_lora_rank or h, tp, bias=False)
    out += _norm(f"{name}.kv_norm", model, mla.kv_lora_rank)
    out += _column(f"{name}.kv_up", nq * (mla.qk_head_dim + mla.v_head_dim), mla.kv_lora_rank, tp, bias=False)
    return out + _row(f"{name}.proj", h, nq * mla.v_head_dim, tp, bias=False)


def _moe(name: str, model: GPTConfig, sizes: Degrees) -> list[PlannedParam]:
    """MoELayer: its shared expert's gate (its own parameter), the router, the local experts (global ids,
    split over etp), the shared expert."""
    moe, h, ep = model.moe, model.hidden_size, sizes.ep
    out = [PlannedParam(f"{name}.shared_expert_gate", (1, h))] if moe.shared_expert_gate else []
    out.append(PlannedParam(f"{name}.router.weight", (moe.num_experts, h)))
    ffn, gated, etp = moe.expert_ffn(model.ffn_hidden_size), model.flavour != "gpt2", sizes.etp
    local = moe.num_experts // ep
    for e in range(local):  # the experts of ep rank 0: every ep rank's have the same shapes
        out += [PlannedParam(f"{name}.experts.{e}.fc1_weight", (2 * ffn if gated else ffn, h), 0, etp,
                             (ffn, ffn) if gated else None, expert=True),
                PlannedParam(f"{name}.experts.{e}.fc2_weight", (h, ffn), 1, etp, expert=True)]
    if moe.shared_expert_intermediate_size:
        out += _mlp(f"{name}.shared_expert", model, moe.shared_expert_intermediate_size, sizes.tp, bias=False)
    return out


def _block(name: str, model: GPTConfig, sizes: Degrees, layer_id: int) -> list[PlannedParam]:
    tp = sizes.tp
    out = _norm(f"{name}.input_norm", model) + _attention(f"{name}.attention", model, tp)
    out += _norm(f"{name}.post_attention_norm", model)
    if model.is_moe_block(layer_id):
        return out + _moe(f"{name}.mlp", model, sizes)
    return out + _mlp(f"{name}.mlp", model, model.ffn_hidden_size, tp, bias=model.mlp_bias)


def _tables(model: GPTConfig, sizes: Degrees, *, pre: bool, post: bool) -> tuple[list, list, list]:
    """(GPT-2's position table, the output layer, the word table) a chunk holds, each a list of 0 or 1."""
    h, tp, pp = model.hidden_size, sizes.tp, sizes.pp
    holds_words = pre or (post and model.mtp_num_layers > 0)  # MTP's copy of the embedding on the last stage
    vocab = PlannedParam("word_embeddings.weight", (model.vocab_size, h), 0, tp, padded=model.padded_vocab_size(tp),
                         tied=(model.tie_embeddings or model.mtp_num_layers > 0) and pp > 1)
    positions = [PlannedParam("position_embeddings", (model.seq_length, h))] if model.flavour == "gpt2" and pre else []
    output = []
    if post and not (model.tie_embeddings and holds_words):
        name = "word_embeddings.weight" if model.tie_embeddings else "output_weight"
        output.append(PlannedParam(name, vocab.full_shape, 0, tp, padded=vocab.padded,
                                   tied=model.tie_embeddings and pp > 1))
    return positions, output, [vocab] if holds_words else []


def _depth(model: GPTConfig, sizes: Degrees, k: int) -> list[PlannedParam]:
    """MTP depth k's parameters in model order."""
    name, h = f"mtp.depths.{k}", model.hidden_size
    out = _norm(f"{name}.enorm", model) + _norm(f"{name}.hnorm", model)
    out += _column(f"{name}.eh_proj", h, 2 * h, sizes.tp, bias=False)
    return out + _block(f"{name}.block", model, sizes, model.num_layers + k) + _norm(f"{name}.final_norm", model)


def chunk_params(model: GPTConfig, sizes: Degrees, layer_ids: range | list[int], *, pre: bool,
                 post: bool) -> list[PlannedParam]:
    """One model chunk's parameters in `GPTModel.logical_parameters` order (pre: it embeds the input ids;
    post: it holds the head)."""
    positions, output, words = _tables(model, sizes, pre=pre, post=post)
    out = positions + output + words  # own parameters first: the output layer
    for layer_id in layer_ids:
        out += _block(f"layers.{layer_id}", model, sizes, layer_id)
    if post:
        for k in range(model.mtp_num_layers):
            out += _depth(model, sizes, k)
        out += _norm("final_norm", model)
    return out


def chunk_units(model: GPTConfig, sizes: Degrees, layer_ids: range | list[int], *, pre: bool,
                post: bool) -> list[tuple[list[PlannedParam], int]]:
    """ZeRO-3's units of one chunk as `GPTModel.zero3_units` lists them, (parameters, kind: 1 the experts):
    the embedding, each block (an MoE block's experts after it), the final norm with the output layer,
    each MTP depth (its experts after it)."""
    positions, output, words = _tables(model, sizes, pre=pre, post=post)
    out = [(words + positions, 0)] if words else []

    def split(params: list[PlannedParam]) -> list[tuple[list[PlannedParam], int]]:
        experts = [p for p in params if p.expert]
        return [([p for p in params if not p.expert], 0)] + ([(experts, 1)] if experts else [])

    for layer_id in layer_ids:
        out += split(_block(f"layers.{layer_id}", model, sizes, layer_id))
    if post:
        out.append((_norm("final_norm", model) + output, 0))
        for k in range(model.mtp_num_layers):
            out += split(_depth(model, sizes, k))
    return out


def stage_param_list(model: GPTConfig, cfg: RunConfig, stage: int) -> tuple[PlannedParam, ...]:
    """The parameters of a rank of `stage` in the wrapper's buffer order: every chunk's in model order,
    reversed (backward fills the buffer from its start)."""
    p = cfg.parallel
    return _stage_param_list(_ByValue(repr(model), model), Degrees.of(cfg), p.virtual_stages,
                             p.decoder_first_stage_layers, p.decoder_last_stage_layers, p.pipeline_layout,
                             chunk_placement_of(cfg), stage)


@dataclass(frozen=True)
class _ByValue:
    """A GPTConfig (a mutable dataclass, unhashable) as a cache key: compared and hashed by its repr."""

    text: str
    model: GPTConfig = field(compare=False, hash=False)


@functools.lru_cache(maxsize=256)
def _stage_param_list(key: _ByValue, sizes: Degrees, v: int, first: int | None, last: int | None,
                      layout: str | None, placement, stage: int) -> tuple[PlannedParam, ...]:
    """`stage_param_list`, remembered: --suggest asks for every stage of many layouts, most of them alike."""
    model, pp = key.model, sizes.pp
    ranges = [range(model.num_layers)] if pp == 1 else partition_stage_layers(model.num_layers, pp, v, stage, first,
                                                                                last, layout, placement=placement)
    out = []
    for c, layer_ids in enumerate(ranges):
        out += chunk_params(model, sizes, layer_ids, pre=is_first_chunk(pp, stage, c),
                            post=is_last_chunk(pp, len(ranges), stage, c, placement))
    return tuple(out[::-1])


def stage_unit_params(model: GPTConfig, cfg: RunConfig, stage: int) -> list[tuple[list[PlannedParam], int]]:
    """ZeRO-3's units of a rank of `stage` in the wrapper's order (data_parallel/units.py: every chunk's in
    forward order; at pp > 1 a parameter tied across stages leaves its unit for one of its own, after it)."""
    p = cfg.parallel
    ranges = [range(model.num_layers)] if p.pp == 1 else partition_stage_layers(
        model.num_layers, p.pp, p.virtual_stages, stage, p.decoder_first_stage_layers, p.decoder_last_stage_layers,
        p.pipeline_layout, placement=chunk_placement_of(cfg))
    units = []
    for c, layer_ids in enumerate(ranges):
        units += chunk_units(model, Degrees.of(cfg), layer_ids, pre=is_first_chunk(p.pp, stage, c),
                             post=is_last_chunk(p.pp, len(ranges), stage, c, chunk_placement_of(cfg)))
    if p.pp == 1:
        return units
    out = []
    for params, kind in units:
        tied = [q for q in params if q.tied]
        if not tied or len(params) == 1:
            out.append((params, kind))
            continue
        out += [([q for q in params if not q.tied], kind)] + [([q], 0) for q in tied]
    return out


def wrapper_order(model: GPTConfig, cfg: RunConfig, stage: int) -> tuple[PlannedParam, ...]:
    """The stage's parameters in the order the wrapper (and so the optimizer, whose owner assignment breaks
    ties by it) holds them: the buffer's at ZeRO 0-2, the units' one after another at ZeRO 3."""
    if cfg.parallel.zero == 3:
        return tuple(p for params, _ in stage_unit_params(model, cfg, stage) for p in params)
    return stage_param_list(model, cfg, stage)
