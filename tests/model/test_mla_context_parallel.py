"""Multi-head latent attention under context parallelism: a tiny DeepSeek-shaped model (latent attention
with d_qk 24 = 16 + 8 RoPE channels and d_v 16, group-limited routing with the expert bias, a shared
expert, a dense first block) trained two steps at cp 2 with ring attention and with Ulysses, and in the
slow tier at (tp 2, cp 2) with SP, equals the single process: losses, grad norms and every parameter."""
import os
import sys

import pytest
import torch

from megalite.config import RunConfig
from megalite.distributed.mesh import init_mesh, single_process_mesh
from megalite.testing import run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from mla_training import train_two_steps  # noqa: E402

def _cfg(tp=1, cp=1, **kw):
    """adam_eps 1e-6: some gradients of this tiny model are ~1e-8, where Adam's default 1e-8 makes an element's
    update lr * g / (|g| + eps) turn the ring's fp32 summation order (1e-7) into 1e-5 of a parameter tensor
    (measured: 1.07e-5 on the embedding at 1e-8, 7e-7 at worst at 1e-6; the gradient norms agree to 1e-7)."""
    settings = dict(model="deepseek-tiny", num_layers=2, hidden_size=64, seq_length=16, q_lora_rank=24,
                    kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, micro_batch_size=2,
                    global_batch_size=4, lr=1e-3, seed=5, adam_eps=1e-6)
    return RunConfig.build(tp=tp, cp=cp, **{**settings, **kw})


def _train(m, cfg, reference=None):
    """Two steps: (losses, grad norms, the final full parameters at one process; else each one compared
    with `reference`'s slice for this rank)."""
    losses, norms, _, final = train_two_steps(m, cfg, reference)
    return losses, norms, final


def _layouts_world(reference, layouts):
    out = []
    for (tp, cp), settings in layouts:
        cfg = _cfg(tp, cp, **settings)
        out.append(_train(init_mesh(layout=cfg.layout(), replace=True), cfg, reference)[:2])
    return out


QUICK = [((1, 2), dict(cp_comm_type="p2p")), ((1, 2), dict(cp_comm_type="a2a"))]
SLOW = [((2, 2), dict(cp_comm_type="p2p", sequence_parallel=True)),
        ((2, 2), dict(cp_comm_type="a2a", sequence_parallel=True, recompute="selective"))]


@pytest.mark.parametrize("layouts, world", [(QUICK, 2), pytest.param(SLOW, 4, marks=pytest.mark.slow)])
def test_latent_attention_under_context_parallelism_equals_the_single_process(layouts, world):
    cfg = _cfg()
    assert cfg.gpt_config().mla.qk_dim == 24 and cfg.gpt_config().moe.num_groups == 4
    losses, norms, final = _train(single_process_mesh("cpu"), cfg)
    assert losses[1] < losses[0]
    for rank in run_distributed(_layouts_world, world, final, layouts, timeout_s=300):  # every parameter there
        for (layout, settings), (got_losses, got_norms) in zip(layouts, rank):
            torch.testing.assert_close(got_losses, losses, rtol=1e-5, atol=0, msg=f"{layout} {settings}")
            torch.testing.assert_close(got_norms, norms, rtol=1e-5, atol=0, msg=f"{layout} {settings}")
