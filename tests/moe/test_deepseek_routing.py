"""DeepSeek-V3's router and experts: group-limited sigmoid routing with the correction bias for the choice
only, normalised top-k weights times the routed scaling factor, shared experts and dense first blocks.

The oracle is transformers' DeepseekV3MoE (and DeepseekV2Moe: softmax scores, a group's maximum, weights
not normalised) built from a small config, with megalite's MoELayer loaded with its weights; the layout
test runs (dp 2, ep 2) with group routing against the single process."""
import pytest
import torch

from megalite.parameters import params as P
from megalite.config import RunConfig
from megalite.distributed.layer_groups import LayerGroups
from megalite.distributed.mesh import init_mesh, single_process_mesh
from megalite.model import preset
from megalite.config.moe import MoEConfig
from megalite.moe.layer import MoELayer
from megalite.moe.router import Router
from megalite.testing import assert_tensor_close, run_distributed
from megalite.training.launch_checks import launch_problems
from moe_helpers import cfg_for, train

transformers = pytest.importorskip("transformers")

E, H, F_EXPERT, SHARED = 8, 32, 16, 2  # experts, hidden, expert width, shared experts


def _hf_moe(version: int):
    """A small DeepSeek-V3 (or V2) MoE block from transformers, random weights and correction bias."""
    torch.manual_seed(7)
    if version == 3:
        cfg = transformers.DeepseekV3Config(hidden_size=H, moe_intermediate_size=F_EXPERT, n_routed_experts=E,
                                            num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
                                            routed_scaling_factor=2.5, n_shared_experts=SHARED)
        block = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(cfg)
    else:
        cfg = transformers.DeepseekV2Config(hidden_size=H, moe_intermediate_size=F_EXPERT, n_routed_experts=E,
                                            num_experts_per_tok=3, n_group=4, topk_group=2,
                                            topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                                            n_shared_experts=SHARED)
        block = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
        if version == 3:
            block.gate.e_score_correction_bias.normal_(0, 0.1)
    return block


def _megalite_moe(version: int, hf_block) -> MoELayer:
    moe = MoEConfig(num_experts=E, topk=3, ffn_hidden_size=F_EXPERT, num_groups=4, group_topk=2,
                    load_balancing_type="none", shared_expert_intermediate_size=SHARED * F_EXPERT,
                    **(dict(score_function="sigmoid", enable_expert_bias=True, topk_scaling_factor=2.5)
                       if version == 3 else dict(pre_softmax=True, topk_scaling_factor=1.5)))
    config = preset("tiny-llama", hidden_size=H, num_attention_heads=4, num_query_groups=4, moe=moe)
    layer = MoELayer(config, LayerGroups(), sequence_parallel=False)
    with torch.no_grad():
        layer.router.weight.copy_(hf_block.gate.weight)
        if version == 3:
            layer.router.expert_bias.copy_(hf_block.gate.e_score_correction_bias)
        for e in range(E):
            layer.experts[str(e)].fc1_weight.copy_(hf_block.experts.gate_up_proj[e])
            layer.experts[str(e)].fc2_weight.copy_(hf_block.experts.down_proj[e])
        shared = hf_block.shared_experts
        layer.shared_expert.fc1.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        layer.shared_expert.fc2.weight.copy_(shared.down_proj.weight)
    return layer


