"""plan/param_list.py: the planner's list of a stage's parameters is the real model's (names, shapes, tp
splits, fused blocks, experts, order) and sums to the planner's parameter count at scale."""
import pytest

from megalite.config import RunConfig
from megalite.model.gpt import GPTModel
from megalite.parameters import params as P
from megalite.plan.param_list import Degrees, chunk_params, chunk_units, stage_param_list
from megalite.plan.params import stage_params


def _fields_of_real(model: GPTModel) -> list[tuple]:
    out = []
    for name, p in model.logical_parameters():
        spec = P.shard_spec(p)
        out.append((name, spec.full_shape, spec.dim, spec.blocks, spec.padded_size, P.is_expert_parallel(p),
                    tuple(p.shape)))
    return out


@pytest.mark.parametrize("model,settings", [
    ("tiny-llama", {}), ("tiny", {}),  # Llama (fused gate/up), GPT-2 (biases, LayerNorms, learned positions)
    ("moe-tiny", {}), ("deepseek-tiny", dict(mtp_num_layers=1)),  # experts and router; MLA, shared expert, MTP
    ("qwen2.5-7b", dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                        vocab_size=300)),  # qkv bias
    ("qwen3-30b-a3b", dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=300,
                           moe_ffn_hidden_size=32, num_experts=4, moe_router_topk=2)),  # q/k norms
])
def test_the_planned_parameters_are_the_models(model, settings):
    """Every parameter's fields in model order, and ZeRO-3's units (GPTModel.zero3_units)."""
    cfg = RunConfig.build(model=model, **settings)
    config = cfg.gpt_config()
    real_model = GPTModel(config, None, device="meta")
    real = _fields_of_real(real_model)
    planned = [(q.name, q.full_shape, q.dim, q.blocks, q.padded, q.expert, q.local_shape)
               for q in chunk_params(config, Degrees.of(cfg), range(config.num_layers), pre=True, post=True)]
    assert planned == real
    names = {id(p): name for name, p in real_model.logical_parameters()}
    real_units = [([names[id(p)] for p in unit.params], unit.kind) for unit in real_model.zero3_units()]
    planned_units = [([q.name for q in params], kind)
                     for params, kind in chunk_units(config, Degrees.of(cfg), range(config.num_layers), pre=True,
                                                     post=True)]
    assert planned_units == real_units  # ZeRO-3's units: members, their order and kind


@pytest.mark.parametrize("settings", [
    dict(model="llama-70b", tp=8, pp=8, dp=16, virtual_stages=2),
    dict(model="mixtral-8x7b", tp=2, ep=8, dp=32, pp=4),
    dict(model="mixtral-8x7b", tp=2, ep=8, dp=32, pp=4, etp=1),
    dict(model="deepseek-tiny", tp=2, pp=2, num_layers=4, mtp_num_layers=1),
    dict(model="gpt2-124m", tp=4, pp=3),
])
def test_a_stages_planned_parameters_sum_to_its_count(settings):
    """Every stage at tp, pp, virtual stages, ep and etp > 1: the tp-local sizes add up to `stage_params`."""
    cfg = RunConfig.build(**settings)
    cfg = cfg.resolved(cfg.world_size, cfg.gpt_config().vocab_size)
    model = cfg.gpt_config()
    for stage in range(cfg.parallel.pp):
        assert sum(p.numel for p in stage_param_list(model, cfg, stage)) == stage_params(model, cfg, stage), stage
