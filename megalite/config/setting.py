"""How one setting of a RunConfig is declared: `setting(...)`, a dataclass field with its help, choices,
flag aliases and synonyms, and the bounds a number must keep (config/bounds.py).

Pure Python: no torch.
"""
from __future__ import annotations

from dataclasses import field
from typing import Any

from megalite.config.bounds import Bounds


FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: the largest loss scale the loss's dtype holds


def setting(default: Any, help: str, *, choices: tuple | None = None, metavar: str | None = None,
            aliases: dict[str, Any] | None = None, synonyms: tuple[str, ...] = (), **bounds: Any) -> Any:
    """Declare one setting. `choices` for plain types (enums carry their own); `aliases` are
    extra flags that set a value (e.g. Megatron's --bf16 for precision = bf16); `synonyms` are other
    names of the flag itself, taking the same value (Megatron's --expert-model-parallel-size for
    --ep), also accepted as config-file keys; `bounds`, for
    numbers, the values it accepts (config.bounds.Bounds: minimum, maximum, above, below, finite,
    at_most=another setting, fix=advice), checked by `bound_problems` before anything uses them."""
    return field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar,
                                            "aliases": aliases or {}, "synonyms": tuple(synonyms),
                                            "bounds": Bounds(**bounds)})
