"""examples/custom_transformer.py: a hand-written model under DataParallel and the sharded optimizer.

The global batch is fixed and split over dp, so every (tp, dp, zero) must print the losses of
the single process (float32: the optimizers differ only in summation order).
"""
import importlib.util
import json
import math
import pathlib

from megalite.testing import run_distributed

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "custom_transformer.py"


def _example_main(argv):
    spec = importlib.util.spec_from_file_location("custom_transformer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_custom_transformer_same_losses_at_every_tp_dp_zero(tmp_path):
    steps = ["--steps", "5"]
    reference = run_distributed(_example_main, 1, steps)[0]
    metrics = tmp_path / "metrics.jsonl"
    runs = {"tp2 dp2 zero1": run_distributed(_example_main, 4, ["--tp", "2", "--dp", "2", "--zero", "1",
                                                                "--metrics-file", str(metrics)] + steps),
            "dp2 zero2": run_distributed(_example_main, 2, ["--dp", "2", "--zero", "2"] + steps),
            "tp2 dp2 zero3": run_distributed(_example_main, 4, ["--tp", "2", "--dp", "2", "--zero", "3"] + steps),
            "tp2 zero0": run_distributed(_example_main, 2, ["--tp", "2"] + steps)}
    assert reference[-1] < reference[0]  # it trains
    for what, per_rank in runs.items():
        for losses in per_rank:
            assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, reference)), (what, losses, reference)
    written = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in written] == list(range(5))
    assert [r["loss"] for r in written] == runs["tp2 dp2 zero1"][0]
