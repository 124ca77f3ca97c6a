"""Activation bytes of a block with multi-head latent attention (DeepSeek; megalite/model/mla.py), per
microbatch and tensor-parallel rank, counted storage by storage as plan/activations.py counts the
fused-QKV block (Korthikanti et al.'s method). Pure arithmetic.

With a = activation bytes, sb = tokens of the microbatch on this rank (s/cp * b), t = tp, sp = t under
sequence parallelism (else 1), n = heads, r_q / r_kv the latent widths, d_qk = d_nope + d_rope, d_v:

  shared with the fused-QKV block: two norms, the down-projections' and the MLP's inputs 2*a*sbh/sp,
    the MLP's 3*a*sb*f/t;
  query latent (r_q set): its norm's input a*sb*r_q/sp + fp32 rstd 4*sb/sp, the up-projection's input
    a*sb*r_q/sp (under SP its sequence shard, re-gathered in backward);
  key/value latent: its norm's input (a contiguous copy of the latent's view) a*sb*r_kv/sp + 4*sb/sp,
    the up-projection's input a*sb*r_kv/sp;
  attention: q and k as the core assembles them (RoPE part rotated and joined) 2*a*sb*n*d_qk/t, the
    key/value up-projection's output (v is a view of it) a*sb*n*(d_nope + d_v)/t, SDPA's output
    a*sb*n*d_v/t and fp32 log-sum-exp 4*b*n*s/t. The output projection's input is a view of SDPA's output,
    not a copy: the fused kernels write it [b, s, n, d_v] (CUDA's memory-efficient kernel, which SDPA runs for
    d_qk != d_v, and torch's CPU kernel both), so [s, b, n*d_v] merges only the last two dims.
  Selective recompute re-runs the core: it keeps the core's inputs instead of what the core saves:
    the two up-projections' outputs a*sb*n*(d_qk + d_nope + d_v)/t and the storage of the RoPE key
    (without SP a view of the key/value down-projection's output a*sb*(r_kv + d_rope); under SP its
    gathered copy a*sb*d_rope), and the core's output a*sb*n*d_v/t.
Full recompute keeps the block input only (plan/activations.py).
"""
from __future__ import annotations

from megalite.config.choices import Recompute
from megalite.config.model import GPTConfig


def latent_layer_bytes(model: GPTConfig, *, a: int, tokens: int, batch: int, seq: int, t: int, sp: int,
                       recompute: str) -> int:
    """Bytes one MLA block keeps for backward (recompute "none" or "selective"); see the module docstring.
    tokens: s*b on this rank (s/cp under context parallelism); batch, seq: b and s."""
    mla, h, n = model.mla, model.hidden_size, model.num_attention_heads
    rows = tokens // sp
    total = 2 * (a * rows * h + 4 * rows)                              # the block's two norms
    total += 2 * a * rows * h + 3 * a * tokens * model.ffn_hidden_size // t  # linear inputs, the MLP
    if mla.q_lora_rank is not None:
        total += 2 * a * rows * mla.q_lora_rank + 4 * rows             # latent norm input + rstd, up input
    total += 2 * a * rows * mla.kv_lora_rank + 4 * rows
    up_outputs = a * tokens * n * (mla.qk_dim + mla.qk_head_dim + mla.v_head_dim) // t
    core_output = a * tokens * n * mla.v_head_dim // t
    if recompute == Recompute.SELECTIVE:
        rope_key = a * tokens * (mla.qk_pos_emb_head_dim if sp > 1 else mla.kv_lora_rank + mla.qk_pos_emb_head_dim)
        return total + up_outputs + rope_key + core_output
    total += a * tokens * n * mla.qk_dim // t * 2                      # q and k as the core joins them
    total += a * tokens * n * (mla.qk_head_dim + mla.v_head_dim) // t  # the key/value up-projection's output
    return total + core_output + 4 * batch * n * seq // t              # SDPA's output (the out-projection's
    #                                                                    input, a view) and log-sum-exp


def attention_head_dims(model: GPTConfig) -> tuple[int, int]:
    """(d_qk, d_v): a head's query/key channels and value channels (equal without latent attention)."""
    if model.mla is None:
        return model.head_dim, model.head_dim
    return model.mla.qk_dim, model.mla.v_head_dim


def _latent_widths(model: GPTConfig) -> tuple[int, int]:
    """(channels of the column-parallel up-projections' inputs: the query latent (or x) and the key/value
    latent, the RoPE key's channels)."""
    mla = model.mla
    return (mla.q_lora_rank or model.hidden_size) + mla.kv_lora_rank, mla.qk_pos_emb_head_dim


def latent_tp_bytes(model: GPTConfig, *, u: int, per_token: int, microbatches: int, layers: int, rerun: int,
                    sequence_parallel: bool, gathers=lambda nbytes: (nbytes, nbytes)) -> dict[str, int]:
    """The change of one stage's tp bytes per step when its `layers` blocks have latent attention instead of
    a fused QKV (plan/communication.py counts the fused block). u: an [s, b, h] activation's bytes;
    per_token: a * s * b (bytes of one channel over the microbatch's tokens); rerun: blocks full recompute
    re-runs. The up-projections' inputs replace x where the fused QKV gathered or reduced it:
    without SP their gradients are all-reduced in backward (the latents' and the RoPE key's) instead of
    x's; under SP the latents are gathered (forward, and again in backward for the two up-projections),
    their gradients reduce-scattered, the RoPE key gathered once (not kept). gathers(n): the bytes of one SP
    linear's input gathers (forward, re-gather) for an input of n bytes in the training dtype (FP8 sends
    fewer: plan/fp8.py's sp_input_gathers); each up-projection gathers its own latent, and a re-run block
    its latents forward only."""
    up, rope = _latent_widths(model)
    if not sequence_parallel:
        return {"tp/all_reduce": microbatches * layers * ((up + rope) * per_token - u)}
    mla = model.mla
    ups = [gathers(w * per_token) for w in (mla.q_lora_rank or model.hidden_size, mla.kv_lora_rank)]
    x_forward, x_regather = gathers(u)  # the fused QKV's input gathers, which the latents' replace
    per_layer = sum(f + r for f, r in ups) + rope * per_token - x_forward - x_regather
    per_rerun = sum(f for f, _ in ups) + rope * per_token - x_forward
    return {"tp/all_gather": microbatches * (layers * per_layer + rerun * per_rerun),
            "tp/reduce_scatter": microbatches * layers * ((up + rope) * per_token - u)}


def latent_sequence_parallel_grads(model: GPTConfig, layers: int) -> int:
    """Elements whose gradient is partial per tp rank under SP in `layers` MLA blocks: the latent norms and
    the replicated down-projections (their tokens are this rank's)."""
    mla, h = model.mla, model.hidden_size
    per_layer = mla.kv_lora_rank + h * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim)
    if mla.q_lora_rank is not None:
        per_layer += mla.q_lora_rank + h * mla.q_lora_rank
    return layers * per_layer
