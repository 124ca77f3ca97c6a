"""Megatron-core GPT checkpoints in (tools/convert_checkpoint.py --from megatron; megalite/checkpoint/megatron.py).

megatron-core installs from the package index and builds its GPT on CPU, but its torch_dist writer
(dist_checkpointing.save) asks for CUDA, and its legacy files are written by Megatron-LM's training loop,
which the package does not ship. So the fixtures here are written from the documented formats (docs/megatron.md):
a megalite model's full tensors put into Megatron's names and layouts (QKV interleaved per query group, a SwiGLU
fc1 [gate_r; up_r] per tp rank, tp cuts, pp stages numbering their layers from 0, the padded vocabulary; torch_dist
through torch.distributed.checkpoint with the layers stacked). Imported, they give back the same tensors (quick)
and the same logits at tp 2 (slow). Where megatron-core is installed, its own GPTModel's state dict in the legacy container is
imported and megalite's logits equal megatron-core's forward.
"""
import argparse
import importlib.util
import json

import pytest
import torch

from megalite.checkpoint import read_full_state
from megalite.config.model import GPTConfig
from megalite.distributed import comm, mesh
from megalite.distributed.mesh import destroy_mesh
from megalite.model.gpt import GPTModel
from megalite.model.hf import full_state_of
from megalite.testing import free_port, run_distributed
from tools import convert_checkpoint

VOCAB, PADDED = 300, 320
CONFIG = GPTConfig(flavour="llama", num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                   ffn_hidden_size=96, vocab_size=VOCAB, seq_length=32, norm_eps=1e-6, tie_embeddings=False)


