"""tools/bench_attention.py: the ratio is the faster SDPA over ours at each shape, the GOAL line names the
lowest and the geometric mean, and the script runs end to end on CPU (interpreter, --smoke)."""
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _load(name, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # gone again after the test
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what importing the tools would set for good without a GPU
    _load("tune_attention", monkeypatch)  # the module bench_attention imports, from sys.modules
    return _load("bench_attention", monkeypatch)


def test_ratio_is_the_faster_sdpa_over_ours_and_the_goal_names_the_lowest(bench):
    table = {128: {1024: {"triton": 2.0, "sdpa": 1.9, "sdpa_gqa": 1.5}, 4096: {"triton": 5.0, "sdpa": 4.0}},
             64: {1024: {"triton": 1.0, "sdpa_gqa": 1.25}, 2048: {"sdpa": 3.0}}}  # ours failed at 2048: no row
    rows = bench.ratios(table)
    assert rows == [(128, 1024, 0.75), (128, 4096, 0.8), (64, 1024, 1.25)]
    table[128][1024]["triton_fused"] = 1.5  # the fused backward's row, where it ran
    assert bench.ratios(table, "triton_fused") == [(128, 1024, 1.0)]
    line = bench.goal_line(rows, "bf16")
    geomean = math.exp((math.log(0.75) + math.log(0.8) + math.log(1.25)) / 3)
    assert line.startswith("GOAL bench_attention bf16: ours fwd+bwd >= 1.0x")
    assert f"measured lowest 0.75x (d=128 s=1024), geomean {geomean:.2f}x over 3 shapes | NOT met" in line
    assert bench.goal_line([(64, 1024, 1.0)], "x").endswith("| met")
    assert bench.goal_line([], "x").endswith("NOT met")


@pytest.mark.slow
def test_smoke_run_prints_its_goal():
    result = subprocess.run([sys.executable, str(TOOLS / "bench_attention.py"), "--smoke"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("GOAL bench_attention smoke:")]
