"""The planner under hybrid sharding (--dp-shard S): both groups' bytes, the memory of S-way shards, the
links they cross, and --suggest's search of S. The bytes are checked against real runs in
tests/data_parallel/test_hybrid_shard.py and against the simulated 16,384-rank world in
docs/hybrid_sharding.md."""
from megalite.config import RunConfig
from megalite.config.model import preset
from megalite.plan import communication_bytes, estimate
from megalite.plan.hardware import load_profile
from megalite.plan.links import link_uses
from megalite.plan.params import stage_params
from megalite.plan.ranking import _with_best_shard
from megalite.plan.timing import predict_step_time

LLAMA_405B = dict(model="llama-405b", tp=8, pp=16, dp=128, zero=3, precision="bf16", micro_batch_size=1,
                  global_batch_size=2048, decoder_first_stage_layers=7, decoder_last_stage_layers=7)


def _cfg(**kw):
    return RunConfig.build(**{**LLAMA_405B, **kw})


def test_the_shard_group_carries_flat_zeros_bytes_and_the_replicas_one_shard():
    model = preset("llama-405b")
    for zero in (1, 3):
        flat = communication_bytes(model, _cfg(zero=zero), 0)
        hybrid = communication_bytes(model, _cfg(zero=zero, dp_shard=8), 0)
        for op in ("reduce_scatter", "all_gather"):
            assert hybrid[f"dp_shard/{op}"] == flat[f"dp/{op}"]
        params = stage_params(model, _cfg(), 0)
        assert flat["dp/reduce_scatter"] == params * 4 * (16 if zero == 3 else 1)  # fp32, m = 16 at ZeRO-3
        assert hybrid["dp_replicate/all_reduce"] == -(-params // 8) * 4  # this rank's reduced 1/8, once a step
        assert not any(k.startswith("dp/") for k in hybrid)


def test_s_way_shards_hold_dp_over_s_times_the_state():
    model = preset("llama-405b")
    flat, hybrid = estimate(model, _cfg()), estimate(model, _cfg(dp_shard=8))
    assert abs(hybrid.optimizer_state_bytes / flat.optimizer_state_bytes - 16) < 0.01


def test_links_of_405b_at_s_8_and_128():
    """S = 8: the shard group (8 ranks, one per node at tp 8) and the replicas (16) both cross nodes; the
    replicas' all-reduce, 1/8 of a step's gradient in fp32, is exposed whole. S = 128 is flat ZeRO."""
    model = preset("llama-405b")
    s8 = {u.group: u for u in link_uses(model, _cfg(dp_shard=8))}
    flat = {u.group: u for u in link_uses(model, _cfg())}
    assert (s8["dp_shard"].ranks, s8["dp_replicate"].ranks, flat["dp"].ranks) == (8, 16, 128)
    assert s8["dp_shard"].link == s8["dp_replicate"].link == "inter-node" and s8["tp"].link == "intra-node"
    assert s8["dp_shard"].bytes == flat["dp"].bytes and "dp_replicate" not in flat
    assert s8["dp_replicate"].exposed_seconds == s8["dp_replicate"].seconds > 0
    assert s8["dp_shard"].seconds < flat["dp"].seconds  # 8-rank rings: the per-unit latency of 128 is gone


def test_suggest_takes_a_hybrid_s_where_it_predicts_faster():
    model, hw = preset("llama-405b"), load_profile(None)
    flat = _cfg()
    parts = predict_step_time(model, flat, hw, ranks_per_node=8).breakdown()
    cfg, _, best = _with_best_shard(model, flat, estimate(model, flat), parts, 16384, 1e13, 8, hw)
    assert cfg.dp_shard < cfg.dp and best["total"] < parts["total"]
    zero1 = _cfg(zero=0)  # nothing sharded: nothing to search
    assert _with_best_shard(model, zero1, None, {"total": 1.0}, 16384, 1e13, 8, hw)[0] is zero1


def test_simulated_worlds_check_the_shard_and_replica_groups_of_every_rank():
    from megalite.layout import Layout
    from megalite.simulate.ranks import check_groups, expected_groups

    assert check_groups(Layout(tp=8, cp=1, dp=16, pp=2, dp_shard=4)) == []
    assert check_groups(Layout(tp=2, cp=2, dp=8, pp=1, ep=4, etp=1, dp_shard=2, num_experts=8)) == []
    groups = expected_groups(Layout(tp=2, cp=1, dp=4, pp=1, ep=1, etp=2, dp_shard=2))
    assert groups["dp_shard"] == [[0, 2], [4, 6], [1, 3], [5, 7]] and groups["dp_replicate"][0] == [0, 4]
