"""tools/gemm_in_step.py and the op summary --profile-steps writes: every GEMM of a real profiled
step is found once (its FLOPs equal the model's, counted by hand), and each is set against the
profile's time for its shape."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import sys

import pytest

from megalite.plan.hardware import load_profile
from megalite.testing import run_distributed
from megalite.training.loop import main as train_main

_PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "gemm_in_step.py"
_spec = importlib.util.spec_from_file_location("gemm_in_step", _PATH)
tool = importlib.util.module_from_spec(_spec)
sys.modules["gemm_in_step"] = tool
_spec.loader.exec_module(tool)

LAYERS, HIDDEN, SEQ, MICRO, PADDED_VOCAB = 2, 32, 16, 2, 384  # the embedded corpus: 257 tokens, padded to 128s


def test_a_profiled_step_holds_every_gemm_once(tmp_path, capsys):
    argv = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", "2", "--seq-length",
            str(SEQ), "--micro-batch-size", str(MICRO), "--global-batch-size", str(2 * MICRO), "--train-iters", "3",
            "--eval-iters", "0", "--profile-steps", "2", "3", "--profile-dir", str(tmp_path)]
    assert run_distributed(train_main, 1, argv, timeout_s=120) == [0]
    ops = tmp_path / "ops_rank00000_steps2-3.json"
    summary = json.loads(ops.read_text())
    assert summary["device"] == "cpu" and summary["steps"] == 2
    rows = tool.compare(summary, load_profile("H100-SXM"), "fp32")
    # per microbatch: each block's four linears [T, h] x [h, 3h | h | 4h] and [T, 4h] x [4h, h], the output
    # layer [T, h] x [h, V]; backward runs two GEMMs of each forward one's size: 3 x 2 T (12 h^2 L + h V)
    tokens, microbatches = MICRO * SEQ, 2 * 2                     # 2 microbatches a step, 2 steps
    expected = 3 * 2 * tokens * (12 * HIDDEN ** 2 * LAYERS + HIDDEN * PADDED_VOCAB) * microbatches
    assert sum(r["flops"] for r in rows) == expected
    assert all(r["measured_s"] > 0 and r["profile_s"] > 0 for r in rows)
    assert tool.main([str(ops), "--hardware", "H100-SXM"]) == 0
    out = capsys.readouterr().out
    assert f"total: {expected / 1e9:.3f} GFLOP" in out and "measured / profile" in out


def test_shapes_of_each_product_and_the_profile_time():
    assert tool.gemm_dims("aten::mm", [[8, 4], [4, 16]]) == (1, 8, 16, 4)
    assert tool.gemm_dims("aten::addmm", [[16], [8, 4], [4, 16], [], []]) == (1, 8, 16, 4)
    assert tool.gemm_dims("aten::bmm", [[3, 8, 4], [3, 4, 16]]) == (3, 8, 16, 4)
    assert tool.gemm_dims("aten::baddbmm", [[3, 8, 16], [3, 8, 4], [3, 4, 16], [], []]) == (3, 8, 16, 4)
    assert tool.gemm_dims("aten::matmul", [[8, 4], [4, 16]]) is None  # not a leaf: its mm is counted
    flat = dataclasses.replace(load_profile("A100-80GB"), matmul_efficiency=((1, 0.5),), memory_bandwidth_gbs=1e9)
    summary = {"device": "cpu", "steps": 1, "ops": [
        {"name": "aten::bmm", "input_shapes": [[3, 8, 4], [3, 4, 16]], "count": 5, "time_us": 10.0},
        {"name": "aten::add", "input_shapes": [[8], [8]], "count": 9, "time_us": 99.0}]}
    [row] = tool.compare(summary, flat, "bf16")
    flops = 2 * 3 * 8 * 16 * 4
    assert row["flops"] == 5 * flops and row["measured_s"] == pytest.approx(1e-5)
    assert row["profile_s"] == pytest.approx(5 * flops / (0.5 * 312e12))


def test_missing_or_gemm_free_summary_is_one_line_and_exit_2(tmp_path, capsys):
    assert tool.main([str(tmp_path / "none.json")]) == 2
    empty = tmp_path / "ops.json"
    empty.write_text(json.dumps({"device": "cpu", "steps": 1, "ops": []}))
    assert tool.main([str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--profile-steps" in err[0] and "no matrix products" in err[1]
