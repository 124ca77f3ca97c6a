"""A JSON value checked against the annotation of the dataclass field it is meant for.

`field_problem("memory_bandwidth_gbs", "float", "fast")` says, in one line, what is wrong with a value a
user wrote into a JSON file (a hardware profile, plan/hardware.py), so the loader can refuse it before
the dataclass is built; tables (tuples of typed rows) are checked cell by cell. Pure, no torch.
"""
from __future__ import annotations

_WORDS = {"float": "a number", "int": "an integer", "bool": "true or false", "str": "a string"}


def field_problem(name: str, kind: str | None, value) -> str | None:
    """'memory_bandwidth_gbs takes a number, got "fast"' for a JSON value of the wrong type, or None.
    kind: the field's annotation as written (`float`, `int | None`, ...); tables are checked as they are read."""
    if kind is None:
        return None
    optional = kind.endswith("| None")
    base = kind.removesuffix("| None").strip()
    if value is None:
        return None if optional else f"{name} takes {_WORDS.get(base, base)}, got null"
    if base == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return f"{name} takes a number, got {value!r}"
    if base == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{name} takes an integer, got {value!r}"
    if base in ("bool", "str") and not isinstance(value, {"bool": bool, "str": str}[base]):
        return f"{name} takes {_WORDS[base]}, got {value!r}"
    if base.startswith("tuple[tuple[") and base.endswith("], ...]"):  # a table: rows of typed columns
        columns = base[len("tuple[tuple["):-len("], ...]")].split(", ")
        rows = value if isinstance(value, list) else [None]
        if any(not isinstance(row, list) or len(row) != len(columns)
               or any(field_problem(name, column, cell) for column, cell in zip(columns, row)) for row in rows):
            return f"{name} takes a list of rows [{', '.join(columns)}], got {value!r}"
        return None
    if base.startswith("dict[str, float]") and not (isinstance(value, dict) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values())):
        return f"{name} takes an object of numbers (e.g. {{\"bf16\": 312.0}}), got {value!r}"
    return None

