"""Compile every kernel ahead of time for a GPU architecture, on a machine without a GPU, and
report what the machine code says about speed. What it compiles (every kernel's variants as
the CUDA launchers configure them, with the arguments of a training-shaped call) is
kernels/compile_variants.py.

The interpreter checks what the kernels compute, not whether Triton's compiler accepts them
(loop-carried types, dot shapes, shared memory per block) nor what code it makes of them.
`triton.compile` with an explicit GPUTarget lowers each kernel to a cubin with the bundled
ptxas, no GPU needed, using the block sizes and warps the launchers pick on CUDA and the
argument specialisation Triton's launcher would apply to a training-shaped call (an integer
divisible by 16 and a 16-byte-aligned pointer are marked so, an integer equal to 1 becomes a
constant: this decides whether loads are vectorised). Each variant then reports:

    regs   registers per thread (ptxas -v)      spill  bytes spilled to local memory
    smem   shared memory per program             ld     16-byte vector / scalar global loads
    mma    tensor-core instructions: wgmma.mma_async (sm_90) and mma.sync (sm_80)
    async  asynchronous copies to shared memory (cp.async / TMA): loads software-pipelined
    apx    approximate fp32 square roots and divisions (sqrt.approx, div.full ...: tl.sqrt, `/`)

and warns where the code cannot be fast: any spill, a memory-bound kernel without a single
vector load (it cannot reach copy bandwidth), or a tensor-core kernel whose loads are not
pipelined (each block's loads would stall its dots); and where it is not exact enough: an
approximate instruction in a kernel whose statistics must be correctly rounded (the norms).
Run it from the command line:

    TRITON_INTERPRET=0 python -m megalite.kernels.compile_check            # sm_90 (H100)
    TRITON_INTERPRET=0 python -m megalite.kernels.compile_check --arch 80  # A100
    ... --strict                                                          # warnings fail too

Needs triton imported in compiled mode: without a GPU, `megalite.kernels` imports triton in
interpreter mode unless TRITON_INTERPRET is set explicitly, hence the =0.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# The package's __init__ (run before this module) has imported triton through dispatch, in the
# mode TRITON_INTERPRET asks for; compile_all refuses an interpreter-mode one.
from .compile_variants import TRITON_DTYPES, kernel_variants, specialize
from .dispatch import interpreter_ready


@dataclass
class Report:
    registers: int | None
    spill_bytes: int | None
    shared_bytes: int
    vector_loads: int
    scalar_loads: int
    mma: int  # tensor-core instructions: wgmma.mma_async (Hopper) + mma.sync (Ampere)
    async_copies: int
    approximate: int = 0  # approximate fp32 square roots / divisions (APPROXIMATE_FP32)

    def warnings(self, memory_bound: bool, exact_math: bool = False) -> list[str]:
        found = []
        if exact_math and self.approximate:
            found.append(f"{self.approximate} approximate fp32 sqrt/division instruction(s) in statistics that must "
                         "be correctly rounded: use tl.sqrt_rn / tl.div_rn")
        if self.spill_bytes:
            found.append(f"spills {self.spill_bytes} bytes to local memory")
        # Counted per instruction, not per execution: a masked tail block may load scalar (its
        # bound is odd) and per-row scalars (a target id, an lse) are scalar by nature, but a
        # memory-bound kernel with no vector load at all streams its data one element at a time.
        if memory_bound and self.vector_loads == 0:
            found.append(f"data loads are scalar ({self.vector_loads} vector, {self.scalar_loads} scalar loads): "
                         "cannot reach copy bandwidth")
        if self.mma and not self.async_copies:
            found.append("tensor-core loops without asynchronous copies: loads are not software-pipelined")
        return found


def _ptxas_report(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """(registers, spill-store bytes) from `ptxas -v` on the PTX; (None, None) if it cannot run."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # in the try: a triton without its NVIDIA backend

        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
            source.write(ptx)
            source.flush()
            gpu_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
            result = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu_name}", source.name, "-o",
                                     "/dev/null"], capture_output=True, text=True, timeout=120)
    except Exception:  # noqa: BLE001 - another triton layout: report what the PTX alone says
        return None, None
    registers = re.search(r"Used (\d+) registers", result.stderr)
    spills = re.search(r"(\d+) bytes spill stores", result.stderr)
    return (int(registers.group(1)) if registers else None, int(spills.group(1)) if spills else None)


