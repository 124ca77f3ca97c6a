"""tools/tune_attention.py on CPU (interpreter, wall clock): the tile sweep must call a tile that
computes something else WRONG rather than fast, the dispatch sweep times every implementation,
and the tables a --json run writes are the tables `load_tables` puts in effect."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from megalite.kernels import HAVE_TRITON, attention_dispatch, attention_tiles
from megalite.kernels.dispatch import interpreter_ready

TOOLS = Path(__file__).resolve().parents[2] / "tools"
pytestmark = pytest.mark.skipif(not HAVE_TRITON or not interpreter_ready(),
                                reason="needs triton importable in interpreter mode")


@pytest.fixture
def tune(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    spec = importlib.util.spec_from_file_location("tune_attention", TOOLS / "tune_attention.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "tune_attention", module)
    spec.loader.exec_module(module)
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return module


@pytest.mark.slow  # 3.4 s of interpreted sweeps
def test_sweep_rejects_a_wrong_tile_and_keeps_the_fastest_correct_one(tune):
    # (16, 32): BLOCK_M not a multiple of BLOCK_N, so the forward's unmasked stage runs past the
    # diagonal and lets queries see future keys: the sweep must call it wrong, not fast.
    candidates = {"fwd": [(16, 32, 1, 1)], "dkdv": [(16, 32, 1, 1)], "dq": [(32, 16, 1, 1)]}
    tiles, rows = tune.tune_tiles(16, 20, torch.float32, "cpu", tune.make_timer(smoke=True), candidates, smoke=True)
    by_tile = {(r["kernel"], r["tile"]): r for r in rows}
    assert len(rows) == 6  # each kernel: its current tile, then its candidate
    assert by_tile[("fwd", (16, 32, 1, 1))]["error"].startswith("WRONG")
    assert tiles["fwd"] == (16, 16, 1, 1)  # the wrong tile is never chosen, however fast
    assert all(not r["error"] and r["ms"] > 0 for key, r in by_tile.items() if key != ("fwd", (16, 32, 1, 1)))
    assert tiles["dkdv"] in [(16, 16, 1, 1), (16, 32, 1, 1)] and tiles["dq"] in [(16, 16, 1, 1), (32, 16, 1, 1)]


@pytest.mark.slow  # 2.7 s of interpreted sweeps
def test_dispatch_sweep_and_json_tables_round_trip(tune, tmp_path, monkeypatch):
    monkeypatch.setattr(attention_tiles, "MEASURED", dict(attention_tiles.MEASURED))
    monkeypatch.setattr(attention_dispatch, "MEASURED_MS", dict(attention_dispatch.MEASURED_MS))
    monkeypatch.setattr(attention_tiles, "MEASURED_BACKWARD", dict(attention_tiles.MEASURED_BACKWARD))
    path = tmp_path / "tables.json"
    monkeypatch.setattr(tune, "CANDIDATES", {})
    monkeypatch.setattr(tune, "SMOKE_CANDIDATES", {"fwd": [], "dkdv": [], "dq": []})
    assert tune.main(["--smoke", "--json", str(path)]) == 0
    saved = json.loads(path.read_text())
    (key, times), = saved["dispatch_ms"].items()
    assert set(times["24"]) >= {"triton", "sdpa"} and all(ms > 0 for ms in times["24"].values())
    assert "triton_fused" not in times["24"]  # the dispatch table holds what auto can run
    (backward_key, variant), = saved["backward"].items()
    attention_tiles.MEASURED_BACKWARD.clear()
    attention_dispatch.MEASURED_MS.clear()
    tune.load_tables(str(path))
    assert attention_dispatch.MEASURED_MS == {tuple(json.loads(key)): {24: times["24"]}}
    assert attention_tiles.MEASURED_BACKWARD == {tuple(json.loads(backward_key)): variant}
    tile_key = tuple(json.loads(next(iter(saved["tiles"]))))
    assert attention_tiles.MEASURED[tile_key] == {"fwd": (16, 16, 1, 1), "dkdv": (16, 16, 1, 1), "dq": (16, 16, 1, 1)}


def test_the_faster_backward_by_geometric_mean_becomes_the_tables_triton(tune):
    table = {1024: {"triton": 2.0, "triton_fused": 1.0, "sdpa": 1.5}, 2048: {"triton": 4.0, "triton_fused": 5.0}}
    variant, rows = tune.faster_backward(table)  # fused / split: 0.5 and 1.25, geomean 0.79
    assert variant == "fused"
    assert rows == {1024: {"sdpa": 1.5, "triton": 1.0}, 2048: {"triton": 5.0}}
    table[2048]["triton_fused"] = 9.0  # geomean 1.06: split
    assert tune.faster_backward(table) == ("split", {1024: {"sdpa": 1.5, "triton": 2.0}, 2048: {"triton": 4.0}})
