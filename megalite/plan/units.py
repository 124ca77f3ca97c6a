"""Counts and sizes for people: 1.2B parameters, 350M, 4.1K; 80 GB, 3.4 MB, 512 B.

A fixed unit prints "0.00B parameters" for a tiny model and "70553.71M" for a large one; these pick
the unit from the number. Bytes use the planner's decimal convention (GB = 1e9 bytes, layout.GB).
"""
from __future__ import annotations

_COUNT_UNITS = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))
_BYTE_UNITS = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


def _scaled(value: float, units: tuple[tuple[float, str], ...], separator: str, plain: str) -> str:
    """Three significant digits in the largest unit the value reaches (plain below 1000)."""
    for scale, unit in units:
        # the unit whose rounded value is >= 1 (999.6K prints as 1.00M, not 1000K)
        if abs(value) >= scale * (1 - 5e-4):
            return f"{_three_digits(value / scale)}{separator}{unit}"
    return f"{value:.0f}{separator}{plain}".rstrip() if value == int(value) else \
        f"{_three_digits(value)}{separator}{plain}".rstrip()


def _three_digits(x: float) -> str:
    """1.23, 12.3, 123 (and 1234 where no larger unit exists)."""
    if abs(x) >= 99.95:
        return f"{x:.0f}"
    return f"{x:.1f}" if abs(x) >= 9.995 else f"{x:.2f}"


def human_count(n: float) -> str:
    """A count with its unit: 1.21B, 350M, 4.10K, 512."""
    return _scaled(n, _COUNT_UNITS, "", "")


def human_bytes(n: float) -> str:
    """A size in decimal units: 80.0 GB, 3.40 MB, 512 B."""
    return _scaled(n, _BYTE_UNITS, " ", "B")
