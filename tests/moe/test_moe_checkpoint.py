"""MoE checkpoints are layout-free, experts included: saved at one (tp, ep, dp, pp), loaded at another.

A 4-rank world trains 2 steps at (tp 2, dp 2, ep 2) with ZeRO 1 and whole experts on each tp rank (etp 1)
and saves; it then loads that checkpoint at (tp 2, dp 2, ep 2) with the experts split over tp (etp 2),
at (dp 4, ep 4) with ZeRO 0, at (pp 2, dp 2, ep 2) and at (dp 4, ep 2) with ZeRO 3 (experts sharded over expert-dp 2),
and each trains a third step: its loss and parameters must equal the single-process model trained 3
steps (so the experts' weights and Adam state went to the right ranks), and a (1, 1, 1) model in the
parent process loads the checkpoint's weights unchanged.
"""
import pytest
import torch

from megalite.distributed import mesh
from megalite.parameters import params as P
from megalite.checkpoint import Checkpointer, load_checkpoint
from megalite.distributed.mesh import single_process_mesh
from megalite.model.gpt import GPTModel
from megalite.moe.bookkeeping import expert_biases
from megalite.testing import assert_tensor_close, run_distributed
from moe_helpers import cfg_for, train

QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def reference():
    chunks, _, results = train(single_process_mesh("cpu"), cfg_for(), steps=range(3))
    chunks2, _, _ = train(single_process_mesh("cpu"), cfg_for(), steps=range(2))
    saved = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks2[0].logical_parameters()}
    final = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}
    return [r.loss for r in results], saved, final


LOADS = [((2, 1, 2, 2), dict(etp=2)), ((1, 1, 4, 4), dict()), ((1, 2, 2, 2), dict(zero=1)),
         ((1, 1, 4, 2), dict(zero=3))]


def _world(directory, reference):
    losses, _, final = reference
    cfg = cfg_for(2, 1, 2, 2, zero=1, etp=1)
    m = mesh.init_mesh(layout=cfg.layout(), replace=True)
    chunks, optimizer, results = train(m, cfg, steps=range(2))
    torch.testing.assert_close([r.loss for r in results], losses[:2], rtol=1e-5, atol=0)
    Checkpointer(directory, m, **QUIET).save(2, chunks, optimizer, consumed_samples=16,
                                             model_config=chunks[0].config)
    for (tp, pp, dp, ep), settings in LOADS:
        cfg = cfg_for(tp, pp, dp, ep, **settings)
        m = mesh.init_mesh(layout=cfg.layout(), replace=True)
        chunks, optimizer, _ = train(m, cfg, steps=range(0))
        assert load_checkpoint(directory, chunks, optimizer, m, **QUIET).step == 2
        _, _, results = train(m, cfg, steps=range(2, 3), chunks=chunks, optimizer=optimizer)
        what = f"loaded at tp={tp} pp={pp} dp={dp} ep={ep} {settings}"
        torch.testing.assert_close(results[0].loss, losses[2], rtol=1e-5, atol=0, msg=what)
        with optimizer.model.gathered():
            for chunk in chunks:
                for name, p in chunk.logical_parameters():
                    assert_tensor_close(p, P.shard_spec(p).shard(final[name]), rtol=1e-5, what=f"{what} {name}")
    return True


@pytest.mark.slow  # the quick tier keeps a smaller proof of the same feature
def test_moe_checkpoint_saved_at_one_layout_loads_at_others(reference, tmp_path):
    assert all(run_distributed(_world, 4, str(tmp_path), reference, timeout_s=300))
    m = single_process_mesh("cpu")
    model = GPTModel(cfg_for().gpt_config(), m)
    load_checkpoint(str(tmp_path), [model], None, m, **QUIET)
    for name, p in model.logical_parameters():
        assert_tensor_close(p, P.shard_spec(p).shard(reference[1][name]), rtol=1e-5, what=name)


# DeepSeek-V3's expert bias is state beside the weights: a resumed run must route as the uninterrupted one.
# A large bias step makes it matter to the routing from the first update (1e-3 could leave the choices alone);
# the save comes after 1 step (sign steps of +-rate often cancel over 2, which would store zeros).
BIAS = dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05)


