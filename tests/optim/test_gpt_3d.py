"""The real GPT at tp=2 (sequence parallel) x pp=2 x dp=2 with ZeRO 1/2 vs torch.optim.AdamW at (1,1,1).

The pipeline is driven by hand (one microbatch at a time through both stages, p2p through
megalite.distributed.comm) so this test depends only on the model, the DP engine and the optimizer:
the tied embedding lives on both stages (declared `tied_across_stages`), its gradient is summed
over the embedding group before the deferred bucket is reduced, and the global grad norm
counts it once.
"""
import math

import pytest
import torch

from megalite.parameters import params as P
from megalite.distributed import comm
from megalite.distributed import mesh as mesh_lib
from megalite.model import GPTModel, preset
from megalite.data_parallel import DataParallel
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.testing import run_distributed

GLOBAL_BATCH, SEQ, MICROBATCHES, STEPS = 4, 16, 2, 3
LR, WEIGHT_DECAY, CLIP = 3e-3, 0.1, 0.05
# Adam amplifies a gradient difference dg by up to lr/eps (at |g| ~ eps). Reordered fp32 sums (tp, dp,
# microbatches) differ by ~1e-11 absolute; some gradient elements here are cancellation residues of ~2e-9,
# so with eps=1e-8 one element in ~2000 moved 5e-6 apart after one step. eps=1e-6 keeps that bound
# (lr/eps * dg ~ 3e-8) far below the comparison tolerance, which stays float32-tight.
EPS = 1e-6


def _config():
    return preset("tiny", num_layers=2, hidden_size=32, seq_length=SEQ)


def _batch(step, vocab):
    gen = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=gen)
    labels[0, :5] = -100
    return ids, labels, int((labels != -100).sum())


def _reference():
    cfg = _config()
    model = GPTModel(cfg, seed=7)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, eps=EPS)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        ids, labels, tokens = _batch(step, cfg.vocab_size)
        loss = model(ids, labels, reduction="sum") / tokens
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(float(loss.detach()))
    full = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in model.logical_parameters()}  # unpadded
    return losses, norms, full


def _pipeline_step(m, model, opt, ids, labels, tokens):
    """Both stages, microbatch by microbatch (forward, then backward), then the optimizer step."""
    first, last = m.pp_ranks[0], m.pp_ranks[-1]
    total = torch.zeros(())
    for i, (mb_ids, mb_labels) in enumerate(zip(ids.chunk(MICROBATCHES), labels.chunk(MICROBATCHES))):
        opt.model.set_last_microbatch(i == MICROBATCHES - 1)
        shape = (SEQ // m.tp_size, mb_ids.shape[0], model.config.hidden_size)  # [s/tp, b, h]
        if m.is_first_stage:
            hidden = model(mb_ids)
            comm.wait_all(comm.batch_isend_irecv([comm.P2P("send", hidden.detach().contiguous(), last)], m.pp_group))
            grad = torch.empty(shape)
            comm.wait_all(comm.batch_isend_irecv([comm.P2P("recv", grad, last)], m.pp_group))
            hidden.backward(grad)
        else:
            hidden = torch.empty(shape)
            comm.wait_all(comm.batch_isend_irecv([comm.P2P("recv", hidden, first)], m.pp_group))
            hidden.requires_grad_()
            loss = model(hidden, mb_labels, reduction="sum") / tokens
            loss.backward()
            total += loss.detach()
            comm.wait_all(comm.batch_isend_irecv([comm.P2P("send", hidden.grad.contiguous(), first)], m.pp_group))
    opt.step(lr=LR)  # the wrapper sums the tied embedding's two copies over the embedding group
    comm.all_reduce(total, m.dp_group)
    comm.all_reduce(total, m.pp_group)  # only the last stage had a loss
    return float(total), opt.last_step


def _world(zero_stages):
    m = mesh_lib.init_mesh(tp=2, pp=2)
    cfg = _config()
    out = {}
    for zero_stage in zero_stages:
        layer_ids = range(m.pp_rank, m.pp_rank + 1)
        model = GPTModel(cfg, m, seed=7, layer_ids=layer_ids, pre_process=m.is_first_stage,
                         post_process=m.is_last_stage, sequence_parallel=True)
        dp = DataParallel(model, m, zero_stage=zero_stage, bucket_size=2000, dp_reduction="sum")
        opt = DistributedOptimizer(dp, weight_decay=WEIGHT_DECAY, eps=EPS, clip_grad=CLIP)
        rows = GLOBAL_BATCH // m.dp_size
        losses, norms = [], []
        for step in range(STEPS):
            opt.zero_grad()
            ids, labels, tokens = _batch(step, cfg.vocab_size)
            sl = slice(m.dp_rank * rows, (m.dp_rank + 1) * rows)
            loss, result = _pipeline_step(m, model, opt, ids[sl], labels[sl], tokens)
            losses.append(loss)
            norms.append(result.grad_norm)
        out[zero_stage] = dict(losses=losses, norms=norms, memory=opt.memory_report(),
                               numel=opt.model.layout.numel,
                               params={n: (P.shard_spec(p), p.detach().numpy().copy()) for n, p in model.logical_parameters()})
    return out


@pytest.mark.slow  # the quick tier keeps a smaller proof of the same feature
def test_gpt_tp2_pp2_dp2_zero_matches_adamw():
    ref_losses, ref_norms, ref_full = _reference()
    assert ref_norms[0] > CLIP, "the test must exercise clipping"
    per_rank = run_distributed(_world, 8, (1, 2), timeout_s=240)
    for rank, runs in enumerate(per_rank):
        for zero_stage, out in runs.items():
            what = f"rank {rank} zero {zero_stage}"
            for a, b in zip(out["losses"], ref_losses):
                assert math.isclose(a, b, rel_tol=1e-5), (what, out["losses"], ref_losses)
            for a, b in zip(out["norms"], ref_norms):
                assert math.isclose(a, b, rel_tol=1e-5), (what, out["norms"], ref_norms)
            assert out["memory"]["optimizer_state_bytes"] == 8 * out["numel"] // 2  # fp32: params are the master
            for name, (spec, value) in out["params"].items():
                torch.testing.assert_close(torch.from_numpy(value), spec.shard(ref_full[name]), rtol=1e-5, atol=1e-6,
                                           msg=lambda s: f"{what} {name}: {s}")
