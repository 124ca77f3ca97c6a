"""tools/bench_kernels.py on CPU: the timing harness (wall clock, interpreter) and its cases
(tools/tune_attention.py: tests/tools/test_tune_attention.py)."""
import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.kernels import HAVE_TRITON
from megalite.kernels.dispatch import interpreter_ready

TOOLS = Path(__file__).resolve().parents[2] / "tools"
TOOL = TOOLS / "bench_kernels.py"
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")


def test_timing_harness_writes_rows_for_every_provider(tmp_path):
    out = tmp_path / "rows.csv"
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-W", "ignore", str(TOOL), "--smoke-timing", "--ops", "rms_norm",
                             "--no-compile", "--csv", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert {(r["provider"], r["mode"]) for r in rows} >= {("megalite", "fwd"), ("megalite", "fwd+bwd"),
                                                          ("eager", "fwd"), ("eager", "fwd+bwd")}
    assert all(not r["error"] and float(r["median_ms"]) > 0 for r in rows), rows


@pytest.mark.skipif(not interpreter_ready(), reason="triton was imported in compiled mode")
def test_every_case_builds_inputs_of_its_own_shape(monkeypatch):
    """Each case's first input has the elements its shape names, whichever ops are built with it
    (a case's make_inputs once read a shape variable late and got the last-built op's)."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import bench_kernel_cases as cases_module
    ops = {"rms_norm", "layer_norm", "gelu", "swiglu", "rope", "cross_entropy", "adamw"}  # --ops names
    cases = cases_module.build_cases(ops, quick=True, device="cpu", dtype=cases_module.torch.float32,
                                     use_compile=False, smoke=True)
    assert sorted(c.op for c in cases) == sorted(ops - {"gelu"} | {"bias_gelu"})
    for case in cases:
        dims = [int("".join(ch for ch in part if ch.isdigit())) for part in case.shape.split("x")]
        expected = 1
        for dim in dims:
            expected *= dim
        assert case.make_inputs()[0].numel() == expected, (case.op, case.shape)


@pytest.mark.skipif(not interpreter_ready(), reason="triton was imported in compiled mode")
def test_each_liger_provider_calls_its_own_op(monkeypatch):
    """With liger_kernel present each case's `liger` provider calls that op's Liger function (the
    norms once called whichever Liger function was looked up last: cross entropy's)."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import bench_kernel_cases as cases_module
    monkeypatch.setattr(cases_module, "_liger", lambda name: (lambda *args, **kwargs: name))
    ops = {"rms_norm", "layer_norm", "swiglu", "cross_entropy"}
    cases = cases_module.build_cases(ops, quick=True, device="cpu", dtype=cases_module.torch.float32,
                                     use_compile=False, smoke=True)
    called = {case.op: case.providers["liger"](*case.make_inputs()) for case in cases}
    assert called == {op: f"liger_{op}" for op in ops}
