"""Activation recompute (selective: attention core; full: whole blocks) gives the same gradients,
with dropout on: the dropout draw counters are restored for the recompute, so masks match."""
import pytest
import torch

from megalite.distributed import mesh
from megalite.model import GPTModel, preset
from megalite.testing import run_distributed


def _grads(name, recompute, sequence_parallel=False, recompute_num_layers=None):
    cfg = preset(name, num_layers=2, hidden_dropout=0.1, attention_dropout=0.1, seq_length=16)
    model = GPTModel(cfg, seed=11, recompute=recompute, sequence_parallel=sequence_parallel,
                     recompute_num_layers=recompute_num_layers).train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    losses = []
    for _ in range(2):  # two microbatches: the second must see generators advanced past the first
        loss = model(ids, ids.roll(-1, 1))
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("recompute,num_layers", [("selective", None), ("full", None), ("full", 1)])
def test_recompute_gives_identical_gradients(name, recompute, num_layers):
    ref_losses, ref_grads = _grads(name, "none")
    assert ref_losses[0] != ref_losses[1], "dropout must differ between microbatches"
    losses, grads = _grads(name, recompute, recompute_num_layers=num_layers)
    assert losses == ref_losses
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}")


def _tp_recompute():
    mesh.init_mesh(tp=2)
    ref = _grads("tiny", "none", sequence_parallel=True)
    for recompute in ("full", "selective"):
        out = _grads("tiny", recompute, sequence_parallel=True)
        assert out[0] == ref[0], recompute
        for n, g in out[1].items():
            torch.testing.assert_close(g, ref[1][n], rtol=1e-6, atol=1e-7, msg=lambda m: f"{recompute} {n}: {m}")
    return True


def test_recompute_with_tensor_and_sequence_parallel_dropout():
    assert all(run_distributed(_tp_recompute, 2))
