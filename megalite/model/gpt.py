"""GPTModel: embedding -> transformer blocks -> final norm -> vocab-parallel head -> loss.

Stage-aware: a pipeline stage builds only its layers (`layer_ids`), the embedding when it is
the first stage (`pre_process`) and the head when it is the last (`post_process`).

Every component's master weights are drawn from its own seeded stream (the model seed and
the component's global index), so the model is the same tensor for tensor whatever the
(tp, pp) layout: a stage that builds layers 8..15 gets exactly layers 8..15 of the pp=1 model.

forward(x, labels=None, reduction="mean"):
- x: input ids [b, s] on the first stage; else the hidden state [s, b, h] ([s/tp, b, h] with
  sequence parallelism) received from the previous stage.
- not the last stage: returns the hidden state for the next stage.
- last stage without labels: this rank's logits shard [b, s, V_pad/tp].
- last stage with labels [b, s] (labels[:, i] is the target of x[:, i]; -100 ignored): the loss,
  the mean over target tokens (equal on every tp rank) or, with reduction="sum", the sum.
- position_ids [b, s] int64 (optional, every stage): packed documents, positions restarting at 0
  at each document's first token. The document mask is built from them once per forward and
  handed to every block (no token attends to another document); RoPE and the learned position
  table read them. Without them: one causal sequence, positions 0..s-1 (docs/documents.md).
  Under context parallelism they are the whole sequence's [b, s * cp] (not split).

Context parallelism (the mesh's cp group, cp > 1): each cp rank is handed its zigzag chunks
of the ids and labels (`context_parallel.split_sequence`, [b, s] -> [b, s/cp]), or with
cp_split="documents" and position ids its chunks of every document (`document_split.local_tokens`
by `split_order(position_ids, cp)`), and s above is s/cp. Positions (learned table or RoPE) are
the tokens' global ones; attention is ring
(cp_comm_type "p2p") or Ulysses ("a2a") over the cp group. reduction="sum" is this rank's
tokens' sum: the caller divides the sum over cp ranks by their total target tokens (a local
"mean" would weigh ranks wrongly and is refused).
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from megalite.config.choices import Recompute
from megalite.distributed import comm
from megalite.parameters import params
from megalite.context_parallel.zigzag import logical_row_offsets, position_ids
from megalite.data_parallel.units import Unit
from megalite.distributed.layer_groups import LayerGroups
from megalite.distributed.mesh import Mesh, current_mesh
from megalite.config.model import GPTConfig
from megalite.model.documents import check_cp_split, check_position_ids, document_mask, local_positions
from megalite.model.recompute import checkpoint_with_rng
from megalite.model.mtp import MTPDepth, MultiTokenPrediction, mtp_losses, mtp_units
from megalite.model.rope import rope_tables
from megalite.model.transformer import Norm, TransformerBlock
from megalite.tensor_parallel import mappings
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.fused_cross_entropy import vocab_parallel_linear_cross_entropy
from megalite.tensor_parallel.layers import VocabParallelEmbedding, linear, sequence_parallel_linear
from megalite.tensor_parallel.mlp import normal_init
from megalite.tensor_parallel.random import TensorParallelRNG, dropout, dropout_site
from megalite.parameters.sharding import ShardSpec

# Seed-stream offsets of the components (layer i uses _LAYER_STREAM + i).
_WORD_EMBEDDING_STREAM, _POSITION_STREAM, _OUTPUT_STREAM, _LAYER_STREAM = 0, 1, 2, 1000


@contextlib.contextmanager
def seeded(seed: int, stream: int):
    """Run a block with the global RNG seeded for (seed, stream); restore the RNG afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + stream)
        yield


