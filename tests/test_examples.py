"""examples/custom_transformer.py: megalite layers in hand-written code give the same losses at tp=2."""
import importlib.util
import pathlib

import torch

from megalite.testing import run_distributed

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "custom_transformer.py"


def _losses():
    spec = importlib.util.spec_from_file_location("custom_transformer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(steps=3)


def test_custom_transformer_same_losses_at_tp2():
    single = run_distributed(_losses, 1)[0]
    assert single[-1] < single[0]
    for losses in run_distributed(_losses, 2):
        torch.testing.assert_close(losses, single, rtol=1e-5, atol=0)
