"""Counts and sizes for people: 1.21B parameters, 469.00K, 512; 80.00 GB, 4.19 MB, 512 B.

A fixed unit prints "0.00B parameters" for a tiny model and "70553.71M" for a large one; these pick
the unit from the number. Bytes use the planner's decimal convention (GB = 1e9 bytes, layout.GB).
"""
from __future__ import annotations

_COUNT_UNITS = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))
_BYTE_UNITS = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


def _scaled(value: float, units: tuple[tuple[float, str], ...], separator: str, plain: str) -> str:
    """Two decimals in the largest unit the value reaches (as the planner's lines print billions and
    GB: 24.15B, 34.36 GB); below the smallest unit, the number itself."""
    for scale, unit in units:
        if abs(value) >= scale * (1 - 5e-5):  # 999.996K prints as 1.00M, not 1000.00K
            return f"{value / scale:.2f}{separator}{unit}"
    number = f"{value:.0f}" if value == int(value) else f"{value:.2f}"
    return f"{number}{separator}{plain}".rstrip()


def human_count(n: float) -> str:
    """A count with its unit: 1.21B, 350.00M, 4.10K, 512."""
    return _scaled(n, _COUNT_UNITS, "", "")


def human_bytes(n: float) -> str:
    """A size in decimal units: 80.00 GB, 3.40 MB, 512 B."""
    return _scaled(n, _BYTE_UNITS, " ", "B")
