"""Training metrics: throughput and MFU by hand, writers, time split, stragglers."""
from __future__ import annotations

import json

import pytest

from megalite.distributed import comm
from megalite.config.model import preset
from megalite.testing import run_distributed
from megalite.training import metrics as M


def test_throughput_effective_batch_and_mfu_by_hand():
    model = preset("gpt2-124m")  # L=12, h=768, s=1024, V=50257, biases, tied embeddings
    h, L, s, V = 768, 12, 1024, 50257
    blocks = L * (12 * h * h + 13 * h) + 2 * h  # per block 12h^2 + 13h (+ the final LayerNorm)
    flops_per_token = 6 * (blocks + V * h) + 12 * L * h * s
    assert flops_per_token == 855_166_464
    meter = M.ThroughputMeter(model, seq_length=s, micro_batch_size=4, dp=8, num_microbatches=16, world_size=16,
                              total_steps=100, peak_tflops_per_gpu=989.0)
    record = meter.step(10, 2.0, loss=3.5, lr=1e-4, grad_norm=0.7)
    assert record["effective_batch"] == 4 * 8 * 16 == M.effective_batch(4, 8, 16)
    assert record["tokens_per_step"] == 512 * s
    assert record["tokens_per_sec"] == 512 * s / 2.0
    assert record["tokens_per_sec_per_rank"] == 512 * s / 2.0 / 16
    assert record["samples_per_sec"] == 256.0
    assert record["mfu"] == pytest.approx(flops_per_token * 512 * s / 2.0 / (16 * 989e12))
    assert "hfu" not in record  # no recomputation: HFU == MFU, not reported
    assert (record["loss"], record["lr"], record["grad_norm"]) == (3.5, 1e-4, 0.7)
    assert record["gpu_hours"] == pytest.approx(2.0 * 16 / 3600)
    meter.step(11, 4.0, loss=3.4, lr=1e-4, grad_norm=0.6)
    last = meter.step(12, 3.0, loss=3.3, lr=1e-4, grad_norm=0.6)
    assert last["eta_s"] == pytest.approx((100 - 12) * 3.0)  # remaining steps x median step time
    assert last["gpu_hours"] == pytest.approx(9.0 * 16 / 3600)


def test_hfu_counts_recomputed_flops():
    model = preset("gpt2-124m")
    kwargs = dict(seq_length=1024, micro_batch_size=1, dp=1, num_microbatches=1, world_size=1, peak_tflops_per_gpu=312)
    plain = M.ThroughputMeter(model, **kwargs).step(1, 1.0)
    selective = M.ThroughputMeter(model, recompute="selective", **kwargs).step(1, 1.0)
    extra = 4 * 12 * 768 * 1024 * 1024 / 312e12  # attention forward again, per token x tokens / peak
    assert selective["mfu"] == plain["mfu"]
    assert selective["hfu"] - selective["mfu"] == pytest.approx(extra)
    with pytest.raises(ValueError, match="positive"):
        M.ThroughputMeter(model, **kwargs).step(1, 0.0)


def test_peak_table_matches_device_names():
    assert M.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert M.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert M.peak_tflops("NVIDIA H200") == 989.0
    assert M.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert M.peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 156.0
    assert M.peak_tflops("NVIDIA A10G") == 70.0 and M.peak_tflops("NVIDIA A10") == 125.0
    assert M.peak_tflops("Some Future GPU") is None


def test_time_breakdown_and_memory(monkeypatch):
    timer = M.TimeBreakdown()
    timer.add("forward", 0.3)
    timer.add("backward", 0.5)
    with timer.phase("optimizer"):
        pass
    monkeypatch.setitem(comm.ledger.seconds, ("dp", "all_reduce"), comm.ledger.seconds[("dp", "all_reduce")] + 0.2)
    assert timer.add_comm_from_ledger() == pytest.approx(0.2)
    summary = timer.summary(step_time_s=1.0)
    assert summary["time_forward_s"] == 0.3 and summary["time_communication_s"] == pytest.approx(0.2)
    assert summary["time_data_s"] == 0.0
    assert summary["time_other_s"] == pytest.approx(1.0 - 0.8 - summary["time_optimizer_s"])
    timer.reset()
    assert timer.summary()["time_forward_s"] == 0.0
    memory = M.memory_stats("cpu")
    assert memory["mem_peak_bytes"] >= memory["mem_rss_bytes"] > 0


