"""Today's model families both ways: transformers' models (built from small configs, float32) and
megalite loaded from them give the same logits and loss; megalite exports them back unchanged.

Quick tier: tp 1, one small model per family. Slow tier: one world of 4 ranks at (tp 2, pp 2)
checks every family's logits, loss and every gradient against transformers'; and the checks can
fail (each family feature left out moves the logits far).
"""
import importlib.util
import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(__file__))
import hf_families as H  # noqa: E402

from megalite.distributed import comm, mesh as mesh_lib  # noqa: E402
from megalite.parameters import params as P  # noqa: E402
from megalite.model import GPTModel, preset  # noqa: E402
from megalite.model.hf import config_from_hf, from_hf, hf_to_full_state, to_hf, with_mtp_as_present  # noqa: E402
from megalite.model.hf_config import hf_config_from  # noqa: E402
from megalite.pipeline import PipelineSpec, run_pipeline, stage_layers  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402

EXPORTED_AS = {"mistral": transformers.LlamaForCausalLM}  # Mistral without a window is Llama


@pytest.mark.parametrize("family", H.FAMILIES)
def test_family_logits_and_loss_equal_transformers_at_tp1(family):
    hf, logits, loss, _ = H.reference(family)
    model = from_hf(hf).eval()
    ids = H.inputs()
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :H.VOCAB], logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model(ids, H.megalite_labels(ids)), loss, rtol=1e-4, atol=0)
    back = to_hf(model)  # megalite -> transformers: the same class (Mistral: Llama) and the same tensors
    assert type(back) is EXPORTED_AS.get(family, type(hf))
    for name, tensor in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


@pytest.mark.slow  # ~4 s: five more transformers models; the proof that the quick checks can fail
def test_the_checks_can_fail():
    """Each family feature matters: megalite without it is far from transformers' logits."""
    for family, change in (("llama3", dict(rope_scaling=None)), ("qwen3", dict(qk_layernorm=False)),
                           ("qwen2", dict(qkv_bias=False)), ("qwen3-moe", "renormalised top-k"),
                           ("qwen2-moe", "no shared expert gate"), ("deepseek-v3", "no groups"),
                           ("deepseek-v3", "no correction bias"), ("deepseek-v2", "no scaling factor")):
        hf, logits, _, _ = H.reference(family)
        config = with_mtp_as_present(config_from_hf(hf.config), hf.state_dict())  # transformers' model: no MTP
        if change == "renormalised top-k":
            config = config.replace(moe=config.moe.replace(pre_softmax=False))
        elif change == "no shared expert gate":
            config = config.replace(moe=config.moe.replace(shared_expert_gate=False))
        elif change == "no groups":
            config = config.replace(moe=config.moe.replace(num_groups=None, group_topk=None))
        elif change == "no correction bias":
            config = config.replace(moe=config.moe.replace(enable_expert_bias=False))
        elif change == "no scaling factor":
            config = config.replace(moe=config.moe.replace(topk_scaling_factor=None))
        else:
            config = config.replace(**change)
        model = GPTModel(config).eval()
        model.load_full_state_dict(hf_to_full_state(hf.state_dict(), config), strict=False)
        with torch.no_grad():
            assert (model(H.inputs())[..., :H.VOCAB] - logits).abs().max() > 1e-2, family


@pytest.mark.parametrize("name, billions", [("llama3-8b", 8.030), ("llama3-70b", 70.554), ("llama3.2-3b", 3.213),
                                            ("mistral-7b", 7.248), ("qwen2.5-7b", 7.616), ("qwen3-8b", 8.191),
                                            ("qwen3-30b-a3b", 30.532)])
def test_presets_are_the_published_models(name, billions):
    """The preset's parameter count equals transformers' model of its exported config (built on the
    meta device) and the published size."""
    config = preset(name)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config_from(config))
    assert config.num_params() == sum(p.numel() for p in hf.parameters())
    assert round(config.num_params() / 1e9, 3) == billions


