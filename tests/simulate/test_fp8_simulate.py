"""--simulate with FP8: the planner counts what FP8 adds (plan/fp8.py, plan/fp8_amax.py).

The simulated step runs the real FP8 linears and grouped experts on meta tensors; against it the
planner's communication is exact per group (the amax all-reduces over tp, cp and the experts'
token group included), and FP8's activation terms are exact: an FP8 rank's saved activations
differ from the planner's by the same bytes as the training-dtype rank's (whose small residual,
the norms' and routing's, is not FP8's).
"""
import pytest

from megalite.config import RunConfig
from megalite.plan.communication import communication_bytes
from megalite.simulate.planned import planned_terms
from megalite.simulate.rank_step import simulate_rank

TINY = dict(model="tiny-llama", micro_batch_size=2, num_layers=2, seq_length=32)  # llama: SwiGLU, RoPE, GQA
LAYOUTS = {
    "tp 2, SP": (dict(tp=2, sequence_parallel=True), 1),
    "tp 2, pp 2, dp 2": (dict(tp=2, pp=2, dp=2, zero=1, global_batch_size=8), 4),
    "tp 2, SP, cp 2": (dict(tp=2, cp=2, sequence_parallel=True), 3),
    "moe-tiny, tp 2, SP": (dict(model="moe-tiny", tp=2, sequence_parallel=True, micro_batch_size=2), 1),
    "moe-tiny, ep 2, dp 2": (dict(model="moe-tiny", dp=2, ep=2, micro_batch_size=2, global_batch_size=8), 1),
}


def _cfg(settings: dict, **fp8) -> RunConfig:
    shape = {} if "model" in settings else TINY
    cfg = RunConfig.build(**{"precision": "bf16", **shape, **settings, **fp8})
    return cfg.resolved(cfg.world_size, cfg.gpt_config().vocab_size)


def _residual(cfg: RunConfig, rank: int):
    measured = simulate_rank(cfg, rank)
    planned = planned_terms(cfg, measured.coords["pp"])
    return measured, planned, measured.activation_peak_bytes - planned["activation_peak_bytes"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_sends_and_keeps_what_the_planner_counts(layout, recipe):
    settings, rank = LAYOUTS[layout]
    cfg = _cfg(settings, fp8_format="hybrid", fp8_recipe=recipe)
    measured, planned, residual = _residual(cfg, rank)
    assert measured.comm_bytes == planned["comm_bytes"], (layout, recipe)
    plain_residual = _residual(_cfg(settings), rank)[2]
    assert residual == plain_residual, (layout, recipe, residual, plain_residual)
    assert abs(measured.activation_peak_bytes / planned["activation_peak_bytes"] - 1) < 0.03


def test_the_amax_all_reduces_are_counted_by_group():
    """tp 2 with SP and cp 2, tensorwise: per block and microbatch 14 scalars over tp (x, W, g and W's
    dgrad cast where sharded) and 8 over cp (x and g of each linear); the planner's tp and cp
    all-reduce bytes exceed the training dtype's by exactly these 4-byte all-reduces."""
    settings = LAYOUTS["tp 2, SP, cp 2"][0]
    fp8 = communication_bytes(_cfg(settings).gpt_config(), _cfg(settings, fp8_format="hybrid"), 0)
    plain = communication_bytes(_cfg(settings).gpt_config(), _cfg(settings), 0)
    blocks = TINY["num_layers"]
    assert fp8["tp/all_reduce"] - plain.get("tp/all_reduce", 0) == 4 * 14 * blocks
    assert fp8["cp/all_reduce"] - plain.get("cp/all_reduce", 0) == 4 * 8 * blocks



@pytest.mark.slow  # 4 simulations of 2 ranks' steps: ~8 s
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("sp", [True, False], ids=["SP", "no SP"])
def test_latent_attention_in_fp8_sends_and_keeps_what_the_planner_counts(recipe, sp):
    """deepseek-tiny's dense block and MoE block (a shared expert) at tp 2: MLA's two up-projections'
    amaxes and, under SP, their latents' FP8 gathers (plan/mla.py, plan/fp8_amax.py); tensorwise keeps
    their inputs and the shared expert's in 1 byte (plan/fp8.py)."""
    settings = dict(model="deepseek-tiny", num_layers=2, tp=2, sequence_parallel=sp, micro_batch_size=2)
    measured, planned, residual = _residual(_cfg(settings, fp8_format="hybrid", fp8_recipe=recipe), 1)
    assert measured.comm_bytes == planned["comm_bytes"], recipe
    assert residual == _residual(_cfg(settings), 1)[2], recipe


@pytest.mark.parametrize("model", ["tiny-llama", pytest.param("deepseek-tiny", marks=pytest.mark.slow)])
def test_full_recompute_regathers_only_the_forward_fp8_input(model):
    """Under SP a block full recompute re-runs gathers its linears' inputs forward once more, not the weight
    gradient's re-gather: rowwise sends FP8 and per-token scales forward and the training dtype in backward,
    so the re-run's bytes are the forward's (plan/fp8.sp_input_gathers; the planner once counted half of
    both, 15,872 bytes a step too many on tiny-llama's tp group, 19,200 on deepseek-tiny's latents)."""
    shape = TINY if model == "tiny-llama" else dict(model=model, num_layers=2, micro_batch_size=2)
    cfg = _cfg(dict(shape, tp=2, sequence_parallel=True, recompute="full"), fp8_format="hybrid", fp8_recipe="rowwise")
    measured = simulate_rank(cfg, 1)
    assert measured.comm_bytes == planned_terms(cfg, 0)["comm_bytes"]
