"""Batched generation over a KV cache.

    out = generate(model, [[5, 9, 2], [7]], max_new_tokens=20, params=SamplingParams(), eos_token_id=2,
                   on_tokens=lambda step, tokens, done: ...)   # out: each prompt's new tokens

Prompts of different lengths are left-padded (`pad_token_id` fills the slots; they are never attended
to) and each real token sits at its position in its own row, as transformers' `generate` does with an
attention mask, so a prompt gives the same tokens alone or in a batch. The prompts run through the
model in one step (prefill); then one token per row per step. A row ends at `eos_token_id` (kept in
its output) and pads afterwards; the loop ends when every row has ended or after max_new_tokens.
Every rank of a tp group runs this with the same prompts and draws the same tokens.
"""
from __future__ import annotations

from typing import Callable

import torch

from megalite.generation.cache import KVCache, forward_step
from megalite.generation.sampling import SamplingParams, next_tokens
from megalite.model.gpt import GPTModel


def left_padded(prompts: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [b, longest], valid [b, longest]) with each prompt at the right end of its row."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), longest), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            valid[row, longest - len(prompt):] = True
    return ids.to(device), valid.to(device)


def check_prompts(prompts: list[list[int]], max_new_tokens: int, model: GPTModel) -> None:
    """ValueError naming the fix: empty prompts, ids outside the vocabulary, a length past seq_length."""
    config = model.config
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    outside = [i for p in prompts for i in p if not 0 <= i < config.vocab_size]
    if outside:
        raise ValueError(f"token id {outside[0]} is outside the model's vocabulary of {config.vocab_size}; use the "
                         f"tokenizer the model was trained with")
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > config.seq_length:
        raise ValueError(f"the longest prompt plus --max-new-tokens is {longest} positions, past the model's "
                         f"seq_length {config.seq_length}; shorten the prompt or lower --max-new-tokens")


@torch.no_grad()
def generate(model: GPTModel, prompts: list[list[int]], *, max_new_tokens: int,
             params: SamplingParams = SamplingParams(), eos_token_id: int | None = None, pad_token_id: int = 0,
             on_tokens: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None) -> list[list[int]]:
    """The new tokens of each prompt (at most max_new_tokens; through its eos when one comes).
    on_tokens(step, tokens [b], live [b]): called after each step (streaming); live marks the rows that
    drew a token this step (the others had ended and carry pad_token_id)."""
    check_prompts(prompts, max_new_tokens, model)
    model.eval()
    device = model.layers[0].input_norm.weight.device
    ids, valid = left_padded(prompts, pad_token_id, device)
    positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)  # [b, s]: each row's own positions
    cache = KVCache.empty(model, len(prompts), ids.shape[1] + max_new_tokens)
    generator = torch.Generator().manual_seed(params.seed)
    ended = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out: list[list[int]] = [[] for _ in prompts]
    logits = forward_step(model, ids, positions, valid, cache)
    next_position = positions[:, -1:] + 1  # [b, 1]
    for step in range(max_new_tokens):
        tokens = next_tokens(logits, params, generator).masked_fill(ended, pad_token_id)
        live = ~ended
        for row in live.nonzero().flatten().tolist():
            out[row].append(int(tokens[row]))
        if eos_token_id is not None:
            ended = ended | (tokens == eos_token_id)
        if on_tokens is not None:
            on_tokens(step, tokens, live)
        if bool(ended.all()) or step == max_new_tokens - 1:
            break
        logits = forward_step(model, tokens[:, None], next_position, torch.ones_like(tokens[:, None], dtype=torch.bool),
                              cache)
        next_position = next_position + 1
    return out
