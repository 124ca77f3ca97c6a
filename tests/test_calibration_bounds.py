"""--calibrate's bounds: bf16 only where the device has it natively (or when asked), each GEMM size
within a time budget, so the calibration ends in minutes on any CPU."""
import subprocess
import sys
from pathlib import Path

import torch

from megalite import calibration as CAL

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]


def test_sizes_stop_at_the_first_over_budget(monkeypatch):
    clock = iter(range(0, 10_000, 1))  # every perf_counter() call advances 1 s: every probe product "takes" 1 s
    monkeypatch.setattr(CAL.time, "perf_counter", lambda: float(next(clock)))
    assert CAL.affordable_sizes(CPU, torch.float32, (8, 16, 32), calls=15, size_budget_s=20.0) == (8, 16, 32)
    assert CAL.affordable_sizes(CPU, torch.float32, (32, 8, 16), calls=15, size_budget_s=10.0) == (8,)  # smallest kept


def test_gemms_measure_only_affordable_sizes(monkeypatch):
    monkeypatch.setattr(CAL, "affordable_sizes", lambda device, dtype, sizes, calls, budget: sizes[:1])
    assert set(CAL.measure_gemms(CPU, "fp32", (8, 16), rounds=1, size_budget_s=1.0)) == {8}


def test_bf16_is_measured_where_native_or_asked(monkeypatch):
    asked = []
    monkeypatch.setattr(CAL, "measure_gemms", lambda device, precision, sizes, **_: asked.append(precision) or
                        {n: 0.01 for n in sizes})
    monkeypatch.setattr(CAL, "measure_copy_gbs", lambda device: 1.0)
    monkeypatch.setattr(CAL, "measure_elementwise_gbs", lambda device: 1.0)
    monkeypatch.setattr(CAL, "measure_attention_efficiency", lambda device, precision, peak: 0.1)
    monkeypatch.setattr(CAL, "measure_allreduce", lambda ranks, device, sizes: {n: 1e-4 + n / 1e9 for n in sizes})
    monkeypatch.setattr(CAL, "measure_host_overheads", lambda: {"block": 1e-3, "microbatch": 1e-3, "step": 1e-3})
    monkeypatch.setattr(CAL, "measure_rank_slowdown", lambda counts: {1: 1.0, 2: 1.5})
    lines = []
    for native, flag, expected in ((False, None, ["fp32"]), (True, None, ["fp32", "bf16"]),
                                   (False, True, ["fp32", "bf16"]), (True, False, ["fp32"])):
        monkeypatch.setattr(CAL, "native_bf16", lambda device, native=native: native)
        asked.clear()
        profile = CAL.calibrate(quick=True, log=lines.append, bf16=flag)
        assert asked == expected and sorted(profile.peak_tflops) == sorted(expected)
    assert any("--calibrate-bf16" in line for line in lines)
    assert isinstance(CAL.native_bf16(CPU), bool)


def test_calibrate_bf16_alone_is_refused():
    done = subprocess.run([sys.executable, "tools/plan.py", "--calibrate-bf16"], cwd=ROOT, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and done.stdout == "" and len(done.stderr.splitlines()) == 1
    assert "--calibrate OUT.json" in done.stderr
