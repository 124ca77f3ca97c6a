"""Tile choices of the flash-attention kernels, from measurements, per GPU architecture.

A tile is (BLOCK_M, BLOCK_N, num_warps, num_stages) of one kernel: BLOCK_M query rows and
BLOCK_N key rows per step. The three kernels (kernels/flash_attention.py forward,
kernels/flash_attention_backward.py dK/dV and dQ) each take their own. Constraints every entry
keeps (tests/kernels/test_attention_tiles.py checks them, compiles every entry for its
architecture and runs it under the interpreter against the reference):

    forward: BLOCK_M % BLOCK_N == 0 (its unmasked stage ends on a block boundary)
    all:     powers of two, >= 16 (tensor-core dot shapes)

`MEASURED` is keyed by (architecture, head dim, dtype, causal, dropout) and filled from
`python tools/tune_attention.py`, which times candidates on the GPU it runs on and prints the
entry to add (with the GPU and date in a comment). A key not in it — another GPU, a head dim
or dtype nobody measured — gets `safe_tiles`: tiles that compile for sm_80 and sm_90 without
register spills and are correct everywhere, not tuned anywhere.

The backward has two variants (kernels/flash_attention_backward.py): "split" (a dK/dV launch,
then a dQ launch) and "fused" (both kinds of program in one grid; its dK/dV programs take the
"dkdv" tile's blocks, its dQ programs the "dq" tile's, its launch `fused_launch`'s warps and
stages). `MEASURED_BACKWARD` names the one measured faster per key; unmeasured keys run "split"
(the one measured on a GPU so far); MEGALITE_ATTENTION_BACKWARD=split|fused forces one (tools,
tests). float32 always runs "split": its "ieee" dots run on the FMA units, where the fused
kernel (both programs' registers in one) spilled 4-32 bytes at most launches compile_check
tried, and float32 attention is there for exactness, not speed.
"""
from __future__ import annotations

import functools
import os

import torch

Tile = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
KERNELS = ("fwd", "dkdv", "dq")

# (arch, head_dim, dtype, causal, dropout) -> tiles per kernel, from tools/tune_attention.py.
MEASURED: dict[tuple[str, int, str, bool, bool], dict[str, Tile]] = {
    # NVIDIA H200, torch 2.11 + triton 3.6, 16384 tokens of s4096 (b4, 4096/d query heads, GQA 4:1),
    # 2026-11-26: fwd+bwd 348 TFLOP/s at d=128 (164 with the old kernels and default tiles).
    # (32, 64, 4, 3) for dK/dV spills 36 bytes under triton 3.6 (none under 3.9) and still timed best.
    ("sm_90", 128, "bf16", True, False): dict(fwd=(64, 64, 4, 3), dkdv=(32, 64, 4, 3), dq=(64, 32, 4, 3)),
    ("sm_90", 64, "bf16", True, False): dict(fwd=(128, 64, 8, 4), dkdv=(64, 64, 4, 3), dq=(64, 32, 4, 3)),
}


BACKWARDS = ("split", "fused")
BACKWARD_ENV = "MEGALITE_ATTENTION_BACKWARD"
# (arch, head_dim, dtype, causal, dropout) -> the backward variant measured faster (tools/tune_attention.py)
MEASURED_BACKWARD: dict[tuple[str, int, str, bool, bool], str] = {}


