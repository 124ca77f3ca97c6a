"""Compile every measured attention tile entry for the GPU architecture it was measured on.

    TRITON_INTERPRET=0 python -m megalite.kernels.compile_tiles        # exit 1 on a failure or a spill

Each entry of `attention_tiles.MEASURED` is a (arch, head dim, dtype, causal, dropout) key with
a tile per kernel; this compiles the three kernels with those tiles for that architecture, and the
fused backward built from them (no GPU needed, as kernels/compile_check.py), and fails on a
compile error or a register spill, so a table line pasted from tools/tune_attention.py on one
Triton version is checked on ours.
"""
from __future__ import annotations

import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import attention_tiles
from .compile_check import analyse
from .compile_variants import attention_variants, specialize


def compile_measured(verbose: bool = True) -> list[str]:
    """Compile every MEASURED entry; return its problems as 'label: detail' lines."""
    problems = []
    for (arch, head_dim, dtype_name, causal, dropout), tiles in attention_tiles.MEASURED.items():
        arch_number = int(arch.removeprefix("sm_"))
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
        wanted = f"d={head_dim} causal={causal}{' dropout' if dropout else ''}"
        for variant in attention_variants(dtype, arch_number, head_dims=[head_dim], tiles=tiles):
            if not variant.label.endswith(wanted) or "delta" in variant.label:
                continue
            blocks = tuple(variant.constexprs[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1",
                                                                  "BLOCK_M2", "BLOCK_N2") if name in variant.constexprs)
            label = f"{variant.label} [{dtype_name}, {arch}] {blocks}"
            start = time.perf_counter()
            try:
                signature, constexprs, attrs = specialize(variant.kernel, dtype, variant)
                source = ASTSource(fn=variant.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
                report = analyse(triton.compile(source, target=GPUTarget("cuda", arch_number, 32),
                                                options=variant.options), arch_number)
                detail = f"spills {report.spill_bytes} bytes" if report.spill_bytes else ""
                summary = f"regs {report.registers}, smem {report.shared_bytes // 1024} KiB, mma {report.mma}"
            except Exception as exc:  # noqa: BLE001 - report every failing entry
                detail, summary = f"FAILED {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160]}", ""
            if detail:
                problems.append(f"{label}: {detail}")
            if verbose:
                print(f"  {label:64s} {detail or 'ok'} {summary} ({time.perf_counter() - start:.1f} s)", flush=True)
    return problems


def main() -> int:
    problems = compile_measured()
    print(f"{len(problems)} problem(s)" + "".join(f"\n  {p}" for p in problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
