"""MoE training in bf16, and in fp16 with dynamic loss scaling, at (dp 2, ep 2) against fp32.

One forked world of 2 ranks trains the tiny MoE model 3 steps on one batch (lr 1e-2: it memorises it)
in fp32, bf16 and fp16. Checked: every loss finite and each below the last; fp16 ran at its initial
loss scale 2^16 without a skipped step; the step-1 loss and every step-1 gradient (the fp32 main
gradients after the optimizer's unscaling: ZeRO 0, no clipping) equal fp32's to 8 unit roundoffs of
the half format (u = 2^-11 fp16, 2^-8 bf16; tensor-relative). The half-precision runs round every
activation and weight; the measured errors are about 2u, and 8u leaves room for the dozen rounded
operations of each block without admitting an error of the size of a term of the gradient.

Routing is pinned: the expert bias (not trained here, update rate 0) makes experts 1 and 2 (one on
each ep rank, so routes travel both ways; experts 0 and 3 get no token) every token's top 2. Unpinned,
a token whose 2nd and 3rd router logits lie within the half format's rounding picks another expert
in bf16 than in fp32 (2 of 128 routes do here) and its gradient changes by a whole term.

The balancing losses' gradient enters in backward (`_AttachLosses`) with the factor the train step
sets, which must carry the fp16 loss scale like the main loss: with a large aux coefficient (1.0)
the router's gradient is mostly the aux loss's, so an aux gradient left unscaled (2^16 too small
after unscaling) or scaled twice makes fp16's router gradient miss fp32's by far more than 8u.
"""
import pytest
import torch

from megalite.distributed import mesh
from megalite.moe.bookkeeping import expert_biases
from megalite.testing import assert_tensor_close, run_distributed
from megalite.parameters import params as P
from megalite.training.step import train_step
from moe_helpers import batches, cfg_for, train

PINNED = [0.0, 20.0, 10.0, -10.0]  # + scores in (0, 1): experts 1 and 2 win every token
UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
SETTINGS = dict(clip_grad=0.0, zero=0, moe_aux_loss_coeff=1.0, moe_z_loss_coeff=1e-2,
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)


def _train(m, precision: str):
    cfg = cfg_for(1, 1, 2, 2, precision=precision, **SETTINGS)
    chunks, optimizer, _ = train(m, cfg, steps=range(0))
    for chunk in chunks:
        for _, bias in expert_biases(chunk):
            bias.copy_(torch.tensor(PINNED))
    batch = batches(2, m.dp_rank, 1)[0]
    results, grads = [], {}
    for step in range(3):
        results.append(train_step(optimizer.model, optimizer, batch, m, cfg, lr=1e-2))
        if step == 0:  # unscaled by the optimizer (factor 1 / loss scale, in place)
            grads = {name: P.main_grad(p).clone() for c in chunks for name, p in c.logical_parameters()}
    return [r.loss for r in results], [(r.loss_scale, r.skipped) for r in results], grads


def _world():
    return {precision: _train(mesh.init_mesh(dp=2, ep=2, num_experts=4), precision) for precision in ("fp32", "bf16", "fp16")}


def test_moe_trains_in_bf16_and_fp16_and_its_first_gradients_are_fp32s():
    for rank in run_distributed(_world, 2, timeout_s=120):
        ref_losses, _, ref_grads = rank["fp32"]
        for precision in ("fp32", "bf16", "fp16"):
            losses, scales, grads = rank[precision]
            assert all(torch.isfinite(torch.tensor(losses))) and losses[2] < losses[1] < losses[0], (precision, losses)
            expected_scale = 2.0 ** 16 if precision == "fp16" else 1.0
            assert scales == [(expected_scale, False)] * 3, (precision, scales)
            if precision == "fp32":
                continue
            tolerance = 8 * UNIT_ROUNDOFF[precision]
            assert losses[0] == pytest.approx(ref_losses[0], rel=tolerance), precision
            assert grads.keys() == ref_grads.keys() and any("router" in name for name in grads)
            for name, grad in grads.items():
                assert ref_grads[name].any() == ("experts.0." not in name and "experts.3." not in name), name
                assert_tensor_close(grad, ref_grads[name], rtol=tolerance, what=f"{precision} {name}")
