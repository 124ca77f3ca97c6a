"""plan/muon_stage.py: the stage-level Muon figures (the estimate's and --suggest's) read plan/param_list.py's
list, so latent attention's matrices (MLA's replicated down-projections, its tp-split up-projections) and the
multi-token-prediction depth's count as the optimizer runs them: deepseek-tiny with one MTP depth, on real
2-rank gloo worlds, against the optimizer's own matrices, their Newton-Schulz FLOPs and owners, and the comm
ledger's all-to-all bytes."""
import os

import pytest

from megalite.config import RunConfig
from megalite.distributed import comm
from megalite.distributed import mesh as mesh_lib
from megalite.plan.muon import owner_loads
from megalite.plan.muon_ranks import muon_rank_terms
from megalite.plan.muon_stage import stage_muon
from megalite.plan.param_list import stage_param_list
from megalite.testing import run_distributed

SEQ = 16


def _cfg(**layout) -> RunConfig:
    """deepseek-tiny cut to a dense block and an MoE block, with one MTP depth (an MoE block too)."""
    return RunConfig.build(model="deepseek-tiny", num_layers=2, moe_layer_freq=[0, 1], mtp_num_layers=1,
                           seq_length=SEQ, micro_batch_size=2, global_batch_size=4, optimizer="muon",
                           muon_ns_dtype="fp32", seed=3,
                           lr_warmup_iters=0, lr_decay_style="constant", **layout)


def _world(layout):
    """(this rank's all-to-all ledger, the optimizer's Muon parameter names, their NS FLOPs, the FLOPs per
    global rank under its owner assignment) after one real step."""
    import torch
    from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step
    cfg = _cfg(**layout)
    m = mesh_lib.init_mesh(layout=cfg.layout(world_size=int(os.environ["WORLD_SIZE"])))
    chunks = build_model_chunks(cfg.gpt_config(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    muon = optimizer.muon
    gen = torch.Generator().manual_seed(11 + m.dp_rank)
    ids = torch.randint(0, 257, (2, 2, SEQ + 1), generator=gen)
    mbs = [{"input_ids": x[:, :-1], "labels": x[:, 1:].clone()} for x in ids]
    comm.ledger.reset()
    train_step(optimizer.model, optimizer, mbs, m, cfg, None)
    exchange = {f"{g}/{op}": n for (g, op), n in comm.ledger.bytes.items() if op == "all_to_all"}
    loads = owner_loads(muon.costs, [[c for c, _, _ in choices] for choices in muon.candidates], muon.chosen)
    names = sorted(optimizer.names[i] for i in muon.matrices)
    return exchange, names, sum(muon.costs), loads


@pytest.mark.parametrize("layout", [dict(tp=2, zero=1), pytest.param(dict(dp=2, zero=1), marks=pytest.mark.slow)],
                         ids=["tp2", "dp2"])
def test_deepseek_tiny_muon_flops_and_bytes_are_the_optimizers(layout):
    """MLA, MoE (a shared expert, routed experts) and an MTP depth: the planner's Muon matrices are the
    optimizer's, its NS FLOPs (total and the busiest owner's) and the exchange's bytes (ranks x the mean)
    equal the real run's. The plain-block count it replaced was off here: at tp 2 it counted q, k, v and
    proj of standard attention (for the whole deepseek-tiny at tp 2 x dp 2 x ep 2: 1.557 GFLOP and tp bytes
    380,928 where the run does 1.123 GFLOP and sends 294,912) and left the MTP depth out."""
    per_rank = run_distributed(_world, 2, layout)
    cfg = _cfg(**layout)
    model = cfg.gpt_config()
    planned = stage_muon(model, cfg, 0)
    names = {p.name for p in stage_param_list(model, cfg, 0) if p.hidden}
    assert any("mtp." in n for n in names) and any(".q_down" in n for n in names) and any(".experts." in n for n in names)
    loads = {}
    for _, real_names, total, rank_loads in per_rank:
        assert set(real_names) == names
        assert total == planned.ns_flops_total
        for rank, flops in rank_loads.items():
            assert loads.setdefault(rank, flops) == flops  # every rank agrees on the assignment
    assert max(loads.values()) == planned.ns_flops_busiest
    assert planned.comm_bytes
    for key, n in planned.comm_bytes.items():
        assert sum(ledger.get(key, 0) for ledger, *_ in per_rank) == 2 * n, (key, per_rank, planned)
    for rank, (ledger, *_) in enumerate(per_rank):
        assert ledger == muon_rank_terms(model, cfg, 0, rank=rank)[0], rank
