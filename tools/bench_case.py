"""One case of tools/bench_kernels.py: an (op, shape), its inputs, its providers and the units its
passes move. Its own module so the dense cases (bench_kernel_cases.py) and the MoE ones
(bench_moe_kernel_cases.py) both build it without importing each other."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Case:
    op: str
    shape: str
    make_inputs: Callable[[], list]  # fresh inputs; floating ones require grad when differentiable
    providers: dict[str, Callable]
    fwd_units: float  # bytes moved (memory-bound ops) or FLOPs (attention) by the forward
    fwd_bwd_units: float
    flops: bool = False  # units are FLOPs (report TFLOP/s vs matmul) instead of bytes (GB/s vs copy)
    differentiable: bool = True
    extra: dict = field(default_factory=dict)
    memory_bytes: float = 0.0  # peak device memory of its hungriest provider; 0: not estimated

    @property
    def modes(self) -> tuple[str, ...]:
        return ("fwd", "fwd+bwd") if self.differentiable else ("step",)
