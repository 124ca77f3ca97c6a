"""What a user notices (issue 49, item 14): the planner takes the GPU's memory from --hardware, the
converter's help shows every way and import takes --load, mock data names what a run reads, the fp16
line carries the loss scale and skipped steps, an unchanged batch is not a change, a one-point curve is
drawn, an empty split is noted once, and the Liger comparison has its extra."""
import contextlib
import importlib.util
import io
import json
import pathlib
import warnings

import pytest

from megalite.checkpoint.elastic import Resize
from megalite.data.gpt_dataset import build_gpt_datasets
from megalite.training import loop
from megalite.training.metrics import progress_line

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(main, argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_suggest_takes_the_gpu_memory_from_the_hardware_profile():
    from megalite.tools.plan import main as plan_main

    code, out, err = _run(plan_main, ["--model", "tiny", "--suggest", "--gpus", "2", "--hardware", "H200", "--json"])
    assert code == 0 and "--gpu-memory" not in err, err
    assert json.loads(out)  # layouts that fit 141 GB
    code, _, err = _run(plan_main, ["--model", "tiny", "--suggest", "--gpus", "2"])
    assert code == 2 and "or a --hardware profile that names it" in err, err


@pytest.mark.slow  # imports the converter (transformers) and runs its import
def test_convert_help_shows_the_torch_formats_and_import_takes_load(tmp_path):
    from megalite.tools.convert_checkpoint import main as convert_main

    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        convert_main(["--help"])
    assert "--to {dcp,safetensors}" in help_text.getvalue() and "--from dcp" in help_text.getvalue()
    code, _, err = _run(convert_main, ["import", "--load", str(tmp_path / "missing"), "--output", str(tmp_path / "o")])
    assert code == 2 and "unrecognized" not in err and "required" not in err, err


@pytest.mark.slow  # a two-step run in this process
def test_mock_data_names_what_the_run_reads():
    code, out, err = _run(loop.main, ["--mock-data", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads",
                                      "2", "--seq-length", "16", "--vocab-size", "64", "--train-iters", "2",
                                      "--global-batch-size", "2", "--micro-batch-size", "1", "--eval-iters", "0"])
    assert code == 0, err
    assert "1099511627776" not in out and "(4 read by --train-iters 2)" in out, out


def test_the_fp16_line_shows_the_loss_scale_and_the_skipped_steps():
    record = {"step": 3, "total_steps": 10, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 100.0,
              "tokens_per_sec_per_rank": 100.0, "step_time_s": 0.1, "loss_scale": 32768.0, "skipped_steps": 2}
    assert "| loss scale 32768 | skipped 2 |" in progress_line(record)
    assert "loss scale" not in progress_line({k: v for k, v in record.items() if k != "loss_scale"})


def test_an_unchanged_global_batch_is_not_shown_as_a_change():
    resize = Resize(step=4, consumed_samples=64, old_world_size=2, new_world_size=4, old_dp=2, new_dp=4,
                    old_global_batch_size=16, new_global_batch_size=16, old_num_microbatches=8,
                    new_num_microbatches=4, batch_rule="flags", lr_rule=None, lr_factor=1.0, lr_factor_total=1.0,
                    old_lr=1e-3, new_lr=1e-3, tp=1, pp=1)
    line = resize.describe()
    assert "16 -> 16" not in line and "global batch 16 (unchanged) set by the batch flags" in line, line


@pytest.mark.slow  # matplotlib
def test_a_one_point_curve_gets_a_marker(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("plot_metrics", ROOT / "tools" / "plot_metrics.py")
    plot_metrics = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_metrics)
    records = [{"step": s, "loss": 5.0 / s} for s in (1, 2, 3)] + [{"step": 3, "eval_loss": 1.5}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    import matplotlib.axes

    drawn = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *a, **kw: drawn.append(kw) or real(ax, *a, **kw))
    plot_metrics.plot([str(path)], ["run"], str(tmp_path / "m.png"))
    markers = [kw.get("marker") for kw in drawn]
    assert markers == [None, "o"], markers  # the loss (3 points) as a line; the one validation point visible


@pytest.mark.slow  # builds the embedded corpus' splits twice
@pytest.mark.parametrize("rank,notes", [("0", 1), ("1", 0)])
def test_an_empty_split_is_noted_by_rank_0_only(monkeypatch, rank, notes):
    monkeypatch.setenv("RANK", rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_gpt_datasets(None, "98,1,1e-9", seq_length=64, seed=0)
    empty = [w for w in caught if "split of" in str(w.message) and "holds no sample" in str(w.message)]
    assert len(empty) == notes, [str(w.message) for w in caught]


def test_the_liger_comparison_has_its_extra():
    assert '"liger": ["liger-kernel"]' in (ROOT / "setup.py").read_text()
    assert "megalite[liger]" in (ROOT / "tools" / "bench_kernels.py").read_text()
