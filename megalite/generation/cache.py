"""A KV cache and the incremental forward that fills it, over GPTModel's own layers and weights.

    cache = KVCache.empty(model, batch=2, capacity=64)
    logits = forward_step(model, ids, positions, valid, cache)   # [b, V]: the last position's logits

This is a separate forward path, not a flag of the training one: it calls each block's modules (the
norms, the fused QKV column-parallel linear, the q/k head norms, the row-parallel projection, the MLP
or mixture of experts, the final norm and the vocab-parallel head) in the block's order, and keeps the
attention core to itself: new queries against every cached key, the keys and values of each step
appended to the cache. Training's attention (kernels, context parallelism, dropout) is untouched.
Latent attention (DeepSeek) runs its own projections and RoPE (`MultiLatentAttention.heads`) and caches
each head's key [d_qk] and value [d_v], not the compressed latent; MTP's depths are not run (they train
the model, the next token is the head's).

Tensor parallelism falls out of the layers: each rank caches its own kv heads [b, hkv/tp, capacity, d]
and the head's logits shards are gathered over tp (comm.all_gather), so every rank sees the same
logits and draws the same token. Pipeline parallelism is not supported (tools/generate.py refuses it).

A sliding window (`window_size`, Mistral's) limits each query to its last window_size slots: a row's
real tokens are contiguous (padding sits only at its left end), so slots and positions differ by a
constant within a row.

Rows of a batch may be left-padded: `valid` [b, s] marks the real tokens and `positions` [b, s] gives
each real token its position in its own row (transformers' cumsum of the attention mask). A slot that
holds padding is never attended to; a padding query attends to itself only (no row of scores is all
masked, so nothing turns NaN).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite import ops
from megalite.distributed import comm
from megalite.model.gpt import GPTModel
from megalite.model.mla import MultiLatentAttention


@dataclass
class KVCache:
    """Keys and values of every layer, [b, hkv/tp, capacity, d] each, the slots filled so far
    (`length`, the same for every row) and which filled slots hold real tokens (`valid` [b, capacity])."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, model: GPTModel, batch: int, capacity: int) -> "KVCache":
        attention = model.layers[0].attention
        ref = model.layers[0].input_norm.weight
        mla = model.config.mla  # latent attention: every head's own key [d_qk] and value [d_v]
        groups = attention.local_heads if mla is not None else attention.local_groups
        dims = (mla.qk_dim, mla.v_head_dim) if mla is not None else (attention.head_dim,) * 2

        def make(d):
            return [torch.zeros((batch, groups, capacity, d), dtype=ref.dtype, device=ref.device) for _ in model.layers]
        return cls(make(dims[0]), make(dims[1]), torch.zeros(batch, capacity, dtype=torch.bool, device=ref.device))

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with a position per (token, row): x [s, b, heads, d]; cos, sin [s, b, 1, d]."""
    half = x.shape[-1] // 2
    x32 = x.float()
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def _embed(model: GPTModel, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """ids, positions [b, s] -> [s, b, h]: the vocab-parallel lookup summed over tp, plus GPT-2's table."""
    x = model.word_embeddings(ids)  # [b, s, h], reduced over tp
    if model.config.flavour == "gpt2":
        x = x + model.position_embeddings[positions]
    return x.transpose(0, 1)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
            scale: float | None) -> torch.Tensor:
    """q [b, hq, s, d] against keys [b, hkv, L, d], values [b, hkv, L, d_v] (grouped queries); allowed
    [b, 1, s, L] -> [b, hq, s, d_v]. scale: the softmax scale (None: 1/sqrt(d))."""
    repeat = q.shape[1] // keys.shape[1]  # query head j reads kv group j // repeat, as in training
    keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale)


def _heads(attention, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The normed new tokens x [s, b, h] -> q [s, b, hq, d], k [s, b, hkv, d], v [s, b, hkv, d_v], RoPE
    applied (rope: [s, b, d] tables, each row's positions); latent attention through its own steps."""
    if isinstance(attention, MultiLatentAttention):
        return attention.heads(*attention.qkv(x), rope)
    d, hq, hkv = attention.head_dim, attention.local_heads, attention.local_groups
    q, k, v = ops.split_heads(attention.qkv(x), (hq, hkv, hkv), d)  # [s, b, heads, d]
    if attention.q_norm is not None:
        q, k = attention.q_norm(q), attention.k_norm(k)
    if rope is not None:
        q, k = (_rotate(t, *(table.unsqueeze(2) for table in rope)) for t in (q, k))
    return q, k, v


def _block_step(block, x: torch.Tensor, rope, cache: KVCache, index: int, allowed: torch.Tensor) -> torch.Tensor:
    """One block on the new tokens x [s, b, h], their keys and values written into `cache` layer `index`."""
    attention = block.attention
    s, b, _ = x.shape
    q, k, v = _heads(attention, block.input_norm(x), rope)
    start, end = cache.length, cache.length + s
    cache.keys[index][:, :, start:end] = k.permute(1, 2, 0, 3)  # [s, b, hkv, d] -> [b, hkv, s, d]
    cache.values[index][:, :, start:end] = v.permute(1, 2, 0, 3)
    out = _attend(q.permute(1, 2, 0, 3), cache.keys[index][:, :, :end], cache.values[index][:, :, :end], allowed,
                  getattr(attention, "softmax_scale", None))  # [b, hq, s, d_v]
    x = x + attention.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))
    return x + block.mlp(block.post_attention_norm(x))


@torch.no_grad()
def forward_step(model: GPTModel, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                 cache: KVCache) -> torch.Tensor:
    """Run the new tokens ids [b, s] (at `positions` [b, s]; `valid` [b, s] False on padding) through the
    whole model, appending their keys and values to `cache`; returns the last position's logits [b, V]
    (fp32, the true vocabulary, the same on every tp rank)."""
    s = ids.shape[1]
    start, end = cache.length, cache.length + s
    if end > cache.capacity:
        raise ValueError(f"the KV cache holds {cache.capacity} positions; {end} asked")
    cache.valid[:, start:end] = valid
    slots, queries = torch.arange(end, device=ids.device), start + torch.arange(s, device=ids.device)
    causal = slots[None, :] <= queries[:, None]  # [s, L]
    if model.config.window_size is not None:  # a sliding window: a query sees its last window_size slots,
        causal &= slots[None, :] > queries[:, None] - model.config.window_size  # a row's tokens being contiguous
    own = slots[None, :] == queries[:, None]  # a padding query's one key
    allowed = ((causal[None] & cache.valid[:, None, :end]) | own[None]).unsqueeze(1)  # [b, 1, s, L]
    rope = None
    if model.config.flavour == "llama":
        rope = tuple(table[positions].transpose(0, 1) for table in (model.rope_cos, model.rope_sin))  # [s, b, d]
    x = _embed(model, ids, positions)
    for index, block in enumerate(model.layers):
        x = _block_step(block, x, rope, cache, index, allowed)
    cache.length = end
    shard = model.logits(x[-1:])[0].float()  # [b, V_pad/tp]
    full = comm.all_gather(shard, model.groups.tp, dim=-1)  # [b, V_pad], rank-major = vocabulary order
    return full[:, :model.config.vocab_size]
