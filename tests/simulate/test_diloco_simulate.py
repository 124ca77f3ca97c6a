"""--simulate of a streaming DiLoCo run (megalite/plan/diloco.py): tp 2, dp 4 as 2 replica groups of S = 2,
H = 2, F = 2, so the simulated step (the run's first) ends with fragment 0's outer step. Rank 0 sends exactly
the planner's bytes on every group (the fragment's fp32 shard over dp_replicate and its buckets' gather over
dp_shard, the token counts, the per-group norm slots over the world) and holds its optimizer state (with
θ_outer and the momentum) to the byte; ZeRO 3 in the slow tier."""
import pytest

from megalite.config import RunConfig
from megalite.simulate.planned import planned_terms
from megalite.simulate.rank_step import simulate_rank

TINY = dict(micro_batch_size=1, num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)


@pytest.mark.parametrize("zero", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_a_streaming_diloco_rank_sends_and_holds_what_the_planner_counts(zero):
    cfg = RunConfig.build(tp=2, dp=4, dp_shard=2, zero=zero, global_batch_size=4, diloco_inner_steps=2,
                          diloco_fragments=2, **TINY)
    cfg = cfg.resolved(cfg.world_size, cfg.gpt_config().vocab_size)
    measured, planned = simulate_rank(cfg, 0), planned_terms(cfg, 0)
    assert measured.comm_bytes == planned["comm_bytes"]
    assert measured.comm_bytes["dp_replicate"] > 8  # the outer step ran (and the token count)
    assert measured.optimizer_state_bytes == planned["optimizer_state_bytes"]
