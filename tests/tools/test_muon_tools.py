"""tools/muon_quality.py's arithmetic, and tools/bench_optimizer.py running end to end (slow)."""
import importlib.util
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_windowed_losses_and_steps_to_reach():
    quality = _load("muon_quality")
    assert quality.windowed([4.0, 2.0, 3.0, 1.0], 2) == [4.0, 3.0, 2.5, 2.0]
    assert quality.steps_to_reach([5.0, 4.0, 3.0, 2.0], 3.0) == 3
    assert quality.steps_to_reach([5.0, 4.0], 3.0) is None


@pytest.mark.slow
def test_bench_optimizer_prints_the_step_and_newton_schulz(capsys):
    assert _load("bench_optimizer").main(["--model", "tiny-llama", "--repeats", "1", "--micro-batch-size", "1"]) == 0
    out = capsys.readouterr().out
    # tiny-llama: 4 blocks of q, k, v, proj, gate, up, down
    for label in ("forward + backward", "AdamW step", "Muon step (bf16 NS)", "Newton-Schulz alone (bfloat16, 28 "
                  "matrices)", "of a one-microbatch AdamW step"):
        assert label in out, out
