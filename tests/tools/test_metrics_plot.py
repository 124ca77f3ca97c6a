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


def test_plot_png_or_clear_error(tmp_path, monkeypatch, capsys):
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
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: one line naming the extra, exit 2
    assert plot_metrics.main([a, b, "--out", str(out)]) == 2
    assert "pip install 'megalite[plot]'" in capsys.readouterr().err


def test_every_panel_and_runs_overlaid(tmp_path):
    """lr, grad norm, validation loss, MFU and the time split drawn for two runs, PNG and SVG."""
    pytest.importorskip("matplotlib")
    records = [{"step": s, "loss": 5.0 / s, "lr": 1e-4 * s, "grad_norm": 2.0 / s, "tokens_per_sec": 1e3, "mfu": 0.3,
                "mem_peak_bytes": 2e9, "step_time_s": 1.0, "time_forward_s": 0.3, "time_backward_s": 0.4,
                "time_optimizer_s": 0.1, "exposed_dp_comm_s": 0.05, "pipeline_bubble": 0.1} for s in (1, 2, 3)]
    records += [{"step": 3, "eval_loss": 1.5, "eval_perplexity": 4.48}]
    a = write_run(tmp_path / "a" / "metrics.jsonl", records)
    b = write_run(tmp_path / "b" / "metrics.jsonl", records[:2])
    assert plot_metrics.time_split(records, ("time_forward_s", "time_backward_s", "time_optimizer_s"))[1] == \
        pytest.approx([80.0] * 3)
    assert plot_metrics.time_split(records, ("pipeline_bubble",))[1] == pytest.approx([10.0] * 3)
    for out in (tmp_path / "m.png", tmp_path / "m.svg"):
        drawn = plot_metrics.plot([a, b], ["a", "b"], str(out))
        assert drawn == ["loss", "eval_loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "mem_peak_bytes",
                         "time_split"]
        assert out.stat().st_size > 10_000
    assert (tmp_path / "m.svg").read_text().count("<g id=\"axes_") == 8  # one panel each
