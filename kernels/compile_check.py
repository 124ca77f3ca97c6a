"""Compile every kernel ahead of time for a GPU architecture, on a machine without a GPU.

The interpreter checks what the kernels compute, not whether Triton's compiler accepts them
(loop-carried types, dot shapes, shared memory per block). `triton.compile` with an explicit
GPUTarget lowers each kernel to a cubin with the bundled ptxas, no GPU needed, using the same
block sizes and warps the launchers pick on CUDA. Run it from the command line:

    TRITON_INTERPRET=0 python -m megalite.kernels.compile_check            # sm_90 (H100)
    TRITON_INTERPRET=0 python -m megalite.kernels.compile_check --arch 80  # A100

Needs triton imported in compiled mode: without a GPU, `megalite.kernels` imports triton in
interpreter mode unless TRITON_INTERPRET is set explicitly, hence the =0.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

import torch

FP32_POINTERS = {"RSTD", "MEAN", "DW_PARTIAL", "DB_PARTIAL", "STATS", "LSE", "DLOSS", "DELTA", "PARAM", "EXP_AVG",
                 "EXP_AVG_SQ"}
FLOAT_SCALARS = {"eps", "scale_log2", "softmax_scale", "decay_factor", "one_minus_beta1", "beta2", "step_size",
                 "bias_correction2_sqrt"}
TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _signature(kernel, dtype: torch.dtype) -> dict:
    signature = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name == "TARGETS":
            signature[name] = "*i64"
        elif name.isupper():
            signature[name] = "*fp32" if name in FP32_POINTERS else f"*{TRITON_DTYPES[dtype]}"
        else:
            signature[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return signature


def kernel_variants(dtype: torch.dtype):
    """(label, kernel, constexprs, options) for every kernel as the CUDA launchers configure it."""
    # the package re-exports functions under the modules' names (rms_norm, rope...): import modules
    adamw, cross_entropy, flash_attention, gelu, layer_norm, rms_norm, rope, swiglu = (
        importlib.import_module(f"{__package__}.{name}") for name in
        ("adamw", "cross_entropy", "flash_attention", "gelu", "layer_norm", "rms_norm", "rope", "swiglu"))

    cuda = torch.device("cuda")
    for hidden in (4096, 8192):
        block, warps = rms_norm._launch_config(hidden)
        for flag in (False, True):
            opts = {"num_warps": warps}
            yield f"rms_norm fwd h={hidden} residual={flag}", rms_norm._rms_norm_forward_kernel, \
                dict(HAS_RESIDUAL=flag, BLOCK=block), opts
            yield f"rms_norm bwd h={hidden} dsum={flag}", rms_norm._rms_norm_backward_kernel, \
                dict(HAS_DSUM=flag, BLOCK=block), opts
            yield f"layer_norm fwd h={hidden} residual={flag}", layer_norm._layer_norm_forward_kernel, \
                dict(HAS_RESIDUAL=flag, BLOCK=block), opts
            yield f"layer_norm bwd h={hidden} dsum={flag}", layer_norm._layer_norm_backward_kernel, \
                dict(HAS_DSUM=flag, BLOCK=block), opts
    for flag in (False, True):
        yield f"gelu fwd bias={flag}", gelu._gelu_forward_kernel, dict(HAS_BIAS=flag, BLOCK=gelu.BLOCK), {"num_warps": 4}
        yield f"gelu bwd bias={flag}", gelu._gelu_backward_kernel, dict(HAS_BIAS=flag, BLOCK=gelu.BLOCK), \
            {"num_warps": 4}
    yield "swiglu fwd", swiglu._swiglu_forward_kernel, dict(BLOCK=swiglu.BLOCK), {"num_warps": 4}
    yield "swiglu bwd", swiglu._swiglu_backward_kernel, dict(BLOCK=swiglu.BLOCK), {"num_warps": 4}
    for transposed in (False, True):
        yield f"rope transposed={transposed}", rope._rope_kernel, \
            dict(TRANSPOSED=transposed, BLOCK_H=32, BLOCK_HALF=64), {"num_warps": 4}
    block_v = cross_entropy._block_v(128256, cuda)
    yield "cross_entropy stats", cross_entropy._softmax_stats_kernel, dict(BLOCK_V=block_v), {"num_warps": 8}
    yield "cross_entropy grad", cross_entropy._softmax_grad_kernel, dict(BLOCK_V=block_v), {"num_warps": 8}
    for head_dim in flash_attention.SUPPORTED_HEAD_DIMS:
        cfg = flash_attention._config(head_dim, cuda, dtype)
        opts = {"num_warps": cfg["warps"], "num_stages": cfg["stages"]}
        for causal in (True, False):
            common = dict(CAUSAL=causal, HEAD_DIM=head_dim, DOT_PRECISION=cfg["precision"])
            for stage, kernel in (("fwd", flash_attention._attention_forward_kernel),
                                  ("dkdv", flash_attention._attention_dkdv_kernel),
                                  ("dq", flash_attention._attention_dq_kernel)):
                block_m, block_n = cfg[stage]
                yield f"attention {stage} d={head_dim} causal={causal}", kernel, \
                    dict(common, BLOCK_M=block_m, BLOCK_N=block_n), opts
        yield f"attention delta d={head_dim}", flash_attention._attention_delta_kernel, \
            dict(HEAD_DIM=head_dim, BLOCK_M=cfg["dq"][0]), {}
    yield "adamw", adamw._adamw_kernel, dict(BLOCK=adamw.BLOCK), {"num_warps": 8}


def compile_all(arch: int = 90, dtypes=(torch.bfloat16, torch.float32), verbose: bool = True,
                only: tuple[str, ...] = ()) -> list[str]:
    """Compile every variant (or those whose label contains one of `only`); return the failures
    as 'label: error' lines (empty: all compiled)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.interpreter import InterpretedFunction

    from .dispatch import tl

    if isinstance(tl.standard.sum, InterpretedFunction):
        raise RuntimeError("triton was imported in interpreter mode; run the compile check in a fresh process "
                           "with TRITON_INTERPRET=0")
    target = GPUTarget("cuda", arch, 32)
    failures = []
    for dtype in dtypes:
        for label, kernel, constexprs, options in kernel_variants(dtype):
            label = f"{label} [{TRITON_DTYPES[dtype]}]"
            if only and not any(part in label for part in only):
                continue
            start = time.perf_counter()
            try:
                source = ASTSource(fn=kernel, signature=_signature(kernel, dtype), constexprs=constexprs)
                compiled = triton.compile(source, target=target, options=options)
                detail = f"ok  shared {compiled.metadata.shared / 1024:6.1f} KiB, " \
                         f"{time.perf_counter() - start:5.1f} s"
            except Exception as exc:  # noqa: BLE001 - collect every failure, then report
                detail = f"FAILED {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
                failures.append(f"{label}: {detail}")
            if verbose:
                print(f"  {label:52s} {detail}", flush=True)
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Compile every megalite kernel for a GPU target, no GPU needed")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10: 80 (A100), 90 (H100)")
    parser.add_argument("--only", nargs="*", default=(), help="compile only variants whose label contains one")
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"], choices=["bfloat16", "float16",
                                                                                         "float32"])
    args = parser.parse_args(argv)
    failures = compile_all(args.arch, tuple(getattr(torch, d) for d in args.dtypes), only=tuple(args.only))
    print(f"sm_{args.arch}: {'all kernels compiled' if not failures else f'{len(failures)} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
