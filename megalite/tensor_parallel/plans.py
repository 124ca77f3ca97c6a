"""Ready tensor-parallel plans for transformers' models (unmodified), for `parallelize`.

Megatron's split per block: q/k/v and gate/up column-parallel (each rank its heads, its part of the
MLP), o/down row-parallel (one reduction per half block); the embedding split over the vocabulary;
the head column-parallel, gathered (transformers computes its loss on the full logits). Qwen3's q/k
norms see this rank's heads only: their gradients are declared partial. Experts (Mixtral,
Qwen3-MoE, Qwen2-MoE) split along their inner width, Qwen2-MoE's shared expert as a dense MLP; the
router and the shared expert's gate stay whole on every rank.

With sequence_parallel=True the residual stream is split along the sequence: the first layer's input
is scattered, the norms run on the shard, the attention and the MLP gather the sequence at their input
(transformers' attention reshapes by its input's length) and their row layers reduce-scatter it, and
the final norm's input is gathered again. Rotary tables and the causal mask are built from the whole
sequence before the first layer, so they are unchanged.

GPT-2 (torchtitan has its own for Llama; this is the same split for transformers' GPT-2): its Conv1D
layers are [in, out]; c_attn holds [q; k; v] fused, each block split over tp (Column(blocks=(h, h, h)))
and the attention's `split_size` and `num_heads` divided by tp; the learned positions and the layer
norms stay whole (the residual stream is replicated); the head, tied to the embedding, is one tensor.
"""
from __future__ import annotations

from megalite.tensor_parallel.parallelize import Column, Heads

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")


def hf_plan(model, sequence_parallel: bool = False, expert_split: str = "width") -> dict[str, object]:
    """The plan of a transformers *ForCausalLM `model` (read from model.config.model_type). Experts are split
    along their width ("width") or divided among the tp ranks whole ("experts": expert parallelism)."""
    if expert_split not in ("width", "experts"):
        raise ValueError(f"expert_split must be 'width' or 'experts', got {expert_split!r}")
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family == "gpt2":
        return gpt2_plan(model, sequence_parallel)
    if family not in DENSE_FAMILIES + MOE_FAMILIES:
        raise ValueError(f"no ready plan for model_type {family!r}; plans exist for "
                         f"{', '.join(('gpt2',) + DENSE_FAMILIES + MOE_FAMILIES)} (or write one: docs/models.md)")
    if sequence_parallel and family in MOE_FAMILIES:
        raise ValueError(f"{family}: sequence parallelism with experts is not planned (the experts split over tp "
                         f"need every token); use sequence_parallel=False")
    column, row = ("column_sp", "row_sp") if sequence_parallel else ("column", "row")
    layer = "model.layers.*."
    plan = {"model.embed_tokens": "vocab"}
    if sequence_parallel:
        plan.update({"model.layers.0": "scatter_sequence", "model.norm": "gather_sequence_replicated",
                     layer + "self_attn": "gather_sequence", layer + "mlp": "gather_sequence",
                     layer + "input_layernorm": "partial_grad", layer + "post_attention_layernorm": "partial_grad"})
    plan.update({layer + f"self_attn.{x}_proj": column for x in "qkv"})
    plan[layer + "self_attn.o_proj"] = row
    if family in ("qwen3", "qwen3_moe"):
        plan.update({layer + "self_attn.q_norm": "partial_grad", layer + "self_attn.k_norm": "partial_grad"})
    if family in MOE_FAMILIES:
        plan[layer + "mlp.experts"] = "experts" if expert_split == "width" else "experts_ep"
    else:
        plan.update({layer + "mlp.gate_proj": column, layer + "mlp.up_proj": column, layer + "mlp.down_proj": row})
    if family == "qwen2_moe":  # the shared expert: a dense MLP split as one (its [1, h] gate stays whole)
        plan.update({layer + "mlp.shared_expert.gate_proj": column, layer + "mlp.shared_expert.up_proj": column,
                     layer + "mlp.shared_expert.down_proj": row})
    plan["lm_head"] = "column_gather"
    return plan


def gpt2_plan(model, sequence_parallel: bool = False) -> dict[str, object]:
    """The plan of transformers' GPT2LMHeadModel (see the module docstring)."""
    if sequence_parallel:
        raise ValueError("gpt2: sequence parallelism is not planned (its learned positions join the stream "
                         "before the first block); use sequence_parallel=False")
    hidden, layer = model.config.n_embd, "transformer.h.*."
    return {"transformer.wte": "vocab",
            layer + "attn": Heads(attributes=("num_heads", "split_size")),
            layer + "attn.c_attn": Column(blocks=(hidden, hidden, hidden)),  # [q; k; v], each block split
            layer + "attn.c_proj": "row",
            layer + "mlp.c_fc": "column", layer + "mlp.c_proj": "row",
            "lm_head": "column_gather"}