def safe_tiles(head_dim: int, dtype: torch.dtype, dropout: bool, causal: bool = True) -> dict[str, Tile]:
    """Untuned tiles that compile without spills on sm_80 and sm_90 (compile_check, triton 3.9: each
    choice below replaced one that spilled 4-36 bytes on one of the two)."""
    if dtype == torch.float32:  # "ieee" dots run on the FMA units with operands in registers
        if dropout:
            return dict(fwd=(32, 16, 8, 2), dkdv=(16, 32, 8, 2) if head_dim >= 128 else (16, 16, 8, 2),
                        dq=(16, 16, 8, 2))
        # at d=128, causal (16, 16, 4, 2) and (16, 32, 4, 2) spill 64-96 bytes at sm_90; (16, 32, 8, 2) does not
        dkdv = (16, 32, 8, 2) if head_dim >= 128 and causal else (16, 16, 4, 2)
        return dict(fwd=(32, 16, 8, 2), dkdv=dkdv, dq=(32, 16, 8, 2))
    # dK/dV with dropout holds the Philox mask too: fewer query rows per step
    if head_dim >= 128:
        return dict(fwd=(64, 64, 8, 2), dkdv=(16, 64, 8, 2) if dropout else (32, 64, 8, 2), dq=(64, 32, 8, 2))
    # 8 warps: the forward's 128 x 64 tile (and its Philox state, 4 words per score) and dK/dV's accumulators
    return dict(fwd=(128, 64, 8, 3), dkdv=(16, 32, 4, 3) if dropout else (32, 64, 8, 3), dq=(64, 32, 4, 3))


INTERPRETER_TILES = dict(fwd=(16, 16, 1, 1), dkdv=(16, 16, 1, 1), dq=(16, 16, 1, 1))  # odd shapes cross blocks


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


@functools.lru_cache(maxsize=None)
def cuda_arch(device_index: int) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def lookup(arch: str, head_dim: int, dtype: torch.dtype, causal: bool, dropout: bool) -> tuple[dict[str, Tile], str]:
    """(tiles, where they came from): the measured entry, else the safe choice."""
    key = (arch, head_dim, dtype_name(dtype), causal, dropout)
    if key in MEASURED:
        return MEASURED[key], "measured"
    return safe_tiles(head_dim, dtype, dropout, causal), "safe default (not in attention_tiles.MEASURED)"


def tiles_for(device: torch.device, head_dim: int, dtype: torch.dtype, causal: bool, dropout: bool) -> dict[str, Tile]:
    """The tiles the launchers use for a call on `device` (small ones in the CPU interpreter)."""
    if device.type != "cuda":
        return INTERPRETER_TILES
    index = device.index if device.index is not None else torch.cuda.current_device()
    return lookup(cuda_arch(index), head_dim, dtype, causal, dropout)[0]


def table_line(arch: str, head_dim: int, dtype: torch.dtype, causal: bool, dropout: bool,
               tiles: dict[str, Tile]) -> str:
    """The line to paste into MEASURED for a tuned key."""
    entry = ", ".join(f"{kernel}={tiles[kernel]}" for kernel in KERNELS)
    return f"    ({arch!r}, {head_dim}, {dtype_name(dtype)!r}, {causal}, {dropout}): dict({entry}),"


def fused_launch(tiles: dict[str, Tile]) -> tuple[int, int]:
    """(num_warps, num_stages) of the fused backward: one kernel holds both programs, so the more
    warps of the two and at most 2 stages (at 3, sm_90 d=128 bf16 spills 52 bytes: compile_check)."""
    return max(tiles["dkdv"][2], tiles["dq"][2]), min(tiles["dkdv"][3], tiles["dq"][3], 2)


def forced_backward() -> str | None:
    """MEGALITE_ATTENTION_BACKWARD's variant, if set (read on every call, like the kernel backend)."""
    name = os.environ.get(BACKWARD_ENV, "").strip().lower()
    if name and name not in BACKWARDS:
        raise ValueError(f"{BACKWARD_ENV}={name!r} is not an attention backward; choose one of {BACKWARDS}")
    return name or None


def backward_for(device: torch.device, head_dim: int, dtype: torch.dtype, causal: bool, dropout: bool) -> str:
    """The backward variant the launcher runs: "split" for float32, else forced, else measured
    faster, else "split"."""
    forced = forced_backward()
    if dtype == torch.float32:
        return "split"
    if forced or device.type != "cuda":
        return forced or "split"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return MEASURED_BACKWARD.get((cuda_arch(index), head_dim, dtype_name(dtype), causal, dropout), "split")
