"""How the norm kernels (rms_norm.py, layer_norm.py) are launched, in one small record.

Both norms work on 2-D tiles [rows, BLOCK] of the [n_rows, n] input, BLOCK = next_power_of_2(n):
one row's statistics are reductions along axis 1, so `rows` rows share each reduction's
cross-warp step and keep `rows` times the loads in flight.

- Forward: one program per tile, cdiv(n_rows, rows) programs.
- Backward: `programs_per_sm` x (number of SMs) persistent programs, each walking a contiguous
  range of rows one tile at a time and accumulating its weight (and bias) gradient in fp32;
  `column_sum.sum_partials` then reduces the [programs, n] partials in one launch (the two-pass
  weight-gradient reduction that lets norm backward run at memory speed).

Each norm module has one function per direction, `_forward_config(n_cols, device)` and
`_backward_config(n_cols, device)`, which tools/tune_norms.py replaces to time candidates: the
measured winners go into that module's FORWARD_CONFIGS / BACKWARD_CONFIGS (keyed by BLOCK);
`default_config` below is the rule for every BLOCK not measured yet.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .dispatch import next_power_of_2

CPU_SMS = 2  # the interpreter runs programs one after another: few persistent programs on CPU


@dataclass(frozen=True)
class NormConfig:
    """rows: rows per tile (a power of two); num_warps: warps per program; programs_per_sm:
    backward only, persistent programs per SM (the forward launches one program per tile)."""
    rows: int
    num_warps: int
    programs_per_sm: int = 1


@functools.lru_cache(maxsize=None)  # called per launch: build each record once
def default_config(n_cols: int, tile_elements: int, elements_per_warp: int, persistent: bool = False) -> NormConfig:
    """Tiles of about `tile_elements` (at least one row, at most 16 rows) with `elements_per_warp`
    per warp, 1 to 16 warps (at 16 warps the widest rows hold more per thread). Persistent
    (backward) programs: two per SM when a thread holds 8 values of a tile (about 60 registers at
    sm_90, compile_check: two programs of 16 warps fit an SM's 64K registers), one when it holds 16."""
    block = next_power_of_2(n_cols)
    rows = max(1, min(16, tile_elements // block))
    num_warps = max(1, min(16, rows * block // elements_per_warp))
    per_thread = rows * block // (32 * num_warps)
    return NormConfig(rows, num_warps, max(1, 16 // max(1, per_thread)) if persistent else 1)


@functools.lru_cache(maxsize=None)
def _sm_count(device_type: str, index: int | None) -> int:
    if device_type != "cuda":
        return CPU_SMS
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()
                                            ).multi_processor_count


def backward_programs(config: NormConfig, n_rows: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows_per_program) for a backward over n_rows rows: at most programs_per_sm x SMs
    programs, each owning a whole number of tiles, none left without rows."""
    programs = max(1, min(config.programs_per_sm * _sm_count(device.type, device.index),
                          -(-n_rows // config.rows)))
    rows_per_program = -(-n_rows // (programs * config.rows)) * config.rows
    return -(-n_rows // rows_per_program), rows_per_program


def forward_config(measured: dict[int, NormConfig], n_cols: int, device: torch.device) -> NormConfig:
    """A norm forward's config: the measured entry for this BLOCK on CUDA, else the default rule."""
    entry = measured.get(next_power_of_2(n_cols)) if device.type == "cuda" else None
    return entry or default_config(n_cols, tile_elements=4096, elements_per_warp=256)


def backward_config(measured: dict[int, NormConfig], n_cols: int, device: torch.device) -> NormConfig:
    """A norm backward's config: the measured entry for this BLOCK on CUDA, else the default rule."""
    entry = measured.get(next_power_of_2(n_cols)) if device.type == "cuda" else None
    return entry or default_config(n_cols, tile_elements=2048, elements_per_warp=256, persistent=True)
