"""--finetune and the model's shape from the checkpoint (megalite.checkpoint.finetune, model_shape).

An imported Qwen3 (built from a small transformers config, nothing downloaded) is fine-tuned with no
shape flag at all, at tp 1 and at tp 2 (a 2-rank gloo world): at --lr 0 the saved weights are the
imported ones bit for bit (so the weights came from the checkpoint and nothing else moved them), the
run starts at step 0 with the data from its first sample, and the step-1 loss is the same at both
layouts. A shape flag that contradicts the checkpoint is one line naming both values, exit 2."""
import contextlib
import io
import json

import pytest
import torch

from megalite.checkpoint import read_full_state
from megalite.testing import run_distributed
from megalite.training import loop

from ckpt_helpers import load_convert_tool

transformers = pytest.importorskip("transformers")

RUN = ["--finetune", "--train-iters", "1", "--lr", "0", "--min-lr", "0", "--micro-batch-size", "2",
       "--eval-iters", "0", "--log-interval", "1", "--lr-warmup-iters", "0"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """An imported Qwen3 checkpoint: q/k norms, head_dim 12 != hidden / heads, grouped queries, untied."""
    root = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                      max_position_embeddings=16, tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(config).save_pretrained(root / "hf")
    load_convert_tool().import_from_hf(root / "hf", root / "ckpt", progress=False)
    return root / "ckpt"


def _main(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = loop.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def _finetune_rank(argv):
    return _main(argv)


def _step1_loss(metrics):
    return next(json.loads(line)["loss"] for line in metrics.read_text().splitlines() if '"step": 1' in line)


def test_finetune_an_import_at_tp_1_and_2_without_shape_flags(imported, tmp_path):
    _, base, _ = read_full_state(imported)
    losses = {}
    for tp in (1, 2):
        out_dir, metrics = tmp_path / f"tp{tp}", tmp_path / f"tp{tp}.jsonl"
        argv = ["--load", imported, "--save", out_dir, "--metrics-file", metrics, "--tp", tp, *RUN]
        results = [_main(argv)] if tp == 1 else run_distributed(_finetune_rank, 2, [str(a) for a in argv])
        for code, out, err in results:
            assert code == 0, out + err
        assert "the model is checkpoint step 0's: llama, 2 layers, hidden 32" in results[0][1]
        _, saved, meta = read_full_state(out_dir)
        assert meta["step"] == 1 and meta["consumed_samples"] == 2 and meta["optimizer_step"] == 1
        assert saved.keys() == base.keys() and all(torch.equal(saved[n], base[n]) for n in base)
        assert meta["model_config"]["qk_layernorm"] and meta["model_config"]["kv_channels"] == 12
        losses[tp] = _step1_loss(metrics)
    assert losses[2] == pytest.approx(losses[1], rel=1e-5)


def test_finetune_of_a_trained_checkpoint_starts_at_step_0_and_restarts_from_its_own(imported, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    code, out, err = _main(["--load", imported, "--save", first, "--override-opt-param-scheduler", *RUN,
                            "--train-iters", "2", "--lr", "1e-3", "--min-lr", "1e-4"])
    assert code == 0, out + err
    argv = ["--load", first, "--save", second, *RUN]  # a trained run's checkpoint (step 2, its optimizer)
    code, out, err = _main(argv)
    assert code == 0, out + err
    meta = read_full_state(second)[2]
    assert (meta["step"], meta["consumed_samples"], meta["optimizer_step"]) == (1, 2, 1)
    code, out, err = _main(argv)  # the same command again: resumes from --save, not --load
    assert code == 0 and f"{second} already holds this fine-tune's step 1; resuming from it" in out, out + err
    assert "nothing to train" in out


@pytest.mark.parametrize("flags,needle", [
    (["--hidden-size", "48"], "--hidden-size (hidden_size 48 vs the checkpoint's 32)"),
    (["--kv-channels", "8", "--num-layers", "2"], "--kv-channels (head_dim 8 vs the checkpoint's 12)"),
    (["--model", "tiny"], "--model (flavour gpt2 vs the checkpoint's llama, "),
    (["--num-attention-heads", "3"], "--num-attention-heads (num_attention_heads 3 vs the checkpoint's 4)"),  # no model
])
def test_a_shape_flag_that_contradicts_the_checkpoint_is_one_line(imported, flags, needle, tmp_path):
    code, out, err = _main(["--load", imported, *RUN, *flags])
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert "drop the shape flags (the model comes from the checkpoint)" in err and "Traceback" not in err


def test_agreeing_shape_flags_are_accepted_and_the_checkpoint_decides_the_rest(imported, capsys):
    code, out, err = _main(["--load", imported, "--num-layers", "2", "--kv-channels", "12", "--seq-length", "8",
                            "--dry-run"])
    assert code == 0, err
    from megalite.checkpoint.model_shape import adopt_checkpoint_model
    from megalite.cli import given_settings, parse_args
    argv = ["--load", str(imported), "--num-layers", "2", "--seq-length", "8"]
    cfg, _ = adopt_checkpoint_model(parse_args(argv)[0], given_settings(argv))
    model = cfg.gpt_config()
    assert (model.hidden_size, model.head_dim, model.num_query_groups, model.qk_layernorm, model.seq_length,
            model.vocab_size, model.tie_embeddings) == (32, 12, 2, True, 8, 300, False)


@pytest.mark.parametrize("argv,needle", [
    (["--finetune"], "--finetune needs --load DIR"),
    (["--finetune", "--load", "{tmp}/empty"], "holds no complete checkpoint to start from"),
    (["--finetune", "--load", "{ckpt}", "--save", "{ckpt}"], "a restart would fine-tune its own checkpoint again"),
    (["--load", "{ckpt}/../hf"], "is a transformers directory, not a megalite checkpoint; import it once with "
                                 "tools/convert_checkpoint.py import --hf"),
])
def test_finetune_mistakes_are_one_line(imported, tmp_path, argv, needle):
    (tmp_path / "empty").mkdir()
    code, out, err = _main([a.format(tmp=tmp_path, ckpt=imported) for a in argv] + ["--train-iters", "1"])
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