# fp32 square roots and divisions with an IEEE-rounded twin (sqrt.rn, div.rn), as compiled Triton
# emits them for tl.sqrt / tl.rsqrt / `/` (div.full.f32: 2 ulp). ex2/lg2 have no exact twin: not counted.
APPROXIMATE_FP32 = re.compile(r"\b(?:sqrt\.approx|rsqrt\.approx|rcp\.approx|div\.approx|div\.full)(?:\.ftz)?\.f32\b")


def analyse(compiled, arch: int) -> Report:
    ptx = compiled.asm["ptx"]
    loads = re.findall(r"ld\.global(?:\.[a-z0-9]+)*", ptx)
    vector = sum(1 for op in loads if ".v2." in op or ".v4." in op or op.endswith((".v2", ".v4")))
    registers, spills = _ptxas_report(ptx, arch)
    tensor_core = ptx.count("wgmma.mma_async") + ptx.count("mma.sync.aligned")
    return Report(registers, spills, compiled.metadata.shared, vector, len(loads) - vector, tensor_core,
                  len(re.findall(r"cp\.async\.(?:ca|cg|bulk)", ptx)), len(APPROXIMATE_FP32.findall(ptx)))


def compile_all(arch: int = 90, dtypes=(torch.bfloat16, torch.float32), verbose: bool = True,
                only: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """Compile every variant (or those whose label contains one of `only`); return
    (failures, warnings) as 'label: detail' lines."""
    if interpreter_ready():
        raise RuntimeError("triton was imported in interpreter mode; run the compile check in a fresh process "
                           "with TRITON_INTERPRET=0")
    target = GPUTarget("cuda", arch, 32)
    failures, warnings = [], []
    if verbose:
        print(f"  {'variant':52s} {'regs':>4s} {'spill':>5s} {'smem KiB':>8s} {'ld vec/scal':>11s} {'mma':>4s} "
              f"{'async':>5s} {'apx':>3s}")
    for dtype in dtypes:
        for variant in kernel_variants(dtype, arch):
            label = f"{variant.label} [{TRITON_DTYPES[dtype]}]"
            if only and not any(part in label for part in only):
                continue
            start = time.perf_counter()
            try:
                signature, constexprs, attrs = specialize(variant.kernel, dtype, variant)
                source = ASTSource(fn=variant.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
                report = analyse(triton.compile(source, target=target, options=variant.options), arch)
            except Exception as exc:  # noqa: BLE001 - collect every failure, then report
                detail = f"FAILED {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
                failures.append(f"{label}: {detail}")
                if verbose:
                    print(f"  {label:52s} {detail}", flush=True)
                continue
            problems = report.warnings(variant.memory_bound, variant.exact_math)
            warnings.extend(f"{label}: {problem}" for problem in problems)
            if verbose:
                print(f"  {label:52s} {report.registers or '?':>4} {report.spill_bytes if report.spill_bytes is not None else '?':>5} "
                      f"{report.shared_bytes / 1024:8.1f} {report.vector_loads:>5d}/{report.scalar_loads:<5d} "
                      f"{report.mma:>4d} {report.async_copies:>5d} {report.approximate:>3d}  "
                      f"{'ok' if not problems else 'WARN ' + '; '.join(problems)} "
                      f"({time.perf_counter() - start:.1f} s)", flush=True)
    return failures, warnings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description="Compile every megalite kernel for a GPU target, no GPU needed")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10: 80 (A100), 90 (H100)")
    parser.add_argument("--only", nargs="*", default=(), help="compile only variants whose label contains one")
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"], choices=["bfloat16", "float16",
                                                                                         "float32"])
    parser.add_argument("--strict", action="store_true", help="warnings (spills, scalar loads) fail too")
    args = parser.parse_args(argv)
    failures, warnings = compile_all(args.arch, tuple(getattr(torch, d) for d in args.dtypes),
                                     only=tuple(args.only))
    print(f"sm_{args.arch}: {'all kernels compiled' if not failures else f'{len(failures)} failed to compile'}"
          f", {len(warnings)} warning(s)")
    for line in warnings:
        print(f"  warning: {line}")
    return 1 if failures or (args.strict and warnings) else 0


if __name__ == "__main__":
    sys.exit(main())
