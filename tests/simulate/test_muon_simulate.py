"""--simulate with --optimizer muon: each rank's whole-matrix exchange (its all-to-all bytes) and the
optimizer step's working set are the planner's for that rank (plan/muon_ranks.py), not the stage's mean.

Quick: a (tp 2, pp 2, dp 2) ZeRO-1 world of 8 whose ranks own different matrices. Slow: the issue's
two at-scale layouts cut to fewer layers (llama-70b at tp 8 x dp 16, Mixtral at tp 2, ep 8, dp 32; the full
commands and their figures are in docs/muon.md)."""
import pytest

from megalite.config import RunConfig
from megalite.plan.muon import stage_muon
from megalite.plan.muon_ranks import muon_rank_terms
from megalite.simulate.run import simulate

TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=160,
            seq_length=32, vocab_size=128, model="tiny-llama")


def _cfg(**settings) -> RunConfig:
    cfg = RunConfig.build(**{"micro_batch_size": 1, "optimizer": "muon", **settings})
    return cfg.resolved(cfg.world_size, cfg.gpt_config().vocab_size)


def _check(cfg: RunConfig, ranks: str, *, dp_slack: float, exact_state: bool = True) -> list[dict]:
    """Every term within 3%, every group's bytes equal but the ZeRO group's, within `dp_slack` (a rank's
    shard sends its own Muon pieces, the planner their mean). `exact_state` False: the optimizer state is
    left out of the terms and of the peak (at tiny shapes where the bucket chunks cut Muon's one buffer and
    AdamW's two decides it: x0.86 to x1.13 here; within 1.5% at llama-70b's tp 8 x dp 16)."""
    report = simulate(cfg, ranks, print_fn=lambda *a: None)
    for entry in report["ranks"]:
        m, p, rank = entry["measured"], entry["planned"], entry["rank"]
        if not exact_state:
            for side in (m, p):
                side["peak_bytes"] -= side.pop("optimizer_state_bytes")
        for term in ("param_bytes", "grad_bytes", "optimizer_state_bytes", "activation_peak_bytes", "peak_bytes"):
            if term in m:
                assert abs(m[term] / p[term] - 1) < 0.03, (rank, term, m[term], p[term])
        dp = [g for g in m["comm_bytes"] if g.startswith("dp")]
        for group in dp:
            assert abs(m["comm_bytes"].pop(group) / p["comm_bytes"].pop(group) - 1) < dp_slack, (rank, group)
        assert m["comm_bytes"] == p["comm_bytes"], rank
    return report["ranks"]


def test_each_muon_rank_sends_and_holds_what_the_planner_counts_for_it():
    cfg = _cfg(**TINY, tp=2, pp=2, dp=2, zero=1, global_batch_size=4)
    entries = _check(cfg, "4,5", dp_slack=0.03, exact_state=False)
    assert len({e["measured"]["comm_bytes"]["tp"] for e in entries}) > 1  # the ranks differ
    mean = stage_muon(cfg.gpt_config(), cfg, 1).comm_bytes["tp/all_to_all"]  # so the stage's mean would not do
    assert mean not in [muon_rank_terms(cfg.gpt_config(), cfg, 1, rank=rank)[0]["tp/all_to_all"] for rank in (4, 5)]


@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    dict(model="llama-70b", num_layers=16, tp=8, pp=2, dp=16, zero=1, sequence_parallel=True, global_batch_size=32),
    dict(model="mixtral-8x7b", num_layers=4, tp=2, ep=8, dp=32, pp=2, global_batch_size=64),
], ids=["llama-70b-16-layers", "mixtral-4-layers"])
def test_muon_at_scale_cut_to_fewer_layers(settings):
    cfg = _cfg(precision="bf16", **settings)
    last = cfg.world_size - 1
    _check(cfg, f"0,{cfg.parallel.tp * 5},{last}", dp_slack=0.01)
