"""Multi-head latent attention (megalite/model/mla.py) against transformers' DeepseekV3Attention and
DeepseekV2Attention built from small configs (YaRN RoPE with mscale, interleaved RoPE pairs, d_qk != d_v,
with and without a query latent), and in every tensor-parallel layout against the single process."""
import os
import sys

import pytest
import torch

from megalite.config import RunConfig
from megalite.distributed.layer_groups import LayerGroups
from megalite.distributed.mesh import init_mesh, single_process_mesh
from megalite.model import preset
from megalite.model.mla import MultiLatentAttention
from megalite.model.rope import rope_tables
from megalite.plan.params import stage_params
from megalite.tensor_parallel.random import TensorParallelRNG
from megalite.testing import assert_tensor_close, run_distributed
from megalite.training.launch_checks import launch_problems
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

sys.path.insert(0, os.path.dirname(__file__))
from mla_training import final_parameters  # noqa: E402

transformers = pytest.importorskip("transformers")

H, HEADS, S, B = 64, 4, 12, 2
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, beta_fast=32, beta_slow=1,
            mscale=0.9, mscale_all_dim=0.7)
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=12)


def _hf_attention(version: int, q_lora_rank):
    kw = dict(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=q_lora_rank,
              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=32,
              rope_parameters=dict(rope_theta=10000.0, **YARN))
    torch.manual_seed(3)
    if version == 3:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as M
        cfg = transformers.DeepseekV3Config(**kw)
        return M.DeepseekV3Attention(cfg, 0), M.DeepseekV3RotaryEmbedding(cfg)
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as M
    cfg = transformers.DeepseekV2Config(**kw)
    return M.DeepseekV2Attention(cfg, 0), M.DeepseekV2RotaryEmbedding(cfg)


def _load(ours: MultiLatentAttention, hf) -> None:
    with torch.no_grad():
        if ours.q_down is not None:
            ours.q_down.copy_(hf.q_a_proj.weight)
            ours.q_norm.weight.copy_(hf.q_a_layernorm.weight.normal_(1, 0.1))
            ours.q_up.weight.copy_(hf.q_b_proj.weight)
        else:
            ours.q_up.weight.copy_(hf.q_proj.weight)
        ours.kv_down.copy_(hf.kv_a_proj_with_mqa.weight)
        ours.kv_norm.weight.copy_(hf.kv_a_layernorm.weight.normal_(1, 0.1))
        ours.kv_up.weight.copy_(hf.kv_b_proj.weight)
        ours.proj.weight.copy_(hf.o_proj.weight)


@pytest.mark.parametrize("version, q_lora_rank", [(3, 24), (3, None), (2, None)])
def test_latent_attention_equals_transformers(version, q_lora_rank):
    hf, rotary = _hf_attention(version, q_lora_rank)
    config = preset("tiny-llama", hidden_size=H, num_attention_heads=HEADS, rope_scaling=YARN, seq_length=32,
                    mla={**MLA, "q_lora_rank": q_lora_rank})
    ours = MultiLatentAttention(config, LayerGroups(), sequence_parallel=False)
    _load(ours, hf)
    x = torch.randn(S, B, H)  # [s, b, h]
    x_hf = x.transpose(0, 1).contiguous().requires_grad_(True)
    positions = torch.arange(S).unsqueeze(0)
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
    expected, _ = hf(x_hf, position_embeddings=rotary(x_hf, positions), attention_mask=mask)
    x_ours = x.clone().requires_grad_(True)
    cos, sin = rope_tables(32, config.rope_head_dim, config.rope_theta, scaling=config.rope_scaling)
    got = ours.proj(ours.core(*ours.qkv(x_ours), (cos[:S], sin[:S]), TensorParallelRNG(0)))
    assert_tensor_close(got, expected.transpose(0, 1), rtol=1e-5, what="output")
    got.square().sum().backward()
    expected.square().sum().backward()
    assert_tensor_close(x_ours.grad, x_hf.grad.transpose(0, 1), rtol=1e-5, what="input gradient")
    assert_tensor_close(ours.kv_down.grad, hf.kv_a_proj_with_mqa.weight.grad, rtol=1e-5, what="kv_down")
    assert_tensor_close(ours.kv_up.weight.grad, hf.kv_b_proj.weight.grad, rtol=1e-5, what="kv_up")


