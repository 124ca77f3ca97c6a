"""Philox-4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3") in torch
integer ops: the same numbers as Triton's `tl.randint(seed, offset)`, on any device.

Dropout masks in megalite are never kept for backward: element i of a mask is a pure function
of (seed, offset + i), so the backward kernels regenerate it, and the PyTorch references here
regenerate exactly the same bits on CPU:

    word  = philox4x32_10(key = (seed_lo, seed_hi), counter = (i_lo, i_hi, 0, 0))[0]
    keep  = word >= drop_threshold(p)          (drop with probability drop_threshold / 2^32)

`tl.randint(seed, offsets)` with int64 offsets computes exactly `word` (Triton's Philox is
Random123's: same round constants, same word order); `philox_word` below is checked against
Random123's known-answer vectors and against `tl.randint` in tests/kernels/test_philox.py.

torch has no unsigned 32-bit arithmetic, so words live in int64 tensors.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
ROUNDS = 10
# Random123's Philox-4x32 multipliers and Weyl key increments (also Triton's).
_MULTIPLIER_A, _MULTIPLIER_B = 0xD2511F53, 0xCD9E8D57
_KEY_STEP_A, _KEY_STEP_B = 0x9E3779B9, 0xBB67AE85


def drop_threshold(p: float) -> int:
    """The uint32 below which a random word drops its element: round(p * 2^32), in [0, 2^32 - 1]."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return min(int(p * 2.0 ** 32 + 0.5), MASK32)


def philox4x32(seed: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
               rounds: int = ROUNDS) -> tuple[torch.Tensor, ...]:
    """Philox-4x32 of counters (c0..c3: int64 tensors holding uint32) under the 64-bit key `seed`."""
    key0, key1 = seed & MASK32, (seed >> 32) & MASK32
    for _ in range(rounds):
        # word * multiplier < 2^64: int64 multiplication wraps, so the low 64 bits are exact and
        # (product >> 32) & MASK32 is the high word (checked on known-answer vectors in the tests)
        product_b, product_a = c2 * _MULTIPLIER_B, c0 * _MULTIPLIER_A
        c0, c2 = ((product_b >> 32) & MASK32) ^ c1 ^ key0, ((product_a >> 32) & MASK32) ^ c3 ^ key1
        c1, c3 = product_b & MASK32, product_a & MASK32
        key0, key1 = (key0 + _KEY_STEP_A) & MASK32, (key1 + _KEY_STEP_B) & MASK32
    return c0, c1, c2, c3


def philox_word(seed: int, index: torch.Tensor) -> torch.Tensor:
    """tl.randint(seed, index) for int64 `index` >= 0: one uint32 per element, in an int64 tensor."""
    index = index.to(torch.int64)
    zero = torch.zeros_like(index)
    return philox4x32(seed, index & MASK32, index >> 32, zero, zero)[0]


def keep_mask(seed: int, offset: int, shape, p: float, device=None) -> torch.Tensor:
    """The bool keep-mask of a tensor of `shape` whose element i has Philox counter offset + i."""
    numel = 1
    for size in shape:
        numel *= int(size)
    index = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    return (philox_word(seed, index) >= drop_threshold(p)).reshape(shape)
