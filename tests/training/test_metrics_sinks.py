"""TensorBoard and W&B receive the same fields as the JSON lines file (each skipped when its package,
an optional extra, is not installed)."""
import json

import pytest

from megalite.config.model import preset
from megalite.training import metrics as M
from megalite.training.metrics_sinks import TensorBoardSink, WandbSink, tag_of


def _write_run(writer: M.MetricsWriter) -> None:
    meter = M.ThroughputMeter(preset("tiny"), seq_length=128, micro_batch_size=2, dp=1, num_microbatches=1,
                              world_size=1, total_steps=3, peak_tflops_per_gpu=100.0)
    for step in (1, 2):
        writer.write(meter.step(step, 0.5, loss=4.0 / step, lr=1e-3 * step, grad_norm=0.5 + step))
    writer.write_eval(2, 1.75)
    writer.close()


def _file_fields(path) -> tuple[dict[str, list[float]], set[str]]:
    """{field: values by step} of every number in the JSON lines file."""
    fields: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        for key, value in json.loads(line).items():
            if key != "step" and isinstance(value, (int, float)):
                fields.setdefault(key, []).append(float(value))
    return fields


def test_tensorboard_holds_the_files_fields(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write_run(M.MetricsWriter(str(tmp_path / "m.jsonl"), [TensorBoardSink(str(tmp_path / "tb"))]))
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    board = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    expected = {tag_of(field): values for field, values in _file_fields(tmp_path / "m.jsonl").items()}
    assert set(board) == set(expected)
    for tag, values in expected.items():
        assert board[tag] == pytest.approx(values, rel=1e-6), tag
    assert board["train/loss"] == [4.0, 2.0] and board["eval/loss"] == [1.75]
    assert {"perf/tokens_per_sec", "perf/mfu", "train/lr", "train/grad_norm"} <= set(board)


@pytest.mark.slow  # the quick tier keeps a smaller proof of the same feature
def test_wandb_offline_holds_the_files_fields(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink("megalite-test", "sinks", str(tmp_path / "wb"), {"model": {"hidden_size": 64}})
    logged: list[tuple[dict, int]] = []  # what reached the real run.log (wandb 0.31 offers no offline reader)
    real_log = sink._run.log
    monkeypatch.setattr(sink._run, "log", lambda values, step: (logged.append((dict(values), step)),
                                                                 real_log(values, step=step)))
    _write_run(M.MetricsWriter(str(tmp_path / "m.jsonl"), [sink]))
    expected = {tag_of(field): values for field, values in _file_fields(tmp_path / "m.jsonl").items()}
    seen: dict[str, list[float]] = {}
    for values, _ in logged:
        for key, value in values.items():
            seen.setdefault(key, []).append(float(value))
    assert sorted(seen) == sorted(expected) and [step for _, step in logged] == [1, 2, 2]
    for key, values in expected.items():  # pytest >= 9.2's approx takes no dict of lists
        assert seen[key] == pytest.approx(values), key
    assert list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb")), "no offline run written"


def test_dashboard_tags_are_grouped():
    """torchtitan's habit: train/, perf/, memory/, comm/, moe/, eval/ (issue 49 item 13); the file stays flat."""
    assert [tag_of(f) for f in ("loss", "lr", "grad_norm", "loss_scale", "mfu", "tokens_per_sec", "step_time_s",
                                "mem_peak_bytes", "mem_rss_bytes", "grad_reduce_bytes", "moe_aux_loss",
                                "eval_perplexity", "resize/new_dp")] == [
        "train/loss", "train/lr", "train/grad_norm", "train/loss_scale", "perf/mfu", "perf/tokens_per_sec",
        "perf/step_time_s", "memory/peak_bytes", "memory/rss_bytes", "comm/grad_reduce_bytes", "moe/aux_loss",
        "eval/perplexity", "resize/new_dp"]