def _refusal(hf_config):
    with pytest.raises(ValueError) as info:
        config_from_hf(hf_config)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_unsupported_families_and_options_are_refused_by_name():
    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=256)
    assert "rope_interleave=False" in _refusal(transformers.DeepseekV3Config(**small, rope_interleave=False))
    assert config_from_hf(transformers.MistralConfig(**small, sliding_window=128)).window_size == 128  # converted
    assert config_from_hf(transformers.MistralConfig(**small, sliding_window=256)).seq_length == 256  # covers all
    assert "sliding_window=64" in _refusal(transformers.Qwen2Config(**small, use_sliding_window=True, sliding_window=64,
                                                                    max_window_layers=1))  # layer 1 only slides
    assert config_from_hf(transformers.Qwen2Config(**small, use_sliding_window=True, sliding_window=64)  # no layer
                          ).window_size is None  # slides below max_window_layers (28): transformers applies none
    assert "'linear' is not supported" in _refusal(transformers.LlamaConfig(
        **small, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}))
    assert "decoder_sparse_step=2" in _refusal(transformers.Qwen3MoeConfig(**small, decoder_sparse_step=2))
    assert "hidden_act='gelu'" in _refusal(transformers.LlamaConfig(**small, hidden_act="gelu"))
    with pytest.raises(ValueError, match="LlamaForCausalLM cannot express qkv_bias=True with proj_bias=False"):
        hf_config_from(preset("tiny-llama", qkv_bias=True, mlp_bias=True))


