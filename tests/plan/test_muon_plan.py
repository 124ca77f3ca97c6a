"""plan/muon.py: the owner assignment (pure, deterministic, balanced), and what the planner counts for Muon
against the real optimizer: its state bytes, and the whole-matrix exchange's all-to-all bytes."""
import os
import sys
from pathlib import Path

import pytest

from megalite.distributed import comm
from megalite.distributed import mesh as mesh_lib
from megalite.config.choices import MuonOwners
from megalite.plan.muon import assign_owners, describe_owners, ns_flops, owner_loads
from megalite.plan.muon_stage import stage_muon
from megalite.plan.muon_ranks import muon_rank_terms
from megalite.plan.per_rank import estimate, stage_model_states
from megalite.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "optim"))
from muon_helpers import cfg_batches, run_cfg  # noqa: E402


def test_ns_flops():
    assert ns_flops(6, 10, 1) == 4 * 36 * 10 + 2 * 216 == ns_flops(10, 6, 1)
    assert ns_flops(6, 10, 5) == 5 * ns_flops(6, 10, 1)


def test_balanced_owners_spread_the_work_and_are_deterministic():
    costs = [9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0]
    ranks = [[(0,), (1,), (2,)]] * len(costs)
    chosen = assign_owners(costs, ranks)
    assert chosen == assign_owners(costs, ranks)
    load = owner_loads(costs, ranks, chosen)
    assert sum(load.values()) == sum(costs)
    assert max(load.values()) == 13.0 <= 4 / 3 * 12.0  # LPT: within 4/3 of the best (12: 36 over 3 ranks)
    assert set(assign_owners(costs, ranks, policy=MuonOwners.FIRST)) == {0}
    assert assign_owners(costs, ranks, policy=MuonOwners.ROUND_ROBIN) == [0, 1, 2, 0, 1, 2, 0]
    start = {0: 100.0}  # a rank already busy (rank 0) gets nothing more
    assert 0 not in assign_owners(costs, ranks, start=start)
    text = describe_owners([f"m{i}" for i in range(len(costs))], costs, ranks, chosen)
    assert text.splitlines()[0].startswith("m0: rank ") and text.splitlines()[-1].startswith("load: ")


def test_balanced_owners_spread_the_zero_homes():
    """Equal FLOP loads tie: the choice whose home holds the fewest elements wins, so the largest matrices
    land on different ZeRO members (two members x two tp ranks; before, member 0 took both large ones)."""
    grid = [((t + 2 * d,), (2 * d, 2 * d + 1)) for d in range(2) for t in range(2)]  # (FLOP rank, its member's tp ranks)
    costs, sizes = [8.0, 8.0, 1.0, 1.0], [100, 100, 10, 10]
    ranks, homes = [[g[0] for g in grid]] * 4, [[g[1] for g in grid]] * 4
    chosen = assign_owners(costs, ranks, sizes=sizes, homes=homes)
    assert [grid[c][1] for c in chosen[:2]] == [(0, 1), (2, 3)], chosen
    assert owner_loads(sizes, homes, chosen) == {0: 110, 1: 110, 2: 110, 3: 110}
    assert assign_owners(costs, ranks)[:2] == [0, 1]  # without homes: both on member 0


@pytest.mark.slow
def test_planned_state_bytes_are_the_optimizers():
    """One buffer for the hidden matrices: the planner's optimizer state is the real optimizer's, dense and MoE."""
    from muon_helpers import train_cfg
    for settings in (dict(), dict(dense=True)):
        cfg = run_cfg(**settings)
        _, _, optimizer = train_cfg(mesh_lib.single_process_mesh(), cfg, 0)
        planned = estimate(cfg.gpt_config(), cfg).optimizer_state_bytes
        assert optimizer.memory_report()["optimizer_state_bytes"] == planned, settings
        adamw = estimate(cfg.gpt_config(), cfg.replace(optimizer="adamw")).optimizer_state_bytes
        assert adamw - planned == 4 * stage_muon(cfg.gpt_config(), cfg, 0).dense_elements + \
            4 * stage_muon(cfg.gpt_config(), cfg, 0).expert_elements > 0


def _ledger_world(layout):
    from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step
    sizes, settings = layout
    cfg = run_cfg(**settings)
    m = mesh_lib.init_mesh(layout=cfg.layout(world_size=int(os.environ["WORLD_SIZE"])))
    chunks = build_model_chunks(cfg.gpt_config(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    mbs = cfg_batches(cfg, m.dp_size, m.dp_rank, 1)[0]
    comm.ledger.reset()
    train_step(optimizer.model, optimizer, mbs, m, cfg, None)
    exchange = {f"{g}/{op}": n for (g, op), n in comm.ledger.bytes.items() if op == "all_to_all"}
    return exchange, optimizer.memory_report()["optimizer_state_bytes"]


@pytest.mark.parametrize("layout", [(dict(tp=2), dict(tp=2, zero=1)), (dict(dp=2), dict(dp=2, zero=1))],
                         ids=["tp2", "dp2"])
def test_planned_exchange_bytes_are_the_ledgers(layout):
    """The exchange's all-to-all bytes summed over the ranks are ranks x the planner's stage mean; each rank's
    bytes (its owned matrices, its shard's Muon pieces) and optimizer state (its bucket chunks' Muon and AdamW
    elements) are the planner's for that rank (plan/muon_ranks.py, plan/muon_shards.py)."""
    per_rank = run_distributed(_ledger_world, 2, layout)
    cfg = run_cfg(**layout[1])
    model = cfg.gpt_config()
    planned = stage_muon(model, cfg, 0).comm_bytes
    assert planned
    for key, n in planned.items():
        assert sum(ledger.get(key, 0) for ledger, _ in per_rank) == 2 * n, (key, per_rank, planned)
    for rank, (ledger, state) in enumerate(per_rank):
        assert ledger == muon_rank_terms(model, cfg, 0, rank=rank)[0], rank
        assert state == stage_model_states(model, cfg, 0, rank=rank)[2], rank