def test_yarn_frequencies_and_magnitude_equal_transformers():
    _, rotary = _hf_attention(3, 24)
    cos, sin = rope_tables(32, 8, 10000.0, scaling=YARN)
    hf_cos, hf_sin = rotary(torch.zeros(1), torch.arange(32).unsqueeze(0))
    torch.testing.assert_close(cos, hf_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=1e-6, atol=1e-6)
    assert rotary.attention_scaling != 1.0  # mscale != mscale_all_dim: the magnitude is part of the check


@pytest.mark.parametrize("settings, message", [
    (dict(kv_lora_rank=512), "--kv-lora-rank 512 is larger than --hidden-size 64"),
    (dict(attention_dropout=0.1), "set --attention-dropout 0"),
])
def test_bad_latent_attention_settings_are_refused_in_one_line(settings, message):
    cfg = _cfg(**settings)
    problems = launch_problems(cfg.resolved(1), 1)
    assert any(message in p for p in problems), problems
    assert "add --multi-latent-attention" in RunConfig.build(model="tiny-llama", kv_lora_rank=8).validate()[0]


def _cfg(tp=1, pp=1, dp=1, **kw):
    settings = dict(model="tiny-llama", num_layers=2, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=96,
                    seq_length=16, vocab_size=257, micro_batch_size=2, global_batch_size=4, lr=1e-3, seed=5,
                    multi_latent_attention=True, **MLA)
    return RunConfig.build(tp=tp, pp=pp, dp=dp, **{**settings, **kw})


def _batches(dp, dp_rank, steps=2):
    out = []
    for step in range(steps):
        ids = torch.randint(0, 257, (4, 17), generator=torch.Generator().manual_seed(50 + step))
        mine = ids[dp_rank * 4 // dp:(dp_rank + 1) * 4 // dp]
        out.append([{"input_ids": i[:, :-1], "labels": i[:, 1:]} for i in mine.split(2)])
    return out


def _train(m, cfg, reference=None):
    """Two steps: (losses, grad norms, final full parameters at one process; else each compared with
    `reference`'s slice for this rank)."""
    chunks = build_model_chunks(cfg.gpt_config(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    assert sum(p.numel() for p in optimizer.model.params) == stage_params(cfg.gpt_config(), cfg, m.pp_rank)
    results = [train_step(optimizer.model, optimizer, batch, m, cfg, lr=1e-3) for batch in _batches(m.dp_size,
                                                                                                      m.dp_rank)]
    return [r.loss for r in results], [r.grad_norm for r in results], final_parameters(optimizer, chunks, cfg, reference)


QUICK = [((2, 1, 1), dict(sequence_parallel=True, recompute="selective"))]
LAYOUTS = [((2, 1, 2), dict()), ((2, 1, 2), dict(sequence_parallel=True, recompute="full", zero=1)),
           ((2, 2, 1), dict(sequence_parallel=True)), ((1, 2, 2), dict(zero=3))]


def _layouts_world(reference, layouts):
    out = []
    for (tp, pp, dp), settings in layouts:
        m = init_mesh(tp=tp, pp=pp, dp=dp, replace=True)
        out.append(_train(m, _cfg(tp, pp, dp, **settings), reference)[:2])
    return out


@pytest.mark.parametrize("layouts, world", [
    (QUICK, 2), pytest.param(LAYOUTS, 4, marks=pytest.mark.slow)])
def test_latent_attention_under_tp_sp_and_recompute_equals_the_single_process(layouts, world):
    losses, norms, final = _train(single_process_mesh("cpu"), _cfg())
    assert losses[1] < losses[0]
    for rank in run_distributed(_layouts_world, world, final, layouts, timeout_s=300):  # every parameter there
        for ((tp, pp, dp), settings), (got_losses, got_norms) in zip(layouts, rank):
            torch.testing.assert_close(got_losses, losses, rtol=1e-5, atol=0, msg=str(settings))
            torch.testing.assert_close(got_norms, norms, rtol=1e-5, atol=0, msg=str(settings))
