"""The values a number setting accepts, declared with the setting and checked in one place.

    lr: float = setting(2e-3, "peak learning rate", minimum=0)
    min_lr: float = setting(2e-4, "...", minimum=0, at_most="lr")
    adam_beta1: float = setting(0.9, "AdamW beta1", minimum=0, below=1)

`Bounds` holds what `setting(...)` was given (every keyword optional: a plain `setting(default,
help)` accepts any value of its type, floats excepted: a float must be finite unless declared
`finite=False`). `bound_problems()` walks every declared setting of a configuration and returns
one message per value outside its bounds, naming the flag, the rule, the value and the fix. It
runs when the command line is parsed (megalite.cli.parse_args, on every rank, before anything
divides by a degree or allocates a tensor) and again in RunConfig.validate for configurations
built in Python. Tests generate the invalid values of every setting from these declarations.

Pure Python, no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Bounds:
    """A number setting's accepted values (None: no such bound). A tuple setting's bounds apply
    to each of its numbers."""

    minimum: float | None = None  # value >= minimum
    maximum: float | None = None  # value <= maximum
    above: float | None = None  # value > above
    below: float | None = None  # value < below
    finite: bool = True  # floats only: NaN and +-inf refused
    at_most: str | None = None  # another setting's name this value may not exceed (min_lr <= lr)
    fix: str | None = None  # advice appended to the message (default: the setting's default)

    def rule(self) -> str:
        """The accepted values in words, e.g. 'a finite number >= 0 and < 1'."""
        parts = [f"{op} {_shown(bound)}" for op, bound in ((">=", self.minimum), (">", self.above),
                                                            ("<=", self.maximum), ("<", self.below))
                 if bound is not None]
        return " and ".join(parts)

    def violation(self, value: Any) -> bool:
        """Whether the number `value` lies outside these bounds (the relation is checked apart)."""
        if isinstance(value, float) and self.finite and not math.isfinite(value):
            return True
        if isinstance(value, float) and math.isnan(value):
            return True  # a NaN compares false with everything: refuse it even with finite=False
        return ((self.minimum is not None and value < self.minimum)
                or (self.maximum is not None and value > self.maximum)
                or (self.above is not None and value <= self.above)
                or (self.below is not None and value >= self.below))

    @property
    def declared(self) -> bool:
        return any(b is not None for b in (self.minimum, self.maximum, self.above, self.below, self.at_most))


NO_BOUNDS = Bounds()


def _shown(number: float) -> str:
    return str(int(number)) if float(number).is_integer() and abs(number) < 1e15 else repr(number)


def bound_problems(specs: Iterable[Any], values: dict[str, Any]) -> list[str]:
    """One message per setting whose value lies outside its declared bounds or relation.

    `specs`: the declared settings (megalite.config.Setting: name, flag, type, default, bounds);
    `values`: {setting name: value} of one configuration (None: unset, not checked)."""
    specs = list(specs)
    outside = {spec.name for spec in specs if any(spec.bounds.violation(n) for n in _numbers(values[spec.name]))}
    problems = []
    for spec in specs:
        value, bounds = values[spec.name], spec.bounds
        if spec.name in outside:
            numbers = _numbers(value)
            kind = "an integer" if isinstance(numbers[0], int) else "a finite number" if bounds.finite else "a number"
            problems.append(f"{spec.flag} must be {kind} {bounds.rule()}".rstrip()
                            + f", got {_given(value)}; {_fix(spec)}")
            continue
        other = values.get(bounds.at_most) if bounds.at_most and bounds.at_most not in outside else None
        if other is not None and value is not None and value > other:
            other_flag = "--" + bounds.at_most.replace("_", "-")
            problems.append(f"{spec.flag} {_given(value)} is above {other_flag} {_given(other)}; it must be <= "
                            f"{other_flag} (lower {spec.flag} or raise {other_flag})")
    return problems


def _numbers(value: Any) -> list:
    """The numbers of a setting's value: [value], the items of a tuple, or [] (unset, not a number)."""
    items = list(value) if isinstance(value, tuple) else [value]
    return [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _given(value: Any) -> str:
    return " ".join(str(v) for v in value) if isinstance(value, tuple) else str(value)


def _fix(spec: Any) -> str:
    if spec.bounds.fix:
        return spec.bounds.fix
    if spec.default is None:
        return f"give a value {spec.bounds.rule() or 'that is finite'}, or leave {spec.flag} unset"
    return f"e.g. {spec.flag} {_given(spec.default)} (the default)"