def _biases(chunks) -> dict:
    return {chunk.logical_name(name): bias.clone() for chunk in chunks for name, bias in expert_biases(chunk)}


@pytest.fixture(scope="module")
def bias_reference():
    """Losses of 3 uninterrupted single-process steps with the expert bias, and the biases after step 1."""
    chunks, optimizer, results = train(single_process_mesh("cpu"), cfg_for(**BIAS), steps=range(1))
    biases = _biases(chunks)
    assert len(biases) == 2 and all(b.any() for b in biases.values())  # 2 MoE layers, both biases moved
    _, _, more = train(single_process_mesh("cpu"), cfg_for(**BIAS), steps=range(1, 3), chunks=chunks,
                       optimizer=optimizer)
    return [r.loss for r in results + more], biases


def test_expert_bias_resumes_exactly(bias_reference, tmp_path):
    """Save after 1 step, resume in a new model: the biases come back and steps 2-3 lose exactly as uninterrupted."""
    losses, saved = bias_reference
    m, cfg = single_process_mesh("cpu"), cfg_for(**BIAS)
    chunks, optimizer, _ = train(m, cfg, steps=range(1))
    Checkpointer(tmp_path / "bias", m, **QUIET).save(1, chunks, optimizer, consumed_samples=8,
                                                     model_config=chunks[0].config)
    chunks, optimizer, _ = train(m, cfg, steps=range(0))
    load_checkpoint(tmp_path / "bias", chunks, optimizer, m, **QUIET)
    restored = _biases(chunks)
    assert restored.keys() == saved.keys() and all(torch.equal(restored[n], saved[n]) for n in saved)
    _, _, results = train(m, cfg, steps=range(1, 3), chunks=chunks, optimizer=optimizer)
    assert [r.loss for r in results] == losses[1:]
    # A checkpoint without biases (saved with the bias off) loads with the biases at zero.
    plain, plain_optimizer, _ = train(m, cfg_for(), steps=range(0))
    Checkpointer(tmp_path / "plain", m, **QUIET).save(0, plain, plain_optimizer, consumed_samples=0,
                                                      model_config=plain[0].config)
    load_checkpoint(tmp_path / "plain", chunks, optimizer, m, **QUIET)
    assert all(not b.any() for b in _biases(chunks).values())


def _bias_world(directory, bias_reference):
    """Train 1 step at pp 2 (each stage holds one MoE layer) and save; load at (dp 2, ep 2) and train steps 2-3."""
    losses, saved = bias_reference
    m = mesh.init_mesh(pp=2, replace=True)
    chunks, optimizer, results = train(m, cfg_for(1, 2, 1, 1, **BIAS), steps=range(1))
    torch.testing.assert_close(results[0].loss, losses[0], rtol=1e-5, atol=0)
    mine = _biases(chunks)
    assert len(mine) == 1 and all(torch.equal(b, saved[n]) for n, b in mine.items())  # this stage's layer
    Checkpointer(directory, m, **QUIET).save(1, chunks, optimizer, consumed_samples=8, model_config=chunks[0].config)
    cfg = cfg_for(1, 1, 2, 2, **BIAS)
    m = mesh.init_mesh(layout=cfg.layout(), replace=True)
    chunks, optimizer, _ = train(m, cfg, steps=range(0))
    load_checkpoint(directory, chunks, optimizer, m, **QUIET)
    restored = _biases(chunks)
    assert restored.keys() == saved.keys() and all(torch.equal(restored[n], saved[n]) for n in saved)
    _, _, results = train(m, cfg, steps=range(1, 3), chunks=chunks, optimizer=optimizer)
    torch.testing.assert_close([r.loss for r in results], losses[1:], rtol=1e-5, atol=0)
    return True


def test_expert_bias_saved_at_pp2_loads_at_ep2(bias_reference, tmp_path):
    assert all(run_distributed(_bias_world, 2, str(tmp_path), bias_reference, timeout_s=300))
