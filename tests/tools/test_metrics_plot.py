"""tools/plot_metrics.py: reading metrics files, and a clear error (or a PNG) depending on matplotlib."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "plot_metrics.py"
_spec = importlib.util.spec_from_file_location("plot_metrics", _PATH)
plot_metrics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_metrics)


def write_run(path: pathlib.Path, records: list[dict], torn_tail: bool = False) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(text + ('{"step": 9, "lo' if torn_tail else ""))
    return str(path)


RECORDS = [{"step": s, "loss": 5.0 / s, "tokens_per_sec": 1000.0 * s, "mem_peak_bytes": 2e9} for s in (1, 2, 3)]


def test_load_and_series(tmp_path):
    path = write_run(tmp_path / "a" / "metrics.jsonl", RECORDS + [{"step": 2, "loss": 9.0}], torn_tail=True)
    records = plot_metrics.load_metrics(path)
    assert len(records) == 4  # the torn last line of a run still writing is skipped
    assert plot_metrics.series(records, "loss") == ([1, 2, 3], [5.0, 9.0, 5.0 / 3])  # a resumed step: last wins
    assert plot_metrics.series(records, "tokens_per_sec", 1e-3) == ([1, 2, 3], [1.0, 2.0, 3.0])
    assert plot_metrics.series(records, "mfu") == ([], [])
    assert plot_metrics.smoothed([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert plot_metrics.smoothed([1.0, 3.0], 1) == [1.0, 3.0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n{}\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        plot_metrics.load_metrics(str(bad))


def test_plot_png_or_clear_error(tmp_path, monkeypatch):
    a = write_run(tmp_path / "tp2" / "metrics.jsonl", RECORDS)
    b = write_run(tmp_path / "pp2" / "metrics.jsonl", RECORDS[:2])
    out = tmp_path / "curves.png"
    try:
        import matplotlib  # noqa: F401
        have_matplotlib = True
    except ImportError:
        have_matplotlib = False
    if have_matplotlib:
        assert plot_metrics.main([a, b, "--out", str(out)]) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        plot_metrics.main([a, b, "--out", str(out)])
