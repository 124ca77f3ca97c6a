"""tools/bench_moe.py: the measured token traffic equals the planner's, at ep 1 and 2, both dispatchers."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "bench_moe.py"
_spec = importlib.util.spec_from_file_location("bench_moe", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_moe"] = bench
_spec.loader.exec_module(bench)


def test_bench_moe_rows_measure_what_the_planner_says(capsys):
    args = bench.argparse.Namespace(hidden=32, experts=4, expert_ffn=32, topk=2, tokens=64, ep=[1, 2], steps=1)
    rows = bench.measure(args)
    assert [(r["ep"], r["dispatcher"]) for r in rows] == [(1, "alltoall"), (2, "alltoall"), (2, "allgather")]
    assert rows[0]["bytes"] == {}
    for r in rows[1:]:
        assert r["bytes"] and all(measured == pytest.approx(planned) for measured, planned in r["bytes"].values())
        assert r["moe_s"] > 0 and r["dense_s"] > 0 and r["imbalance"] >= 1.0
    bench.print_rows(args, rows)
    assert "ep/all_to_all" in capsys.readouterr().out
