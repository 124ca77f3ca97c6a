"""The next token from a row of logits: greedy, or sampled with temperature, top-k and top-p.

    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7)
    tokens = next_tokens(logits, params, generator)   # logits [b, V] fp32 -> [b] int64

The order is transformers' (temperature, then top-k, then top-p): top-k keeps the k largest logits,
top-p the smallest set of the highest probabilities whose sum reaches p (the most likely token always
stays). temperature 0 is greedy (argmax; the first index on ties, as torch.argmax). Under tensor
parallelism every rank holds the same logits and the same seeded generator, so every rank draws the
same token without talking.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    """0: greedy. Else the logits are divided by it before sampling."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probabilities sum to at least p (1: all)."""
    seed: int = 0
    """Seed of the sampling generator (the same on every rank)."""

    def problems(self) -> list[str]:
        """What is out of range, each naming the flag and what it accepts."""
        out = []
        if self.temperature < 0:
            out.append(f"--temperature {self.temperature} must be >= 0 (0: greedy)")
        if self.top_k < 0:
            out.append(f"--top-k {self.top_k} must be >= 0 (0: no top-k)")
        if not 0 < self.top_p <= 1:
            out.append(f"--top-p {self.top_p} must be in (0, 1] (1: no top-p)")
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [b, V] -> the tempered logits with everything top-k / top-p remove set to -inf."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [b, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)  # mass above each token
        drop = before >= params.top_p  # the first token has 0 above it: always kept
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [b, V] -> the next token of each row [b] (int64)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filtered_logits(logits.float(), params).softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
