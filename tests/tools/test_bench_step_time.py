"""tools/bench_step_time.py: Narayanan et al.'s iteration times from Table 1 and the planner's beside them."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "bench_step_time.py"
_spec = importlib.util.spec_from_file_location("bench_step_time", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_step_time"] = bench
_spec.loader.exec_module(bench)


def test_narayanan_rows_paper_times_and_predictions(capsys):
    rows = bench.narayanan("A100-80GB")
    assert [r["params_billions"] for r in rows] == [1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1, 529.6, 1008.0]
    # 1T: F = 96 B s l h^2 (1 + s/6h + V/16lh) = 5.138e19 FLOPs over 3072 GPUs at 163 TFLOP/s
    assert rows[-1]["paper_s"] == pytest.approx(96 * 3072 * 2048 * 128 * 25600 ** 2 * (1 + 2048 / (6 * 25600) + 51200 / (
        16 * 128 * 25600)) / (3072 * 163e12))
    for r in rows:
        parts = r["breakdown"]
        assert r["predicted_s"] == parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
        assert r["ratio"] == pytest.approx(r["predicted_s"] / r["paper_s"])
    assert rows[-1]["breakdown"]["bubble"] > 0 and rows[3]["breakdown"]["tp"] > 0 and rows[0]["breakdown"]["tp"] == 0
    bench.print_narayanan(rows, "A100-80GB")
    assert "rows within 10%" in capsys.readouterr().out


def test_h200_rows_print_predicted_against_measured(capsys, monkeypatch):
    bench.h200()
    out = capsys.readouterr().out
    assert [name for name, *_ in bench.H200_RUNS if name in out] == [name for name, *_ in bench.H200_RUNS]
    assert "measured  133.0 ms" in out and "with Triton attention" in out
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.measure_gpu(5, pathlib.Path("unused"))
