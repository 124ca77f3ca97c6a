"""tools/plot_schedule.py and megalite.pipeline.timeline: the verified schedule in time, as text and as a picture."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

from megalite.pipeline.schedules import verified_schedule
from megalite.pipeline.timeline import bubble_of, schedule_timeline, text_timeline

_PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "plot_schedule.py"
_spec = importlib.util.spec_from_file_location("plot_schedule", _PATH)
plot_schedule = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_schedule)


@pytest.mark.parametrize("name, pp, m, v, expected", [
    ("1f1b", 4, 8, 1, 3 / 11), ("gpipe", 3, 5, 1, 2 / 7), ("interleaved", 4, 8, 2, 3 / 19)])
def test_timeline_bubble_is_the_textbook_one(name, pp, m, v, expected):
    """(p-1)/(m+p-1) for 1F1B and GPipe, (p-1)/(v*m+p-1) interleaved, whatever a backward costs."""
    for backward in (1.0, 2.0):
        blocks = plot_schedule.timeline_for(name, pp, m, v, backward)
        assert bubble_of(blocks, pp) == pytest.approx(expected)
        compute = [b for b in blocks if not b.is_transfer]
        assert len(compute) == 2 * pp * v * m  # every forward and backward, once
        for stage in range(pp):  # a stage runs one instruction at a time
            mine = sorted((b.start, b.end) for b in compute if b.stage == stage)
            assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:]))


def test_print_schedule_shows_instructions_and_timeline(capsys):
    assert plot_schedule.main(["--schedule", "zb-h1", "--pp", "2", "--microbatches", "3", "--print-schedule"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("stage 0: F0.0 [>a0.0]") and out[3].startswith("stage 0: F0.0 F0.1")
    assert "b0.0" in out[3] and "w0.0" in out[3] and out[-1].startswith("bubble ")
    ops = [list(s) for s in verified_schedule("1f1b", 2, 2)]
    assert text_timeline(schedule_timeline(ops, 2, 1), 2).splitlines()[1] == \
        "stage 1: .... F0.0 B0.0      F0.1 B0.1      .... ...."


def test_bad_arguments_are_one_line(capsys):
    assert plot_schedule.main(["--schedule", "interleaved", "--pp", "4", "--microbatches", "3",
                               "--virtual-stages", "2"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_picture_has_every_kind(tmp_path, suffix):
    pytest.importorskip("matplotlib")
    out = tmp_path / f"zb.{suffix}"
    assert plot_schedule.main(["--schedule", "zb-h1", "--pp", "4", "--microbatches", "6", "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    blocks = plot_schedule.timeline_for("zb-h1", 4, 6, 1, 2.0)
    legend = plot_schedule.draw(blocks, 4, 1, "zb-h1", str(out))
    assert legend == ["forward", "input gradient (B)", "weight gradient (W)", "send activation",
                      "receive activation", "send gradient", "receive gradient", "idle (bubble)"]
    if suffix == "svg":
        text = out.read_text()
        assert all(f"stage {s}" in text for s in range(4)) and "bubble 14.3%" in text
