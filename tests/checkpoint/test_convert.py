"""tools/convert_checkpoint.py: transformers -> megalite checkpoint -> transformers.

HF models are built from small configs (nothing downloaded) and written with save_pretrained.
Import, then megalite's logits equal HF's (the external oracle, 1e-5); export, then
transformers loads the directory and its logits and weights are bit-identical to the original.
"""
import pytest
import torch

from megalite.model.hf import config_from_hf

from ckpt_helpers import load_convert_tool, megalite_logits

transformers = pytest.importorskip("transformers")

convert = load_convert_tool()


def _hf_model(flavour):
    torch.manual_seed(0)
    if flavour == "gpt2":
        config = transformers.GPT2Config(vocab_size=300, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config).eval()
    if flavour == "mixtral":
        config = transformers.MixtralConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                            tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config).eval()
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("flavour", ["gpt2", "llama", "mixtral"])
def test_import_export_round_trip(flavour, tmp_path):
    original = _hf_model(flavour)
    original.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = original(ids).logits

    assert convert.main(["import", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt")]) == 0
    torch.testing.assert_close(megalite_logits(tmp_path / "ckpt", ids), expected, rtol=1e-5, atol=1e-5)

    assert convert.main(["export", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(exported) is type(original)
    assert config_from_hf(exported.config) == config_from_hf(original.config)
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, expected)
    for name, tensor in original.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name


def test_bad_input_names_the_fix(tmp_path, capsys):
    assert convert.main(["import", "--hf", str(tmp_path), "--output", str(tmp_path / "c")]) == 2
    assert "config.json not found" in capsys.readouterr().err
    assert convert.main(["export", "--load", str(tmp_path), "--output", str(tmp_path / "o")]) == 2
    assert "holds no megalite checkpoint" in capsys.readouterr().err


def test_an_imported_checkpoint_starts_the_optimizer_from_its_weights(tmp_path):
    from megalite.checkpoint import load_checkpoint
    from megalite.distributed.mesh import single_process_mesh
    from megalite.config import RunConfig
    from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

    _hf_model("llama").save_pretrained(tmp_path / "hf")
    assert convert.main(["import", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt")]) == 0
    config = config_from_hf(transformers.AutoConfig.from_pretrained(tmp_path / "hf"))
    m, cfg = single_process_mesh("cpu"), RunConfig.build(micro_batch_size=2, global_batch_size=2, zero=1)
    chunks = build_model_chunks(config, cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    resumed = load_checkpoint(tmp_path / "ckpt", chunks, optimizer, m, log=lambda *_: None)
    assert (resumed.step, resumed.consumed_samples, optimizer.step_count) == (0, 0, 0)
    assert optimizer.shares_master and optimizer.master is None  # fp32: the imported weights ARE the master
    assert not optimizer.exp_avg.any() and not optimizer.exp_avg_sq.any()
    ids = torch.randint(0, 300, (2, 17))
    result = train_step(optimizer.model, optimizer, [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}], m, cfg, lr=1e-3)
    assert torch.isfinite(torch.tensor(result.loss)) and optimizer.step_count == 1


def test_export_config_carries_the_dropout_probabilities():
    from megalite.config.model import GPTConfig

    for flavour in ("gpt2", "llama"):
        config = GPTConfig(flavour, num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=300,
                           seq_length=16, hidden_dropout=0.1 if flavour == "gpt2" else 0.0, attention_dropout=0.2)
        hf = convert.hf_config_for(config, torch.float32)
        back = config_from_hf(hf)
        assert (back.hidden_dropout, back.attention_dropout) == (config.hidden_dropout, 0.2)
        special = [getattr(hf, n) for n in ("bos_token_id", "eos_token_id", "pad_token_id") if getattr(hf, n, None)]
        assert special and all(0 <= i < 300 for i in special), special  # inside the exported vocabulary


def test_a_damaged_or_foreign_directory_is_one_line(tmp_path, capsys):
    (tmp_path / "step_000001").mkdir()
    (tmp_path / "step_000001" / "metadata.json").write_text("{not json")
    (tmp_path / "step_000001" / "manifest.json").write_text("{}")
    assert convert.main(["export", "--load", str(tmp_path), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "convert_checkpoint: error:" in err, err
    try:
        code = convert.main(["export", "--load", str(tmp_path), "--output", str(tmp_path / "o"), "--step", "x"])
    except SystemExit as exc:
        code = exc.code
    assert code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_config_that_is_not_json_and_an_output_that_is_a_file_are_one_line(tmp_path, capsys):
    """Issue 40: both ended in tracebacks (transformers' OSError; mkdir's FileExistsError)."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{not json")
    assert convert.main(["import", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "config.json is not valid JSON" in err, err
    (tmp_path / "a_file").write_text("x")
    assert convert.main(["export", "--load", str(tmp_path), "--output", str(tmp_path / "a_file")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"--output {tmp_path / 'a_file'} is a file" in err, err


def test_exported_weights_are_readable_like_the_config(tmp_path):
    import os
    import stat

    from ckpt_helpers import full_params
    from megalite.checkpoint import write_full_state
    from megalite.config import RunConfig
    from megalite.distributed.mesh import single_process_mesh
    from megalite.config.model import GPTConfig
    from megalite.training.step import build_model_chunks

    config = GPTConfig("gpt2", num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64, seq_length=8)
    chunks = build_model_chunks(config, RunConfig.build(micro_batch_size=1), single_process_mesh("cpu"))
    write_full_state(tmp_path / "ckpt", config, full_params(chunks))
    assert convert.main(["export", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]) == 0
    mode = lambda name: stat.S_IMODE(os.stat(tmp_path / "out" / name).st_mode)  # noqa: E731
    assert mode("model.safetensors") == mode("config.json")  # was 0600