@pytest.mark.parametrize("version", [3, 2])
def test_moe_layer_equals_transformers_deepseek_moe(version):
    hf_block = _hf_moe(version)
    layer = _megalite_moe(version, hf_block).eval()
    x = torch.randn(6, 2, H)  # [s, b, h]; HF's [b, s, h] is its transpose
    x_hf = x.transpose(0, 1).contiguous().requires_grad_(True)
    x_ml = x.clone().requires_grad_(True)
    expected = hf_block(x_hf)
    got = layer(x_ml)
    assert_tensor_close(got, expected.transpose(0, 1), rtol=1e-5, what="output")
    got.square().sum().backward()
    expected.square().sum().backward()
    assert_tensor_close(x_ml.grad, x_hf.grad.transpose(0, 1), rtol=1e-5, what="input gradient")
    assert_tensor_close(layer.router.weight.grad, hf_block.gate.weight.grad, rtol=1e-5, what="router gradient")
    for e in range(E):
        assert_tensor_close(layer.experts[str(e)].fc1_weight.grad, hf_block.experts.gate_up_proj.grad[e],
                            rtol=1e-5, what=f"expert {e}")
    # the bias moved the choice (it is not a no-op here), and never the weights
    if version == 3:
        _, _, ids = hf_block.gate(x_hf.detach())
        unbiased = Router(H, layer.moe.replace(enable_expert_bias=False), 0.02)
        unbiased.weight.data.copy_(layer.router.weight)
        assert not torch.equal(unbiased(x.reshape(-1, H).float(), 2).expert_ids.sort(-1).values, ids.sort(-1).values)


def test_group_limited_routing_stays_inside_the_chosen_groups():
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=8, topk=2, score_function="sigmoid", num_groups=4, group_topk=1)
    router = Router(16, moe, init_std=1.0)
    routing = router(torch.randn(64, 16), 1)
    groups = routing.expert_ids // 2  # two experts per group, one group per token: both in it
    assert torch.equal(groups[:, 0], groups[:, 1])
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(64))  # normalised top-k


def test_first_dense_blocks_from_a_layer_list():
    cfg = RunConfig.build(model="moe-tiny", num_layers=3, num_experts=4, moe_layer_freq=(0, 1, 1))
    model = cfg.gpt_config()
    assert [model.moe.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert RunConfig.build(model="moe-tiny", moe_layer_freq=(2,)).gpt_config().moe.layer_freq == 2


@pytest.mark.parametrize("settings, message", [
    (dict(moe_router_num_groups=2, moe_router_group_topk=3), "--moe-router-group-topk 3 must be between 1 and "
                                                             "--moe-router-num-groups 2"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "--moe-router-num-groups 3 must divide"),
    (dict(moe_router_group_topk=1), "needs --moe-router-num-groups"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=1), "raise --moe-router-group-topk"),
    (dict(moe_layer_freq=(0, 1, 2)), "one 0 (dense) or 1 (MoE) per layer"),
    (dict(moe_layer_freq=(0, 1, 1)), "lists 3 blocks but the model has 2"),
])
def test_bad_group_routing_is_refused_in_one_line(settings, message):
    cfg = RunConfig.build(model="moe-tiny", num_experts=4, **settings)
    problems = launch_problems(cfg.resolved(1), 1)
    assert any(message in p for p in problems), problems


GROUPED = dict(num_experts=8, moe_router_topk=3, moe_router_num_groups=4, moe_router_group_topk=2,
               moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5,
               moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05,
               moe_shared_expert_intermediate_size=32, moe_layer_freq=(0, 1), moe_aux_loss_coeff=0.0)


def _grouped_world():
    m = init_mesh(tp=1, pp=1, dp=2, ep=2, num_experts=GROUPED["num_experts"], replace=True)
    cfg = cfg_for(1, 1, 2, 2, **GROUPED)
    assert launch_problems(cfg.resolved(2), 2) == []
    chunks, optimizer, results = train(m, cfg)
    with optimizer.model.gathered():
        final = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}
    return [r.loss for r in results], final


def test_group_routing_at_ep_2_equals_the_single_process():
    chunks, _, results = train(single_process_mesh("cpu"), cfg_for(**GROUPED))
    reference = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}
    for losses, final in run_distributed(_grouped_world, 2, timeout_s=120):
        torch.testing.assert_close(losses, [r.loss for r in results], rtol=1e-5, atol=0)
        for name, ref in reference.items():
            if name in final:  # each ep rank holds its own experts
                assert_tensor_close(final[name], ref, rtol=1e-5, what=name)
