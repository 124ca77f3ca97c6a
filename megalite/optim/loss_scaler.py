"""Dynamic loss scaling for fp16 training.

fp16 gradients underflow for small values; multiplying the loss by `scale` before backward
shifts them into range, and the optimizer divides the (fp32 main) gradients by `scale`
again. When any gradient anywhere in the mesh overflows (inf/nan), the step is skipped on
every rank and the scale backs off; after `growth_interval` clean steps in a row it grows.

`hysteresis` (Megatron's): how many overflowing steps are tolerated before the scale
backs off; it is restored whenever the scale grows. 1 = back off at every overflow.
The caller decides whether an overflow happened (the optimizer uses the all-reduced global
gradient norm, non-finite on every rank as soon as one rank has an inf/nan).
"""
from __future__ import annotations

import torch

FLOAT32_MAX = torch.finfo(torch.float32).max


class DynamicLossScaler:
    def __init__(self, initial_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 1, min_scale: float = 1.0,
                 max_scale: float = 2.0 ** 24):
        if not 0 < initial_scale <= FLOAT32_MAX:  # NaN fails both comparisons
            raise ValueError(f"--initial-loss-scale must be > 0 and at most float32's largest {FLOAT32_MAX:.6g} (the "
                             f"loss is scaled in float32), got {initial_scale}")
        if growth_factor <= 1.0:
            raise ValueError(f"loss-scale growth factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"loss-scale backoff factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"--loss-scale-window (growth interval) must be >= 1, got {growth_interval}")
        if hysteresis < 1:
            raise ValueError(f"--hysteresis must be >= 1, got {hysteresis}")
        self.scale = float(initial_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self._clean_steps = 0
        self._hysteresis_left = self.hysteresis

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * scale: call backward on this."""
        return loss * self.scale

    def update(self, found_inf: bool) -> None:
        """Record one optimizer step: an overflow (skipped step) or a clean one."""
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis
            self.scale = min(self.max_scale, self.scale * self.growth_factor)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
