"""MoE training steps under every parallel layout equal the single-process model (fp32, dropless).

One forked world of 4 ranks runs each layout on a mesh of its own: (tp 2, ep 2), (tp 2, ep 2, SP),
(dp 4, ep 2) with ZeRO 1 (expert-dp groups of 2), (dp 4, ep 4) with the all-gather dispatcher and
ZeRO 2, (pp 2, ep 2) under 1F1B, (tp 2, dp 2, ep 2) with ZeRO 1, and (tp 2, dp 2) with ZeRO 3 (experts
inside the block units). Every layout trains STEPS steps through `train_step` from the same seed
and data as the reference: every step's loss and global grad norm (clipping counts each expert
once) and every parameter after the last step must match (~1e-5 relative), and the experts' traffic
must be on the ep group (all-to-all or all-gather) and, with expert-dp > 1, their gradient on edp.
"""
import pytest
import torch

from megalite import comm, mesh
from megalite import params as P
from megalite.config import RunConfig
from megalite.mesh import single_process_mesh
from megalite.testing import assert_tensor_close, run_distributed
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

STEPS, MICRO, GLOBAL, SEQ = 2, 2, 8, 16




def _batches(dp, dp_rank):
    out = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, 257, (GLOBAL, SEQ + 1), generator=gen)
        inputs, labels = ids[:, :-1], ids[:, 1:].clone()
        labels[step % GLOBAL, : 3 + step] = -100  # uneven target counts across dp ranks
        per_rank = GLOBAL // dp
        mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        out.append([{"input_ids": i, "labels": t} for i, t in zip(inputs[mine].split(MICRO), labels[mine].split(MICRO))])
    return out


def _cfg(tp=1, pp=1, dp=1, ep=1, **kw):
    return RunConfig.build(tp=tp, pp=pp, dp=dp, ep=ep, micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-3,
                           weight_decay=0.1, clip_grad=0.5, seed=3, adam_eps=1e-6, model="moe-tiny", num_layers=2,
                           hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                           seq_length=SEQ, vocab_size=257, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                           moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, **kw)


def _train(m, cfg):
    chunks = build_model_chunks(cfg.gpt_config(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    results = []
    for step, mbs in enumerate(_batches(m.dp_size, m.dp_rank)):
        if step == STEPS - 1:
            comm.ledger.reset()
        results.append(train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3))
    return chunks, optimizer, results


@pytest.fixture(scope="module")
def reference():
    m = single_process_mesh("cpu")
    chunks, _, results = _train(m, _cfg())
    params = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}
    return [r["loss"] for r in results], [r["grad_norm"] for r in results], params, results[-1]


LAYOUTS = [  # (tp, pp, dp, ep), settings
    ((2, 1, 2, 2), dict()),
    ((2, 1, 2, 2), dict(sequence_parallel=True)),
    ((1, 1, 4, 2), dict(zero=1)),
    ((1, 1, 4, 4), dict(zero=2, moe_token_dispatcher_type="allgather")),
    ((1, 2, 2, 2), dict()),
    ((2, 1, 2, 2), dict(zero=1)),
    ((2, 1, 2, 1), dict(zero=3)),
]


def _world(reference):
    ref_losses, ref_norms, ref_params, _ = reference
    checked = []
    for (tp, pp, dp, ep), settings in LAYOUTS:
        m = mesh.init_mesh(tp=tp, pp=pp, dp=dp, ep=ep)
        cfg = _cfg(tp, pp, dp, ep, **settings)
        assert cfg.resolved(4).validate(4) == []
        what = f"tp={tp} pp={pp} dp={dp} ep={ep} {settings}"
        chunks, optimizer, results = _train(m, cfg)
        torch.testing.assert_close([r["loss"] for r in results], ref_losses, rtol=1e-5, atol=0, msg=what)
        torch.testing.assert_close([r["grad_norm"] for r in results], ref_norms, rtol=1e-5, atol=0, msg=what)
        with optimizer.model.gathered():
            for chunk in chunks:
                for logical, p in chunk.logical_parameters():
                    assert_tensor_close(p, P.shard_spec(p).shard(ref_params[logical]), rtol=1e-5,
                                        what=f"{what} {logical}")
        stats = {k: v for k, v in results[-1].items() if k.startswith("moe_")}
        checked.append(((tp, pp, dp, ep), settings, sorted(f"{g}/{op}" for g, op in comm.ledger.bytes if
                                                           g in ("ep", "edp")), stats))
    return checked


def test_moe_layouts_match_the_single_process_model(reference):
    ref_losses, _, _, ref_last = reference
    assert ref_losses[-1] < ref_losses[0] + 0.5 and ref_last["moe_aux_loss"] > 0 and ref_last["moe_z_loss"] > 0
    for checked in run_distributed(_world, 4, reference, timeout_s=300):
        assert len(checked) == len(LAYOUTS)
        for (tp, pp, dp, ep), settings, groups, stats in checked:
            if ep > 1:  # the tokens travelled over the ep group
                dispatch = "all_gather" if settings.get("moe_token_dispatcher_type") == "allgather" else "all_to_all"
                assert f"ep/{dispatch}" in groups, (tp, pp, dp, ep, groups)
            if ep > 1 and dp // ep > 1:  # expert gradients reduced over the expert-data-parallel group
                assert any(g.startswith("edp/") for g in groups), groups
            # the metrics are the step's, over every replica: the same as the reference's
            for key in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance"):
                assert stats[key] == pytest.approx(ref_last[key], rel=1e-5), (key, settings)
            assert stats["moe_dropped_tokens"] == 0