class GPTModel(nn.Module):
    def __init__(self, config: GPTConfig, mesh: Mesh | None = None, *, layer_ids: range | None = None,
                 pre_process: bool = True, post_process: bool = True, sequence_parallel: bool = False,
                 recompute: str = "none", seed: int = 1234, dtype: torch.dtype | None = None, device=None,
                 fused_linear_cross_entropy: bool = False, recompute_num_layers: int | None = None,
                 cp_comm_type: str = "p2p", moe_dispatcher: str = "alltoall", cp_split: str = "zigzag"):
        super().__init__()
        mesh = mesh or current_mesh()
        self.groups = LayerGroups.of(mesh)  # what the blocks talk over (their MoE layers: ep, moe_tokens too)
        self._moe_dispatcher = moe_dispatcher
        self.cp_split = cp_split  # which tokens each cp rank holds of packed documents (document_split.py)
        # cp: this rank holds s/cp tokens of each sequence
        self.cp_size, self.cp_rank = comm.group_size(self.groups.cp), comm.group_rank(self.groups.cp)
        check_cp_split(config, cp_split, self.cp_size)
        tp_size = comm.group_size(self.groups.tp)
        tp_rank = comm.group_rank(self.groups.tp)
        pp_size = mesh.pp_size if mesh is not None else 1
        device = device if device is not None else (mesh.device if mesh is not None else None)
        # device="meta": parameters without memory (ZeRO-3 materialises them one unit at a time,
        # `zero3_units`); the RNG streams and RoPE tables live on the mesh's device.
        on_meta = device is not None and torch.device(device).type == "meta"
        self._real_device = (mesh.device if mesh is not None else None) if on_meta else device
        config.check_tensor_parallel(tp_size)
        if recompute not in tuple(Recompute):
            raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
        if sequence_parallel and config.seq_length % tp_size != 0:
            raise ValueError(f"sequence parallelism needs seq_length={config.seq_length} divisible by tp={tp_size}")
        self.config, self.sequence_parallel, self.recompute = config, sequence_parallel, recompute
        self.fused_linear_cross_entropy = fused_linear_cross_entropy  # loss without holding the logits
        if recompute_num_layers is not None and (recompute != Recompute.FULL or recompute_num_layers < 1):
            raise ValueError(f"recompute_num_layers={recompute_num_layers} needs recompute='full' and a value >= 1")
        self.recompute_num_layers = recompute_num_layers  # full recompute of this chunk's first N blocks only
        self.pre_process, self.post_process = pre_process, post_process
        # DeepSeek's MTP on a last stage that is not the first: it embeds the tokens ahead itself, so the
        # stage keeps a copy of the word embedding (tied to stage 0's) and reads the microbatch's ids
        self.mtp_on_last_stage = post_process and not pre_process and config.mtp_num_layers > 0
        self.holds_word_embeddings = pre_process or self.mtp_on_last_stage
        self.layer_ids = layer_ids if layer_ids is not None else range(config.num_layers)
        self.padded_vocab_size = config.padded_vocab_size(tp_size)
        self.rng = TensorParallelRNG(seed)  # the same on every rank: masks are layout-free
        self._seed, self._dtype, self._cp_comm_type, self._tp = seed, dtype, cp_comm_type, (tp_rank, tp_size)

        self._build_parameters(device, on_meta, pp_size)
        if config.flavour == "llama":
            cos, sin = rope_tables(config.seq_length, config.rope_head_dim, config.rope_theta, self._real_device,
                                    config.rope_scaling)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    # --- construction: each component from its own seeded stream -------------------------------

    def _build_parameters(self, device, on_meta: bool, pp_size: int) -> None:
        """Embeddings, blocks, final norm and head of this chunk, each from its own seeded stream
        (on the meta device: shapes only; ZeRO-3 materialises them unit by unit)."""
        with torch.device("meta") if on_meta else contextlib.nullcontext():  # meta: no init work either
            if self.holds_word_embeddings:  # the first stage's, or MTP's copy for Emb(t_{i+k}) on the last
                self.word_embeddings = self._build_word_embeddings(device)
                if self.config.flavour == "gpt2" and self.pre_process:
                    # Under SP each rank adds only its sequence slice of the table: partial gradients.
                    self.position_embeddings = params.declare(nn.Parameter(self._build_position_table(device)),
                                                              sequence_parallel_grad=self.sequence_parallel)
            self.layers = nn.ModuleList()
            for i in self.layer_ids:
                block = self._build_block(i, device)
                block.recompute_core = self.recompute == Recompute.SELECTIVE
                self.layers.append(block)
            self.mtp = self._build_mtp(device) if self.post_process and self.config.mtp_num_layers else None
            if self.post_process:
                self.final_norm = Norm(self.config, self.sequence_parallel, self._dtype, device)
                if self.config.tie_embeddings and self.holds_word_embeddings:
                    self.output_weight = None  # the head reads word_embeddings.weight
                else:
                    weight, spec = self._build_output_weight(device)
                    self.output_weight = params.declare(nn.Parameter(weight), shard_spec=spec)
        if (self.config.tie_embeddings or self.config.mtp_num_layers) and pp_size > 1:
            # The first stage's embedding and the last stage's copy (the tied head, or MTP's embedding,
            # which a tied head then reads too) are one logical tensor: their gradients are summed over
            # the embedding group, and counted once in norms.
            if self.holds_word_embeddings:
                params.declare(self.word_embeddings.weight, tied_across_stages=True)
            if self.post_process and self.output_weight is not None and self.config.tie_embeddings:
                params.declare(self.output_weight, tied_across_stages=True)

    def _build_word_embeddings(self, device) -> VocabParallelEmbedding:
        with seeded(self._seed, _WORD_EMBEDDING_STREAM):
            return VocabParallelEmbedding(self.config.vocab_size, self.config.hidden_size, self.groups.tp,
                                          padded_num_embeddings=self.padded_vocab_size,
                                          init_method=normal_init(self.config.init_std), dtype=self._dtype,
                                          device=device)

    def _build_position_table(self, device) -> torch.Tensor:
        with seeded(self._seed, _POSITION_STREAM):
            table = torch.empty(self.config.seq_length, self.config.hidden_size)
            normal_init(self.config.init_std)(table)
        return table.to(device=device, dtype=self._dtype or table.dtype)

    def _build_block(self, layer_id: int, device) -> TransformerBlock:
        with seeded(self._seed, _LAYER_STREAM + layer_id):
            return TransformerBlock(self.config, self.groups, sequence_parallel=self.sequence_parallel,
                                    cp_comm_type=self._cp_comm_type, layer_number=layer_id,
                                    moe_dispatcher=self._moe_dispatcher, dtype=self._dtype, device=device)

    def _build_mtp(self, device) -> MultiTokenPrediction:
        """DeepSeek's MTP depths, each from the seed stream after the model's blocks (model/mtp.py)."""
        depths = [self._build_mtp_depth(k, device) for k in range(1, self.config.mtp_num_layers + 1)]
        return MultiTokenPrediction(depths, self.config.mtp_loss_scaling_factor)

    def _build_mtp_depth(self, k: int, device) -> MTPDepth:
        layer_id = self.config.num_layers + k - 1
        with seeded(self._seed, _LAYER_STREAM + layer_id):
            return MTPDepth(self.config, self.groups, sequence_parallel=self.sequence_parallel, layer_number=layer_id,
                            moe_dispatcher=self._moe_dispatcher, dtype=self._dtype, device=device)

    def _build_output_weight(self, device) -> tuple[torch.Tensor, ShardSpec]:
        """Untied head, or the last stage's copy of a tied embedding (same stream: same values)."""
        config = self.config
        stream = _WORD_EMBEDDING_STREAM if config.tie_embeddings else _OUTPUT_STREAM
        with seeded(self._seed, stream):
            full = torch.empty(config.vocab_size, config.hidden_size)
            normal_init(config.init_std)(full)
        spec = ShardSpec((config.vocab_size, config.hidden_size), 0, *self._tp, padded_size=self.padded_vocab_size)
        return spec.shard(full).to(device=device, dtype=self._dtype or full.dtype), spec

    def zero3_units(self) -> list:
        """ZeRO-3's units in forward order: the embedding (word and position tables; started by its
        first read), each block (started by its forward; an MoE block's experts are a unit of their own,
        started by their forward and sharded over the expert-data-parallel group), the final norm
        with the output layer.
        Each can materialise its tensors from its seeded stream on the real device, so a model
        built on the meta device never exists in full on any rank (`data_parallel/units.py`)."""
        device, units = self._real_device, []
        if self.holds_word_embeddings:  # the first stage's, or MTP's copy on the last stage
            positions = self.config.flavour == "gpt2" and self.pre_process
            tables = [self.word_embeddings.weight] + ([self.position_embeddings] if positions else [])
            units.append(Unit("embedding", tables, (), lambda: [self._build_word_embeddings(device).weight.detach()]
                              + ([self._build_position_table(device)] if positions else [])))
        for index, block in enumerate(self.layers):
            layer_id = self.layer_ids[index]
            experts = block.mlp.experts if block.is_moe else None  # a unit of their own, sharded over expert-dp
            expert_ids = {id(p) for p in experts.parameters()} if experts is not None else set()
            units.append(Unit(f"layers.{layer_id}", [p for p in block.parameters() if id(p) not in expert_ids],
                              (block,), lambda layer_id=layer_id: self._block_tensors(layer_id, device, False)))
            if experts is not None:
                units.append(Unit(f"layers.{layer_id}.experts", list(experts.parameters()), (experts,),
                                  lambda layer_id=layer_id: self._block_tensors(layer_id, device, True), kind=1))
        if self.post_process:
            head = list(self.final_norm.parameters()) + ([self.output_weight] if self.output_weight is not None else [])
            units.append(Unit("head", head, (self.final_norm,), lambda: [
                p.detach() for p in Norm(self.config, self.sequence_parallel, self._dtype, device).parameters()]
                + ([self._build_output_weight(device)[0]] if self.output_weight is not None else [])))
        if self.mtp is not None:  # after the head, as the forward runs them
            units += mtp_units(self.mtp, lambda k: self._build_mtp_depth(k, device))
        return units

    def _block_tensors(self, layer_id: int, device, experts: bool) -> list[torch.Tensor]:
        """Block `layer_id`'s tensors from its seeded stream: its experts' (experts=True) or the rest."""
        block = self._build_block(layer_id, device)
        expert_ids = {id(p) for p in block.mlp.experts.parameters()} if block.is_moe else set()
        return [p.detach() for p in block.parameters() if (id(p) in expert_ids) == experts]

    # --- pieces -----------------------------------------------------------------------------

    def head_weight(self) -> torch.Tensor:
        return self.output_weight if self.output_weight is not None else self.word_embeddings.weight

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[b, s] ids -> [s, b, h] (or the sequence shard [s/tp, b, h] under SP); position_ids [b, s]: the
        learned positions' rows (gpt2), by default 0..s-1."""
        s = input_ids.shape[1]
        partial = self.word_embeddings.local_lookup(input_ids).transpose(0, 1).contiguous()  # [s, b, h] partial
        if self.sequence_parallel:
            x = mappings.reduce_scatter_to_sequence_parallel_region(partial, self.groups.tp)  # [s/tp, b, h]
        else:
            x = mappings.reduce_from_tensor_parallel_region(partial, self.groups.tp)
        if self.config.flavour == "gpt2":
            table = self.position_embeddings
            if position_ids is not None:  # [b, s] -> [s, b, h]: each sample's own positions
                positions = table[position_ids].transpose(0, 1)
            else:
                table = table[:s] if self.cp_size == 1 else table[self._global_positions(s, table.device)]
                positions = table.unsqueeze(1)  # [s, 1, h]
            if self.sequence_parallel:
                tp, r = comm.group_size(self.groups.tp), comm.group_rank(self.groups.tp)
                positions = positions.chunk(tp, dim=0)[r]
            x = x + positions
        # the [s, b, h] embedding output's mask; under SP this rank's rows of it
        shards = comm.group_size(self.groups.tp) if self.sequence_parallel else 1
        offset = logical_row_offsets(x.shape[0], math.prod(x.shape[1:]),  # a size read without an aten op
                                     comm.group_rank(self.groups.tp) if shards > 1 else 0, shards, self.cp_rank,
                                     self.cp_size)
        return dropout(x, self.config.hidden_dropout, self.rng.replicated, dropout_site(None, 0), self.training,
                       offset)

    def head_losses(self, normed: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """normed [s(/tp), b, h] (after a final norm), labels [b, s] -> per-token losses [s, b] of the output
        layer (the model's head, shared by the MTP depths)."""
        if self.fused_linear_cross_entropy:  # the logits [tokens, V/tp] never held
            return vocab_parallel_linear_cross_entropy(normed, self.head_weight(), labels.transpose(0, 1),
                                                       self.groups.tp, sequence_parallel=self.sequence_parallel,
                                                       vocab_size=self.config.vocab_size)
        return vocab_parallel_cross_entropy(self._project(normed), labels.transpose(0, 1), self.groups.tp,
                                            vocab_size=self.config.vocab_size)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[s(/tp), b, h] final hidden -> [s, b, V_pad/tp] logits shard."""
        return self._project(self.final_norm(x))

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """[s(/tp), b, h] normed hidden -> [s, b, V_pad/tp] logits shard."""
        if self.sequence_parallel:  # [s/tp, b, h] -> [s, b, V/tp]; backward re-gathers the shard
            return sequence_parallel_linear(x, self.head_weight(), None, self.groups.tp)
        return linear(mappings.copy_to_tensor_parallel_region(x, self.groups.tp), self.head_weight())

    def _global_positions(self, s: int, device) -> torch.Tensor:
        """Positions in the whole sequence of this cp rank's s local tokens (its zigzag chunks)."""
        return position_ids(s * self.cp_size, self.cp_rank, self.cp_size, device=device)

    def _rope(self, s: int, position_ids: torch.Tensor | None = None):
        """RoPE's (cos, sin): [s, d], or [s, b, d] gathered by each sample's position_ids [b, s]."""
        if self.config.flavour != "llama":
            return None
        if position_ids is not None:
            return self.rope_cos[position_ids].transpose(0, 1), self.rope_sin[position_ids].transpose(0, 1)
        if self.cp_size > 1:
            positions = self._global_positions(s, self.rope_cos.device)
            return self.rope_cos[positions], self.rope_sin[positions]
        return self.rope_cos[:s], self.rope_sin[:s]

    # --- forward ----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "mean",
                position_ids: torch.Tensor | None = None, input_ids: torch.Tensor | None = None):
        """input_ids [b, s]: the microbatch's token ids, which MTP on a last stage that is not the first reads
        (the pipeline hands them to it); the first stage takes them as x."""
        if self.pre_process:
            if x.dim() != 2:
                raise ValueError(f"the first stage takes input ids [b, s], got shape {tuple(x.shape)}")
            if x.shape[1] * self.cp_size > self.config.seq_length:
                raise ValueError(f"sequence length {x.shape[1] * self.cp_size} exceeds "
                                 f"seq_length={self.config.seq_length}")
            s, input_ids, batch = x.shape[1], x, x.shape[0]
            check_position_ids(position_ids, batch, s, self.cp_size)
        else:
            s, batch = x.shape[0] * (comm.group_size(self.groups.tp) if self.sequence_parallel else 1), x.shape[1]
            check_position_ids(position_ids, batch, s, self.cp_size)
        # once per microbatch, in whole-sequence positions (ring attention and Ulysses read it so)
        documents = document_mask(self.config.window_size, position_ids, batch, s * self.cp_size, x.device,
                                  cp_size=self.cp_size, cp_split=self.cp_split)
        local = local_positions(position_ids, self.cp_rank, self.cp_size, documents=documents)  # [b, s]: my tokens'
        if self.pre_process:
            x = self.embed(x, local)
        rope = self._rope(s, local)
        recomputed = len(self.layers) if self.recompute_num_layers is None else self.recompute_num_layers
        masked = (documents,) if documents is not None else ()  # a block is called as before without a mask
        for index, block in enumerate(self.layers):
            if self.recompute == Recompute.FULL and self.training and index < recomputed:
                x = checkpoint_with_rng(block, self.rng, x, rope, self.rng, *masked)
            else:
                x = block(x, rope, self.rng, *masked)
        if not self.post_process:
            return x
        if labels is None:
            return self.logits(x).transpose(0, 1)  # [b, s, V/tp]
        losses = self.head_losses(self.final_norm(x), labels)  # [s, b]
        extra = 0.0  # DeepSeek's MTP: its losses' gradient joins the loss's, the value stays the model's
        if self.mtp is not None and reduction != "none":
            if input_ids is None:
                raise ValueError("MTP on a last pipeline stage embeds the tokens ahead: pass input_ids=[b, s] (the "
                                 "microbatch's ids) with the labels")
            depth_losses = mtp_losses(self, x, input_ids, labels, rope, position_ids=position_ids, documents=documents)
            if self.training and torch.is_grad_enabled():
                self.mtp.record(depth_losses)
            term = self.mtp.loss_term(depth_losses)
            extra = term - term.detach()
        if reduction == "sum":
            return losses.sum() + extra
        if reduction == "mean":
            if self.cp_size > 1:
                raise ValueError("reduction='mean' under context parallelism would average this rank's tokens "
                                 "only; use reduction='sum' and divide by the target tokens of all cp ranks")
            return (losses.sum() + extra) / (labels != -100).sum().clamp(min=1)
        if reduction == "none":
            return losses.transpose(0, 1)
        raise ValueError(f"reduction must be mean, sum or none, got {reduction!r}")

    # --- layout-free names and full tensors ---------------------------------------------------

    def logical_name(self, local_name: str) -> str:
        """This stage's parameter name -> the name in the full (pp=1) model.

        `layers.{i}.` becomes `layers.{global i}.`; the last stage's copy of a tied embedding is
        `word_embeddings.weight` (one logical tensor).
        """
        if local_name.startswith("layers."):
            _, index, rest = local_name.split(".", 2)
            return f"layers.{self.layer_ids[int(index)]}.{rest}"
        if local_name == "output_weight" and self.config.tie_embeddings:
            return "word_embeddings.weight"
        return local_name

    def logical_parameters(self):
        """(logical name, parameter) for every parameter of this stage."""
        for name, param in self.named_parameters():
            yield self.logical_name(name), param

    @torch.no_grad()
    def load_full_state_dict(self, full: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load full (unsharded, unpadded) tensors by logical name; each rank keeps its shard."""
        missing = []
        for name, param in self.logical_parameters():
            if name not in full:
                missing.append(name)
                continue
            param.copy_(params.shard_spec(param).shard(full[name].to(torch.float32)).to(param.dtype))
        if strict and missing:
            raise KeyError(f"full state dict lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
