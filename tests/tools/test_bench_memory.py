"""tools/bench_memory.py: measured saved-activation bytes per layer equal the planner's, for each of
Korthikanti et al.'s six techniques, and sit at or below the paper's formulas (Table 2)."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

from megalite.model.activation_probe import probe_config

_PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "bench_memory.py"
_spec = importlib.util.spec_from_file_location("bench_memory", _PATH)
bench_memory = importlib.util.module_from_spec(_spec)
sys.modules["bench_memory"] = bench_memory  # its dataclasses look their module up
_spec.loader.exec_module(bench_memory)


def test_measured_bytes_equal_the_planners_for_every_technique(capsys):
    """bf16, dropout 0.1, s=128 b=2 h=64 a=4, tp=2 (a forked gloo world) where TP is used; the
    Triton path with launches skipped (the PyTorch path keeps the same bytes: tests/model)."""
    rows = bench_memory.memory_table(probe_config(), seq=128, batch=2, tp=2, precision="bf16", backend="triton")
    assert [r.technique for r in rows] == ["no parallelism", "tensor parallel (baseline)", "tensor + sequence parallel",
                                           "tensor parallel + selective recompute",
                                           "tensor + sequence parallel + selective recompute", "full recompute"]
    for row in rows:
        assert row.measured_bytes == row.planner_bytes, (row.technique, row.measured_bytes, row.planner_bytes)
        assert row.measured_bytes <= row.paper_bytes, row.technique
    # Table 2 at this shape (5as/h = 40): 34+40, 10+(24+40)/2, (34+40)/2, 10+24/2, 34/2, 2 (x sbh)
    assert [row.paper_bytes / row.sbh for row in rows] == [74, 42, 37, 22, 17, 2]
    bench_memory.print_table(rows, "header")
    printed = capsys.readouterr().out
    assert "header" in printed and printed.count("1.000") >= 6  # measured / planner in every row