def _args(tp, pp, **changes):
    args = dict(num_layers=4, hidden_size=64, num_attention_heads=8, group_query_attention=True, num_query_groups=4,
                ffn_hidden_size=96, swiglu=True, position_embedding_type="rope", normalization="RMSNorm",
                untie_embeddings_and_output_weights=True, add_bias_linear=False, padded_vocab_size=PADDED,
                seq_length=32, max_position_embeddings=32, norm_epsilon=1e-6, rotary_base=10000,
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return argparse.Namespace(**{**args, **changes})


@pytest.fixture(scope="module")
def full():
    """A megalite model's full tensors (norm weights moved off 1 so a swapped norm shows)."""
    torch.manual_seed(0)
    state = full_state_of(GPTModel(CONFIG))
    for name in state:
        if "norm" in name:
            state[name] = state[name] + 0.1 * torch.randn(state[name].shape)
    return state


def _megatron_tensors(full):
    """{Megatron name: whole tensor} (layers by global index): QKV per query group, fc1 [gate; up], padded vocab."""
    n, g, d = 8, 4, 8
    extra = torch.randn(PADDED - VOCAB, 64, generator=torch.Generator().manual_seed(1))
    out = {"embedding.word_embeddings.weight": torch.cat([full["word_embeddings.weight"], extra]),
           "output_layer.weight": torch.cat([full["output_weight"], extra]),
           "decoder.final_layernorm.weight": full["final_norm.weight"]}
    for i in range(4):
        q, k, v = full[f"layers.{i}.attention.qkv.weight"].split([n * d, g * d, g * d])
        grouped = torch.cat([q.view(g, n // g, d, 64), k.view(g, 1, d, 64), v.view(g, 1, d, 64)], dim=1)
        p = f"decoder.layers.{i}."
        out.update({p + "self_attention.linear_qkv.weight": grouped.reshape(-1, 64),
                    p + "self_attention.linear_proj.weight": full[f"layers.{i}.attention.proj.weight"],
                    p + "mlp.linear_fc1.weight": full[f"layers.{i}.mlp.fc1.weight"],
                    p + "mlp.linear_fc2.weight": full[f"layers.{i}.mlp.fc2.weight"],
                    p + "input_layernorm.weight": full[f"layers.{i}.input_norm.weight"],
                    p + "pre_mlp_layernorm.weight": full[f"layers.{i}.post_attention_norm.weight"]})
    return out


def _rank_state(whole, tp_rank, tp, layers):
    """One legacy file's model state: tp rank `tp_rank`'s cuts of `layers` (numbered from 0) and the ends."""
    state = {}
    for name, tensor in whole.items():
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers."):].split(".", 1)
            if int(index) not in layers:
                continue
            name = f"decoder.layers.{layers.index(int(index))}.{rest}"
        elif (name.startswith("embedding") and layers[0] != 0) or (not name.startswith("embedding") and layers[-1] != 3):
            continue
        if name.endswith("linear_fc1.weight"):  # this rank's [gate_r; up_r]
            gate, up = tensor.chunk(2)
            tensor = torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
        elif any(name.endswith(s) for s in ("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
            tensor = tensor.chunk(tp)[tp_rank]
        elif name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
            tensor = tensor.chunk(tp, dim=1)[tp_rank]
        state[name] = tensor.clone()
        if name.endswith(".weight") and "norm" not in name:
            state[name.replace(".weight", "._extra_state")] = None  # Transformer Engine's, as megatron-core writes
    return state


def write_legacy(root, full, *, tp=2, stages=((0,), (1, 2, 3)), args=None, iteration=7):
    """A Megatron --save directory in the legacy format at (tp, len(stages)) with these stage layers."""
    whole, pp = _megatron_tensors(full), len(stages)
    directory = root / f"iter_{iteration:07d}"
    for stage, layers in enumerate(stages):
        for rank in range(tp):
            sub = directory / (f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else ""))
            sub.mkdir(parents=True)
            torch.save({"args": args or _args(tp, pp), "iteration": iteration, "checkpoint_version": 3.0,
                        "model": _rank_state(whole, rank, tp, list(layers))}, sub / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


def write_torch_dist(root, full, *, iteration=9):
    """A Megatron --save directory in torch_dist: global tensors, the layers stacked, norms under TE's names."""
    import torch.distributed.checkpoint as dcp

    whole = _megatron_tensors(full)
    state = {k: v for k, v in whole.items() if not k.startswith("decoder.layers.")}
    te = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
          "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    for suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
                   "mlp.linear_fc2.weight", "input_layernorm.weight", "pre_mlp_layernorm.weight"):
        state["decoder.layers." + te.get(suffix, suffix)] = torch.stack(
            [whole[f"decoder.layers.{i}.{suffix}"] for i in range(4)])
    directory = root / f"iter_{iteration:07d}"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    torch.save({"args": _args(2, 2), "iteration": iteration}, directory / "common.pt")
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "common_backend": "torch"}))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


def _logits_at_tp2(full_a, full_b):
    m = mesh.init_mesh(tp=2)
    try:
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
        logits = []
        for full in (full_a, full_b):
            model = GPTModel(CONFIG, m).eval()
            model.load_full_state_dict(full)
            with torch.no_grad():
                logits.append(comm.all_gather(model(ids).contiguous(), m.tp_group, dim=-1)[..., :VOCAB])
        return logits
    finally:
        destroy_mesh()


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_a_megatron_checkpoint_imports_to_the_same_tensors(tmp_path, full, fmt):
    root = (write_legacy if fmt == "legacy" else write_torch_dist)(tmp_path / "megatron", full)
    out = tmp_path / "imported"
    assert convert_checkpoint.main(["--from", "megatron", "--load", str(root), "--output", str(out),
                                    "--vocab-size", str(VOCAB)]) == 0
    config, imported, meta = read_full_state(out)
    assert (config.flavour, config.num_layers, config.num_query_groups, config.vocab_size) == ("llama", 4, 4, VOCAB)
    assert meta["extra"]["megatron"]["format"] == fmt
    assert set(imported) == set(full)
    for name, tensor in full.items():
        assert torch.equal(imported[name], tensor), name


@pytest.mark.slow  # ~2.5 s: a 2-rank world; the exact tensors above are the quick proof
def test_the_imported_checkpoint_gives_the_same_logits_at_tp2(tmp_path, full):
    root = write_legacy(tmp_path / "megatron", full)
    assert convert_checkpoint.main(["--from", "megatron", "--load", str(root), "--output", str(tmp_path / "out"),
                                    "--vocab-size", str(VOCAB), "--no-progress"]) == 0
    _, imported, _ = read_full_state(tmp_path / "out")
    for ours, theirs in run_distributed(_logits_at_tp2, 2, imported, full, timeout_s=60):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_the_padded_vocabulary_is_kept_without_vocab_size(tmp_path, full):
    root = write_legacy(tmp_path / "megatron", full, tp=1, stages=((0, 1, 2, 3),))
    assert convert_checkpoint.main(["--from", "megatron", "--load", str(root / "iter_0000007"),
                                    "--output", str(tmp_path / "out")]) == 0
    config, imported, _ = read_full_state(tmp_path / "out")
    assert config.vocab_size == PADDED and imported["word_embeddings.weight"].shape == (PADDED, 64)


def _refusal(tmp_path, capsys, root):
    assert convert_checkpoint.main(["--from", "megatron", "--load", str(root), "--output",
                                    str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_bad_or_unknown_checkpoint_is_one_line_exit_2(tmp_path, capsys, full):
    (tmp_path / "empty").mkdir()
    assert "no latest_checkpointed_iteration.txt" in _refusal(tmp_path, capsys, tmp_path / "empty")
    moe = write_legacy(tmp_path / "moe", full, tp=1, stages=((0, 1, 2, 3),), args=_args(1, 1, num_experts=8))
    assert "a mixture-of-experts checkpoint (8 experts)" in _refusal(tmp_path, capsys, moe)
    gelu = write_legacy(tmp_path / "gelu", full, tp=1, stages=((0, 1, 2, 3),), args=_args(1, 1, swiglu=False))
    assert "megalite builds Llama's (SwiGLU, RoPE, RMSNorm)" in _refusal(tmp_path, capsys, gelu)
    short = write_legacy(tmp_path / "short", full, tp=2, stages=((0,), (1, 2)))  # layer 3 missing
    assert "the stages hold 3 layers, the args say 4" in _refusal(tmp_path, capsys, short)
    torn = write_legacy(tmp_path / "torn", full, tp=2, stages=((0,), (1, 2, 3)))
    (torn / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    assert "found 3 (tp 2 x pp 2 needs 4)" in _refusal(tmp_path, capsys, torn)
    damaged = write_legacy(tmp_path / "damaged", full, tp=1, stages=((0, 1, 2, 3),))
    (damaged / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"not a torch file")
    assert "not readable as a torch file" in _refusal(tmp_path, capsys, damaged)


def _megatron_core_gpt():
    """megatron-core's own GPT (local spec, SwiGLU, RoPE, RMSNorm, GQA) on CPU in a one-rank gloo world, and
    its logits on ids [2, 12]. Two CUDA-only calls of its forward are sidestepped: the rotary table's device
    and the dropout RNG tracker's fork (no dropout here)."""
    import contextlib
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel as McoreGPT
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.cuda.current_device = lambda: "cpu"
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    mcore_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                               ffn_hidden_size=96, use_cpu_initialization=True, gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=1e-6,
                               add_bias_linear=False, bias_activation_fusion=False, hidden_dropout=0.0,
                               attention_dropout=0.0)
    model = McoreGPT(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=PADDED,
                     max_sequence_length=32, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.add_(0.1 * torch.randn(param.shape))
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
        mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)[None, None]
        logits = model(ids, torch.arange(12).expand(2, 12), attention_mask=mask)
    state = {k: v for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    return state, ids, logits


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core is not installed (not a megalite extra: `pip install megatron-core` beside "
                           "torch runs this oracle; docs/megatron.md)")
def test_megatron_cores_own_gpt_imports_with_its_logits(tmp_path):
    state, ids, logits = run_distributed(_megatron_core_gpt_in_a_rank, 1, timeout_s=300)[0]
    directory = tmp_path / "megatron" / "iter_0000003" / "mp_rank_00"
    directory.mkdir(parents=True)
    torch.save({"args": _args(1, 1), "iteration": 3, "model": state}, directory / "model_optim_rng.pt")
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text("3")
    assert convert_checkpoint.main(["--from", "megatron", "--load", str(tmp_path / "megatron"), "--output",
                                    str(tmp_path / "out"), "--vocab-size", str(VOCAB)]) == 0
    config, imported, _ = read_full_state(tmp_path / "out")
    model = GPTModel(config).eval()
    model.load_full_state_dict(imported)
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :VOCAB], logits[..., :VOCAB], rtol=1e-5, atol=1e-5)


def _megatron_core_gpt_in_a_rank():
    """In a forked rank: megatron-core's process groups stay out of the test process."""
    import torch.distributed as dist
    if dist.is_initialized():  # run_distributed's own group: megatron-core makes its own world
        dist.destroy_process_group()
    return _megatron_core_gpt()
