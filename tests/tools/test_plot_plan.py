"""tools/plan.py --plot (tools/plot_plan.py): the planner's per-stage memory and --suggest's candidates drawn."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from megalite.config import RunConfig
from megalite.plan import estimate
from megalite.plan.ranking import Suggestion

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plot_plan, plan = _load("plot_plan"), _load("plan")
CFG = RunConfig.build(model="gpt2-350m", tp=2, pp=4, dp=2, micro_batch_size=2, global_batch_size=16,
                      precision="bf16").resolved(16, 50257)


def test_stage_breakdown_is_the_planners():
    model = CFG.gpt_config()
    rows = plot_plan.stage_breakdown(model, CFG)
    est = estimate(model, CFG)
    totals = [sum(row[part] for part, _ in plot_plan.PARTS) for row in rows]
    assert totals == est.stage_totals  # the same numbers estimate() takes its worst stage from
    worst = rows[est.stage]
    assert (worst["parameters"], worst["gradients"], worst["optimizer state"], worst["activations"],
            worst["buffers"]) == (est.param_bytes, est.grad_bytes, est.optimizer_state_bytes, est.activation_bytes,
                                  est.buffer_bytes)
    assert est.buffer_bytes > 0
    assert sum(row["layers"] for row in rows) == model.num_layers


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_layout_and_candidates_pictures(tmp_path, suffix):
    pytest.importorskip("matplotlib")
    model = CFG.gpt_config()
    out = tmp_path / f"memory.{suffix}"
    titles = plot_plan.plot_layout(model, CFG, str(out), gpu_memory=80e9)
    assert titles[0].startswith("memory per rank: tp 2, pp 4, dp 2") and out.stat().st_size > 10_000
    other = CFG.replace(zero=1)
    found = [Suggestion(c, estimate(model, c), t, "") for c, t in ((CFG, 1.0), (other, 1.2))]
    out = tmp_path / f"candidates.{suffix}"
    assert plot_plan.plot_candidates(found, str(out), 80e9) == ["step time (best first)",
                                                                 "memory per rank (worst stage)"]
    if suffix == "svg":
        text = out.read_text()
        assert "tp2 pp4 dp2 z0" in text and "tp2 pp4 dp2 z1" in text and text.count('<g id="axes_') == 2


def test_plan_plot_flag(tmp_path, monkeypatch, capsys):
    argv = ["--model", "gpt2-350m", "--tp", "2", "--pp", "2", "--dp", "2", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--plot", str(tmp_path / "m.png"), "--print-schedule"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: one line, exit 2, before the work
    assert plan.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "megalite[plot]" in err[0]
    monkeypatch.undo()  # matplotlib (if installed) back as it was
    pytest.importorskip("matplotlib")
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    # the drawn timeline's bubble is the planner's (p-1)/(m+p-1) for 4 microbatches
    assert "schedule 1f1b: pp 2, 4 microbatches" in out and "pipeline bubble: 20.0%" in out and "\nbubble 20.0%" in out
    assert (tmp_path / "m.png").stat().st_size > 10_000
