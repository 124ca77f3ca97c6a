"""examples/custom_transformer.py: a hand-written model on tensor, sequence, context, pipeline and data
parallelism with ZeRO 0-3.

The global batch is fixed and split over dp (the sequence over cp, the rows into microbatches), so
every layout must print the losses of the single process (float32: only summation orders differ).
"""
import importlib.util
import json
import math
import pathlib

import pytest
import torch._dynamo  # noqa: F401 - what torch.optim imports on first use, loaded once here

from megalite.testing import run_distributed

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "custom_transformer.py"


def _load_example():
    """The example as a module, loaded once here (with everything it imports) before any rank forks."""
    spec = importlib.util.spec_from_file_location("custom_transformer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_EXAMPLE = _load_example()


def _example_main(argv):
    return _EXAMPLE.main(argv)


@pytest.mark.slow  # 4.5 s: the example at four layouts
def test_custom_transformer_same_losses_at_every_layout(tmp_path):
    """tp x pp x dp with sequence parallelism and ZeRO-1, tp x cp (ring attention), dp with ZeRO-3 over
    explicit units and dp with ZeRO-2: all print the single process's losses."""
    steps = ["--steps", "5"]
    reference = run_distributed(_example_main, 1, steps)[0]
    metrics = tmp_path / "metrics.jsonl"
    runs = {"tp2 pp2 dp2 sp zero1": run_distributed(_example_main, 8, [
                "--tp", "2", "--pp", "2", "--dp", "2", "--sequence-parallel", "--zero", "1",
                "--metrics-file", str(metrics)] + steps),
            "tp2 cp2": run_distributed(_example_main, 4, ["--tp", "2", "--cp", "2"] + steps),
            "dp4 zero3": run_distributed(_example_main, 4, ["--dp", "4", "--zero", "3"] + steps),
            "dp2 zero2": run_distributed(_example_main, 2, ["--dp", "2", "--zero", "2"] + steps)}
    assert min(reference[1:]) < reference[0]  # it trains
    for what, per_rank in runs.items():
        for losses in per_rank:
            assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, reference)), (what, losses, reference)
    written = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in written] == list(range(5))
    assert [r["loss"] for r in written] == runs["tp2 pp2 dp2 sp zero1"][0]