def _convert_tool():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "convert_checkpoint.py")
    spec = importlib.util.spec_from_file_location("convert_checkpoint_37a", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tokenizer_json(path) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, **{f"w{i}": i + 2 for i in range(20)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tokenizer.save(str(path))
    return str(path)


def test_export_writes_the_tokenizers_bos_and_eos(tmp_path):
    """Import a Qwen2-MoE directory (its files hold one Linear per expert), export it with --tokenizer:
    transformers loads it (same logits) and config.json carries that tokenizer's ids; without it, the
    imported model's own ids; the byte tokenizer's single end-of-document id is both."""
    convert, hf = _convert_tool(), H.hf_model("qwen2-moe")
    hf.config.bos_token_id, hf.config.eos_token_id = 7, [8, 9]  # Llama 3.1 Instruct has a list of eos ids
    hf.save_pretrained(tmp_path / "hf")
    assert convert.main(["import", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt")]) == 0
    tokenizer = _tokenizer_json(tmp_path / "tokenizer.json")
    assert convert.main(["export", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"),
                         "--tokenizer", tokenizer]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"]) == (0, 1)
    assert convert.main(["export", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "own")]) == 0
    written = json.loads((tmp_path / "own" / "config.json").read_text())  # no --tokenizer: the imported ids
    assert (written["bos_token_id"], written["eos_token_id"]) == (7, [8, 9])
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(exported(H.inputs()).logits, hf(H.inputs()).logits)
    config = config_from_hf(hf.config)
    byte = hf_config_from(config.replace(vocab_size=257), bos_token_id=256, eos_token_id=256)
    assert (byte.bos_token_id, byte.eos_token_id) == (256, 256)
    assert convert.special_token_ids("byte") == (256, 256)
    with pytest.raises(ValueError, match="eos_token_id=400 is outside the vocabulary"):
        hf_config_from(config, eos_token_id=400)


# --- slow: every family at (tp 2, pp 2), one world of ranks ------------------------------------------


def _stage_models(hf, mesh):
    """This rank's pipeline stage of the transformers model: from_hf with the stage's layers."""
    config = with_mtp_as_present(config_from_hf(hf.config), hf.state_dict())  # as from_hf builds it
    (layer_ids,) = stage_layers(config.num_layers, mesh.pp_size, 1, mesh.pp_rank)
    return config, from_hf(hf, mesh, layer_ids=layer_ids, pre_process=mesh.is_first_stage,
                           post_process=mesh.is_last_stage)


def _pipelined_logits(model, mesh, ids):
    """Forward through both stages by hand: stage 0 sends its [s, b, h] output to stage 1."""
    peers = comm.group_ranks(mesh.pp_group)
    shape = (ids.shape[1], ids.shape[0], model.config.hidden_size)
    with torch.no_grad():
        if mesh.is_first_stage:
            comm.wait_all(comm.batch_isend_irecv([comm.P2P("send", model(ids).contiguous(), peers[1])], mesh.pp_group))
            return None
        hidden = torch.empty(shape)
        comm.wait_all(comm.batch_isend_irecv([comm.P2P("recv", hidden, peers[0])], mesh.pp_group))
        return comm.all_gather(model(hidden).contiguous(), mesh.tp_group, dim=-1)[..., :H.VOCAB]


def _check_family(family, references, mesh):
    hf, logits, loss, hf_grads = references[family]
    config, model = _stage_models(hf, mesh)
    ids = H.inputs()
    full_logits = _pipelined_logits(model.eval(), mesh, ids)
    if mesh.is_last_stage:
        torch.testing.assert_close(full_logits, logits, rtol=1e-4, atol=1e-4, msg=lambda s: f"{family} logits: {s}")
    labels = H.megalite_labels(ids)
    microbatches = [{"input_ids": ids[i:i + 1], "labels": labels[i:i + 1]} for i in range(H.BATCH)]
    tokens = int((labels != -100).sum())
    spec = PipelineSpec("1f1b", H.BATCH, (H.SEQ, 1, config.hidden_size), torch.float32, 1)
    total = run_pipeline(spec, [model.train()], microbatches, mesh, 1.0 / tokens)
    if mesh.is_last_stage:
        torch.testing.assert_close(torch.tensor(total / tokens), loss, rtol=1e-4, atol=0, msg=f"{family} loss")
    expected = hf_to_full_state(hf_grads, config)
    checked = set()
    for name, param in model.logical_parameters():
        grad = param.grad
        if P.is_sequence_parallel_grad(param):  # q/k norms, the router: each tp rank's heads / tokens give part
            grad = comm.all_reduce(grad.clone(), mesh.tp_group)
        if P.info(param).expert_parallel and mesh.experts_whole:  # etp 1: each tp rank routes its tokens
            grad = comm.all_reduce(grad.clone(), mesh.expert_dp_group)
        want = P.shard_spec(param).shard(expected[name])
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-5, msg=lambda s: f"{family} {name}: {s}")
        checked.add(name)
    return checked


def _all_families_tp2_pp2(references):
    # the MoE families' experts (4 each): the mesh holds their groups, whole experts (etp 1) on each tp rank
    mesh = mesh_lib.init_mesh(tp=2, pp=2, num_experts=4)
    return {family: _check_family(family, references, mesh) for family in references}


@pytest.mark.slow
def test_every_family_at_tp2_pp2_equals_transformers_logits_loss_and_gradients():
    references = {family: H.reference(family, with_grads=True) for family in H.FAMILIES}
    reports = run_distributed(_all_families_tp2_pp2, 4, references, timeout_s=600)
    for family in H.FAMILIES:  # every logical parameter was compared on one of the two stages
        hf = references[family][0]
        config = with_mtp_as_present(config_from_hf(hf.config), hf.state_dict())
        names = {n for n, _ in GPTModel(config, device="meta").logical_parameters()}
        assert set().union(*(report[family] for report in reports)) == names, family


@pytest.mark.parametrize("family", ["llama3", "llama-bias", "qwen2", "qwen3", "qwen3-moe", "qwen2-moe", "deepseek-v3",
                                    "deepseek-v2"])
def test_the_planner_counts_the_family_parameters(family):
    """Biases per layer kind, q/k norms, a head dim apart from hidden/heads, a gated shared expert: the
    planner's parameters per rank (tp 1, pp 1 and 2) equal the real model's."""
    from megalite.config import RunConfig
    from megalite.plan import params as plan_params

    config = config_from_hf(H._configs()[family])
    whole = GPTModel(config, device="meta")
    assert sum(p.numel() for p in whole.parameters()) == plan_params.stage_params(config, RunConfig.build(), 0)
    stages = [GPTModel(config, layer_ids=range(0, 1), post_process=False, device="meta"),
              GPTModel(config, layer_ids=range(1, 2), pre_process=False, device="meta")]
    for stage, model in enumerate(stages):
        assert sum(p.numel() for p in model.parameters()) == \
            plan_params.stage_params(config, RunConfig.build(pp=2, global_batch_size=2), stage)


@pytest.mark.parametrize("name, billions, active", [("deepseek-v3", 671.026, 37.552), ("deepseek-v2-lite", 15.706, 2.661),
                                                    ("moonlight-16b-a3b", 15.960, 2.915)])
def test_deepseek_presets_are_the_published_models(name, billions, active):
    """DeepSeek-V3 (671B, 37B active; its MTP module not counted, as transformers' model), V2-Lite and
    Moonlight: the preset's count equals transformers' meta model of its exported config and the
    planner's; the active count (the top-k experts a token uses, embeddings included) the published one."""
    from megalite.config import RunConfig
    from megalite.plan import params as plan_params

    config = preset(name)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config_from(config))
    assert config.num_params() == sum(p.numel() for p in hf.parameters())
    assert round(config.num_params() / 1e9, 3) == billions
    routed = config.moe_layer_count() * (config.moe_mlp_params(False) - config.moe_mlp_params(True))
    assert round((config.num_params() - routed) / 1e9, 3) == active
    padding = (config.padded_vocab_size() - config.vocab_size) * config.hidden_size * 2  # embedding and head
    assert plan_params.stage_params(config, RunConfig.build(model=name), 0) == config.num_params() + padding


def test_deepseek_v3_through_a_megalite_checkpoint_and_back(tmp_path):
    """tools/convert_checkpoint.py import then export: the dense first block, the correction biases (buffers,
    stored as the checkpoint's expert biases) and the latent attention come back as transformers reads them."""
    convert, hf = _convert_tool(), H.hf_model("deepseek-v3")
    hf.save_pretrained(tmp_path / "hf")
    assert convert.main(["import", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt")]) == 0
    assert convert.main(["export", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    with torch.no_grad():
        assert torch.equal(exported(H.inputs()).logits, hf(H.inputs()).logits)


def _deepseek_tp2_pp2_ep2(hf, ids, logits, loss, hf_grads):
    """This rank's check at (tp 2, pp 2, dp 2, ep 2): dp rank r runs samples [2r, 2r+2) (one microbatch
    each); the experts see both dp ranks' tokens through the all-to-all, every other gradient is summed
    over dp here as the data-parallel engine would."""
    mesh = mesh_lib.init_mesh(tp=2, pp=2, dp=2, ep=2, num_experts=hf.config.n_routed_experts)
    config, model = _stage_models(hf, mesh)
    mine = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)
    got = _pipelined_logits(model.eval(), mesh, ids[mine])
    if mesh.is_last_stage:
        torch.testing.assert_close(got, logits[mine], rtol=1e-4, atol=1e-4)
    labels = H.megalite_labels(ids)
    tokens = int((labels != -100).sum())
    microbatches = [{"input_ids": ids[i:i + 1], "labels": labels[i:i + 1]} for i in range(mine.start, mine.stop)]
    spec = PipelineSpec("1f1b", 2, (H.SEQ, 1, config.hidden_size), torch.float32, 1)
    total = torch.tensor([run_pipeline(spec, [model.train()], microbatches, mesh, 1.0 / tokens)], dtype=torch.float64)
    if mesh.is_last_stage:
        comm.all_reduce(total, mesh.dp_group)
        torch.testing.assert_close(total[0] / tokens, loss.double(), rtol=1e-4, atol=0)
    expected, names = hf_to_full_state(hf_grads, config), set()
    for name, param in model.logical_parameters():
        grad = param.grad.clone()
        if P.is_sequence_parallel_grad(param):  # the router at etp 1: each tp rank's tokens give part
            grad = comm.all_reduce(grad, mesh.tp_group)
        if P.info(param).expert_parallel:  # etp 1: each tp rank's replica of the expert saw its own tokens
            grad = comm.all_reduce(grad, mesh.expert_dp_group)
        else:
            grad = comm.all_reduce(grad, mesh.dp_group)
        torch.testing.assert_close(grad, P.shard_spec(param).shard(expected[name]), rtol=1e-4, atol=1e-5,
                                   msg=lambda s, name=name: f"{name}: {s}")
        names.add(name)
    return names


@pytest.mark.slow  # 8 ranks
def test_deepseek_v3_at_tp2_pp2_ep2_equals_transformers():
    hf = H.hf_model("deepseek-v3")
    ids = torch.randint(0, H.VOCAB, (4, H.SEQ), generator=torch.Generator().manual_seed(5))
    logits = hf(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, H.VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in hf.named_parameters()}
    reports = run_distributed(_deepseek_tp2_pp2_ep2, 8, hf, ids, logits.detach(), loss.detach(), grads,
                              timeout_s=600)
    config = with_mtp_as_present(config_from_hf(hf.config), hf.state_dict())
    names = {n for n, _ in GPTModel(config, device="meta").logical_parameters()}
    assert set().union(*reports) == names
