"""The kernels compile for an H100 (sm_90) with Triton's real compiler and bundled ptxas, no GPU
needed: catches what the interpreter cannot (loop-carried types, dot shapes, shared memory), and
--strict fails on code that cannot be fast (register spills; a memory-bound kernel with no
vector load, as the cross-entropy kernels had at GPT-2's odd vocab 50257 when their one loop
was masked). A representative subset here; `TRITON_INTERPRET=0 python -m megalite.kernels.compile_check`
compiles every variant (about two minutes on two cores)."""
import os
import re
import subprocess
import sys

import pytest

from megalite.kernels import HAVE_TRITON

SUBSET = ["attention fwd d=128 causal=True [bf16]", "attention dkdv d=64 causal=True [bf16]",
          "attention dq d=128 causal=False [bf16]", "cross_entropy stats V=50257 [bf16]",
          "cross_entropy grad V=50257 [bf16]", "rms_norm bwd h=4096 dsum=True [bf16]",
          "layer_norm fwd h=4096 residual=True [bf16]", "rope transposed=True [bf16]",
          "attention dkdv d=128 causal=True dropout [bf16]", "bias_dropout_add fwd dropout=True [bf16]",
          "grouped_mm dx up [bf16]", "grouped_mm dweight up [bf16]", "attention bwd_fused d=128 causal=True [bf16]"]


def _has_cuda_backend() -> bool:
    try:
        from triton.backends import backends

        return "nvidia" in backends
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(not HAVE_TRITON or not _has_cuda_backend(), reason="needs triton with its NVIDIA backend")
@pytest.mark.slow
def test_representative_kernels_compile_for_sm90(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))  # really compile, no cache
    command = [sys.executable, "-W", "ignore", "-m", "megalite.kernels.compile_check", "--arch", "90",
               "--dtypes", "bfloat16", "--strict", "--only", *SUBSET]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count(" ok (") == len(SUBSET), result.stdout
    # the grouped GEMM's loops run on the tensor cores (wgmma) with asynchronous, pipelined loads
    # report row: label, regs, spill, smem, ld vec/scal, mma, async, apx, verdict
    gemm_rows = re.findall(r"^\s+(grouped_mm \S+ up \[bf16\])\s+\d+\s+\d+\s+[\d.]+\s+\d+/\d+\s+(\d+)\s+(\d+)",
                           result.stdout, re.MULTILINE)
    assert len(gemm_rows) == 2 and all(int(mma) > 0 and int(copies) > 0 for _, mma, copies in gemm_rows), \
        result.stdout
    # so do the fused attention backward's (one kernel holding the dK/dV and dQ programs)
    row = r"^\s+attention bwd_fused d=128 causal=True \[bf16\]\s+\d+\s+0\s+[\d.]+\s+\d+/\d+\s+(\d+)\s+(\d+)"
    fused = re.findall(row, result.stdout, re.MULTILINE)
    assert len(fused) == 1 and int(fused[0][0]) > 0 and int(fused[0][1]) > 0, result.stdout


# every norm kernel at a training shape, both flags: rows of compile_check's report
NORM_LABELS = ["rms_norm fwd h=4096", "rms_norm bwd h=4096", "layer_norm fwd h=4096", "layer_norm bwd h=4096"]


@pytest.mark.slow  # 5 s of compiling
@pytest.mark.skipif(not HAVE_TRITON or not _has_cuda_backend(), reason="needs triton with its NVIDIA backend")
def test_norm_statistics_compile_to_correctly_rounded_sqrt_and_division(tmp_path):
    """Compiled `/` and tl.sqrt on fp32 are approximate on NVIDIA GPUs (div.full.f32: 2 ulp;
    sqrt.approx.ftz.f32), while the interpreter rounds exactly: at small variance rstd ~ 700
    amplifies their ulps into the input gradient (test_layer_norm_custom_eps_matters failed on an
    H200). The norms' PTX must hold no approximate fp32 sqrt or division at all."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    command = [sys.executable, "-W", "ignore", "-m", "megalite.kernels.compile_check", "--arch", "90",
               "--dtypes", "bfloat16", "float32", "--strict", "--only", *NORM_LABELS]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    # report row: label, regs, spill, smem, ld vec/scal, mma, async, apx, verdict
    rows = re.findall(r"^\s+((?:rms|layer)_norm \S+ h=4096 \S+ \[\w+\]).*\s\d+/\d+\s+\d+\s+\d+\s+(\d+)\s+(ok|WARN)",
                      result.stdout, re.MULTILINE)
    assert len(rows) == 16, result.stdout[-3000:] + result.stderr[-3000:]  # 2 norms x fwd/bwd x 2 flags x 2 dtypes
    assert [(label, int(approximate)) for label, approximate, _ in rows if int(approximate)] == [], result.stdout
    assert result.returncode == 0, result.stdout[-3000:]