def test_writer_jsonl_and_progress_line(tmp_path):
    meter = M.ThroughputMeter(preset("tiny"), seq_length=128, micro_batch_size=2, dp=2, num_microbatches=2,
                              world_size=4, total_steps=1000, peak_tflops_per_gpu=989.0)
    path = tmp_path / "run" / "metrics.jsonl"
    writer = M.MetricsWriter(str(path))
    for step in (1, 2):
        writer.write(meter.step(step, 0.5, loss=4.0 / step, lr=3e-4, grad_norm=1.0))
    with pytest.raises(ValueError, match="lacks"):
        writer.write({"step": 3})
    writer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2] and lines[1]["loss"] == 2.0
    assert lines[0]["tokens_per_sec"] == 2 * 2 * 2 * 128 / 0.5
    text = M.progress_line(lines[1])
    for part in ("step 2/1000", "loss 2.0000", "lr 3.00e-04", "gnorm 1.000", "tok/s", "MFU", "eta"):
        assert part in text, (part, text)
    M.MetricsWriter(str(tmp_path / "other.jsonl"), enabled=False).write(lines[0])
    assert not (tmp_path / "other.jsonl").exists()


def test_straggler_report_names_the_slowest():
    report = M.straggler_report([1.0, 1.5, 1.0, 1.02, 1.2], hosts=["a", "b", "a", "c", "d"], top_k=2)
    assert report.median_s == 1.02
    assert [(r, host) for r, host, _, _ in report.slowest] == [(1, "b"), (4, "d")]
    assert report.slowest[0][3] == pytest.approx(1.5 / 1.02 - 1)
    assert "rank 1 on b 1.500 s (+47.1%)" in report.describe()
    assert "no stragglers" in M.straggler_report([1.0, 1.01]).describe()


def _gather_rank():
    from megalite.distributed.mesh import init_mesh

    mesh = init_mesh()
    times, hosts = M.gather_step_times(1.0 + 0.5 * mesh.rank)
    return times, len(hosts)


def test_gather_step_times_over_the_world():
    times, hosts = run_distributed(_gather_rank, 2)[1]
    assert times == [1.0, 1.5] and hosts == 2


def test_estimate_beside_measured_memory_line():
    from megalite.config import RunConfig
    from megalite.plan import estimate

    est = estimate(preset("gpt2-124m"), RunConfig.build(precision="bf16", micro_batch_size=4))
    line = M.estimate_vs_measured(est, "cpu")
    assert f"estimated {est.total_bytes / 1e9:.2f} GB" in line and "activations" in line and "RSS" in line


def test_reader_of_a_live_file_counts_only_complete_lines(tmp_path):
    """A reader racing the writer may see part of a line (the CI failure of the fault drill read
    '{"step": 1, "loss": 5.475529670715'): that line counts once its newline is there."""
    from megalite.training.metrics_file import read_records

    path = tmp_path / "metrics.jsonl"
    assert read_records(path) == []  # not written yet
    writer = M.MetricsWriter(str(path))
    writer.write_eval(1, 2.0)
    line = json.dumps({"step": 2, "loss": 5.475529670715, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 9.0}) + "\n"
    with open(path, "a") as f:
        for cut in (1, 20, 34, len(line) - 1):  # prefixes of the line short of its newline (34: the CI's)
            f.write(line[:cut])
            f.flush()
            assert [r["step"] for r in read_records(path)] == [1]
            f.truncate(path.stat().st_size - cut)
        f.write(line)
    assert [r["step"] for r in read_records(path)] == [1, 2]
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')  # a complete line that is not JSON: a wrong file
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_records(path)


def test_writer_after_a_killed_writer_starts_on_a_line_of_its_own(tmp_path):
    """A writer killed inside a write can leave part of a line; the next attempt's first record must
    not run on from it (the file would stop being JSON lines)."""
    from megalite.training.metrics_file import drop_torn_tail, read_records

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "eval_loss": 2.0}\n{"step": 2, "lo')
    M.MetricsWriter(str(path)).write_eval(2, 1.5)
    assert read_records(path) == [{"step": 1, "eval_loss": 2.0}, {"step": 2, "eval_loss": 1.5,
                                                                  "eval_perplexity": pytest.approx(4.4817, rel=1e-4)}]
    for text, kept in [("", ""), ("no newline at all", ""), ("a\nb\n", "a\nb\n"), ("x" * 300 + "\n" + "y" * 700, "x" * 300 + "\n")]:
        path.write_text(text)
        drop_torn_tail(path, chunk=64)  # several chunks back to the newline
        assert path.read_text() == kept
