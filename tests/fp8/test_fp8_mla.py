"""FP8 with DeepSeek's design: a tiny DeepSeek-shaped model (latent attention with d_qk 24 = 16 + 8 RoPE
channels and d_v 16, a query latent, group-limited routing with the expert bias, a shared expert, a dense
first block) trained two steps in FP8 (hybrid, power-of-two scales) equals the FP8 single process (losses,
grad norms, every parameter, 1e-5): tensorwise at (tp 2, SP), and in the slow tier rowwise there and both
recipes at ep 2 (dp 2).

What runs in FP8 there (megalite/model/fp8_convert.py): MLA's column-parallel up-projections and its
row-parallel output projection, the dense block's MLP, the shared expert and the routed experts. The
replicated down-projections stay in the training dtype (docs/deepseek.md says why)."""
import os
import sys

import pytest
import torch

from megalite.config import RunConfig
from megalite.distributed.mesh import init_mesh, single_process_mesh
from megalite.testing import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from mla_training import train_two_steps  # noqa: E402


def _cfg(tp=1, fp8="tensorwise", **kw):
    """fp8: the recipe, or None for the training dtype throughout."""
    settings = dict(model="deepseek-tiny", num_layers=2, hidden_size=64, seq_length=16, q_lora_rank=24,
                    kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, micro_batch_size=2,
                    global_batch_size=4, lr=1e-3, seed=5, adam_eps=1e-6)
    if fp8:
        settings.update(fp8_format="hybrid", fp8_recipe=fp8)
    return RunConfig.build(tp=tp, **{**settings, **kw})


def _train(m, cfg, reference=None):
    """Two steps: (losses, grad norms, the FP8 modules' names, the final full parameters at one process;
    else each one compared with `reference`'s slice for this rank)."""
    losses, norms, chunks, final = train_two_steps(m, cfg, reference)
    fp8_modules = sorted(n for c in chunks for n, mod in c.named_modules() if getattr(mod, "fp8", None) is not None)
    return losses, norms, fp8_modules, final


def _layout(reference, settings, recipe):
    cfg = _cfg(fp8=recipe, **settings)
    return _train(init_mesh(layout=cfg.layout(), replace=True), cfg, reference)[:3]


SLOW = pytest.mark.slow
TP2_SP, EP2 = dict(tp=2, sequence_parallel=True), dict(ep=2, dp=2)


@pytest.mark.parametrize("settings, recipe", [(TP2_SP, "tensorwise"), pytest.param(TP2_SP, "rowwise", marks=SLOW),
                                              pytest.param(EP2, "tensorwise", marks=SLOW),
                                              pytest.param(EP2, "rowwise", marks=SLOW)],
                         ids=["tp2-sp-tensorwise", "tp2-sp-rowwise", "ep2-dp2-tensorwise", "ep2-dp2-rowwise"])
def test_latent_attention_in_fp8_equals_the_fp8_single_process(settings, recipe):
    """The slow cases also check that the run differs from the one without FP8 (the GEMMs did run in FP8;
    the quick one relies on the list of FP8 modules)."""
    torch.set_num_threads(1)
    losses, norms, fp8_modules, final = _train(single_process_mesh("cpu"), _cfg(fp8=recipe))
    assert losses[1] < losses[0]
    if "ep" in settings or recipe == "rowwise":
        assert losses != _train(single_process_mesh("cpu"), _cfg(fp8=None))[0]
    block0 = ["attention.kv_up", "attention.proj", "attention.q_up", "mlp.fc1", "mlp.fc2"]
    block1 = ["attention.kv_up", "attention.proj", "attention.q_up", "mlp.experts", "mlp.shared_expert.fc1",
              "mlp.shared_expert.fc2"]  # not the down-projections (q_down, kv_down), norms or router
    assert fp8_modules == [f"layers.0.{n}" for n in block0] + [f"layers.1.{n}" for n in block1]
    for got_losses, got_norms, got_modules in run_distributed(_layout, 2, final, settings, recipe, timeout_s=300):
        torch.testing.assert_close(got_losses, losses, rtol=1e-5, atol=0)
        torch.testing.assert_close(got_norms, norms, rtol=1e-5, atol=0)
        assert got_modules == fp8_modules
