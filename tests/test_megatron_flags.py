"""Megatron-LM users at home (issue 49, item 10): every flag of Megatron-LM's GPT-3 175B, Llama-3 8B (H100
FP8) and Mixtral 8x7B example scripts and its most-used pretraining flags is implemented, mapped, or
refused by name saying why (never argparse's "unrecognized arguments"); no parser takes an abbreviation;
--lr-decay-style WSD, --exit-interval and --exit-duration-in-mins are real."""
import ast
import contextlib
import functools
import io
import math
from pathlib import Path

import pytest

from megalite.cli import build_parser, parse_args
from megalite.errors import ConfigError
from megalite.optim.lr_schedule import LRSchedule
from megalite.training import loop

ROOT = Path(__file__).resolve().parents[1]

# flag -> a value it takes (None: a switch). The example scripts first, then the most-used flags of
# Megatron-LM's argument groups (training, learning rate, checkpointing, mixed precision, logging, data).
MEGATRON_FLAGS = {
 "--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "32",
 "--max-position-embeddings": "64", "--attention-backend": "auto", "--micro-batch-size": "1",
 "--global-batch-size": "8", "--rampup-batch-size": "4 4 16", "--train-iters": "10", "--weight-decay": "0.1",
 "--adam-beta1": "0.9", "--adam-beta2": "0.95", "--init-method-std": "0.006", "--clip-grad": "1.0", "--fp16": None,
 "--lr": "6e-5", "--lr-decay-style": "cosine", "--min-lr": "6e-6", "--lr-warmup-fraction": ".001",
 "--lr-decay-iters": "10", "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1",
 "--data-path": "x", "--vocab-file": "v", "--merge-file": "m", "--split": "949,50,1", "--log-interval": "100",
 "--save-interval": "10000", "--eval-interval": "1000", "--save": "ck", "--load": "ck", "--eval-iters": "10",
 "--tensorboard-dir": "tb", "--use-mcore-models": None, "--ffn-hidden-size": "128", "--group-query-attention": None,
 "--num-query-groups": "2", "--kv-channels": "16", "--position-embedding-type": "rope", "--rotary-base": "1000000",
 "--rotary-percent": "1.0", "--attention-dropout": "0.0", "--hidden-dropout": "0.0", "--swiglu": None,
 "--apply-layernorm-1p": None, "--untie-embeddings-and-output-weights": None, "--disable-bias-linear": None,
 "--train-samples": "100", "--lr-decay-samples": "100", "--lr-warmup-samples": "10", "--decoupled-lr": "5e-4",
 "--decoupled-min-lr": "4.5e-5", "--bf16": None, "--grad-reduce-in-bf16": None, "--cross-entropy-loss-fusion": None,
 "--calculate-per-token-loss": None, "--manual-gc": None, "--empty-unused-memory-level": "1",
 "--exit-duration-in-mins": "235", "--fp8-format": "hybrid", "--fp8-amax-history-len": "1024",
 "--fp8-amax-compute-algo": "max", "--fp8-param-gather": None, "--context-parallel-size": "1",
 "--sequence-parallel": None, "--use-distributed-optimizer": None, "--overlap-grad-reduce": None,
 "--overlap-param-gather": None, "--mock-data": None, "--tokenizer-type": "NullTokenizer", "--vocab-size": "128",
 "--data-cache-path": "cache", "--tiktoken-pattern": "v2", "--no-create-attention-mask-in-dataloader": None,
 "--no-mmap-bin-files": None, "--num-workers": "1", "--tokenizer-model": "t.json", "--log-throughput": None,
 "--profile": None, "--profile-step-start": "4", "--profile-step-end": "6", "--ckpt-format": "torch_dist",
 "--distributed-timeout-minutes": "60", "--normalization": "RMSNorm", "--no-masked-softmax-fusion": None,
 "--no-position-embedding": None, "--num-experts": "2", "--moe-router-topk": "2",
 "--moe-router-load-balancing-type": "aux_loss", "--moe-aux-loss-coeff": "1e-2", "--moe-grouped-gemm": None,
 "--moe-token-dispatcher-type": "alltoall", "--expert-model-parallel-size": "1", "--no-load-optim": None,
 "--no-load-rng": None, "--wandb-project": "p", "--wandb-exp-name": "n",
 # most-used pretraining flags beyond the three scripts
 "--exit-interval": "100", "--tensorboard-log-interval": "1", "--log-timers-to-tensorboard": None,
 "--accumulate-allreduce-grads-in-fp32": None, "--loss-scale": "1024", "--initial-loss-scale": "65536",
 "--min-loss-scale": "1", "--loss-scale-window": "1000", "--hysteresis": "2", "--seed": "1234",
 "--lr-warmup-iters": "10", "--lr-wsd-decay-style": "linear", "--lr-wsd-decay-iters": "2", "--make-vocab-size-divisible-by": "128",
 "--recompute-granularity": "full", "--recompute-method": "uniform", "--recompute-num-layers": "1",
 "--num-layers-per-virtual-pipeline-stage": "1", "--virtual-pipeline-model-parallel-size": "1",
 "--norm-epsilon": "1e-5", "--adam-eps": "1e-8", "--use-flash-attn": None, "--transformer-impl": "local",
 "--distributed-backend": "nccl", "--no-save-optim": None, "--no-save-rng": None, "--finetune": None,
 "--log-params-norm": None, "--log-num-zeros-in-grad": None, "--log-validation-ppl-to-tensorboard": None,
 "--log-memory-to-tensorboard": None, "--timing-log-level": "0", "--eod-mask-loss": None,
 "--reset-position-ids": None, "--reset-attention-mask": None, "--use-checkpoint-args": None,
 "--bias-gelu-fusion": None, "--no-bias-gelu-fusion": None, "--no-bias-dropout-fusion": None,
 "--no-gradient-accumulation-fusion": None, "--qk-layernorm": None, "--add-qkv-bias": None,
 "--untie-embeddings-and-output-weights": None, "--decoder-first-pipeline-num-layers": "1",
 "--decoder-last-pipeline-num-layers": "1", "--optimizer": "adam", "--dataloader-type": "single",
 "--wandb-save-dir": "w", "--data-parallel-random-init": None, "--override-opt_param-scheduler": None,
}


@functools.cache
def _parser():
    return build_parser()  # built once: parsing does not change it


def _outcome(flag, value):
    """('ok' | 'refused' | 'unrecognized', message) of parsing the flag alone (with what it needs)."""
    argv = [flag] + ([] if value is None else value.split())
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_args(argv, _parser())
    except SystemExit:
        text = err.getvalue()
        return ("unrecognized" if "unrecognized arguments" in text or "ambiguous" in text else "refused"), text
    except ConfigError as exc:  # parsed; a combination the flag alone cannot satisfy (e.g. WSD's iterations)
        return "ok", str(exc)
    return "ok", ""


def test_every_megatron_flag_is_known_mapped_or_refused_by_name():
    wrong = []
    for flag, value in sorted(MEGATRON_FLAGS.items()):
        outcome, text = _outcome(flag, value)
        if outcome == "unrecognized" or (outcome == "refused" and not (
                flag in text and "Megatron-LM flag for" in text and len(text.strip().splitlines()) == 1)):
            wrong.append((flag, text.strip()))
    assert wrong == []


def test_no_parser_accepts_an_abbreviation():
    for argv in (["--loss-scale-win", "10"], ["--train-it", "5"], ["--micro-batch", "1"]):
        assert _outcome(argv[0], argv[1])[0] == "unrecognized", argv
    unguarded = []
    for path in [*ROOT.glob("megalite/**/*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("kernels/*.py"),
                 *ROOT.glob("examples/*.py")]:
        source = path.read_text()
        if "ArgumentParser(" not in source:  # (parse only the files that build a parser)
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("ArgumentParser") and \
                    not any(k.arg == "allow_abbrev" for k in node.keywords):
                unguarded.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert unguarded == []  # (OneLineParser sets allow_abbrev=False itself)


def test_a_value_megalite_does_not_take_is_refused_by_name():
    assert _outcome("--rotary-percent", "1.0")[0] == "ok"
    outcome, text = _outcome("--rotary-percent", "0.5")
    assert outcome == "refused" and "--rotary-percent 0.5: megalite takes only 1" in text, text


def test_megatron_profile_flags_map_to_the_profiled_steps():
    cfg, _ = parse_args(["--profile", "--profile-step-start", "4", "--profile-step-end", "6", "--train-iters", "10",
                         "--grad-reduce-in-bf16", "--override-opt_param-scheduler"])
    assert cfg.logging.profile_steps == (4, 5) and cfg.precision.grad_reduce_dtype == "bf16"
    assert cfg.checkpoint.override_opt_param_scheduler


@pytest.mark.parametrize("style,expected", [
    ("linear", lambda r: 1 - r), ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1)),
    ("exponential", lambda r: 2 * 0.5 ** r - 1), ("minus_sqrt", lambda r: 1 - math.sqrt(r)),
])
def test_wsd_holds_the_peak_then_anneals_its_last_steps(style, expected):
    schedule = LRSchedule(1.0, 0.1, warmup_iters=10, decay_iters=100, style="WSD", wsd_decay_iters=20,
                          wsd_style=style)
    assert schedule(4) == pytest.approx(0.5)  # warm-up: (4 + 1) / 10
    assert [schedule(s) for s in (10, 50, 80)] == [1.0, 1.0, 1.0]  # stable until step 100 - 20
    for step in (85, 90, 99, 100, 130):
        ratio = min(1.0, (step - 80) / 20)
        assert schedule(step) == pytest.approx(0.1 + 0.9 * expected(ratio)), (style, step)
    assert schedule(100) == pytest.approx(0.1)


def test_wsd_flags_are_checked_with_the_settings():
    problems = parse_args(["--lr-decay-style", "WSD", "--train-iters", "100"])[0].validate()
    assert any("--lr-decay-style WSD needs --lr-wsd-decay-iters N" in p for p in problems), problems
    problems = parse_args(["--lr-decay-style", "WSD", "--train-iters", "100", "--lr-warmup-iters", "90",
                           "--lr-wsd-decay-iters", "20"])[0].validate()
    assert any("--lr-wsd-decay-iters 20 is more than the 10 steps" in p for p in problems), problems
    assert not [p for p in parse_args(["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "20"])[0].validate()
                if "wsd" in p.lower()]


SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "1", "--eval-iters", "0", "--log-interval", "1"]


@pytest.mark.slow  # two short training runs in this process
def test_exit_interval_and_duration_save_and_stop(tmp_path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = loop.main(SMALL + ["--train-iters", "10", "--exit-interval", "3", "--save", str(tmp_path / "a")])
    assert code == 0 and "megalite: --exit-interval 3: stopped after step 3, saved" in out.getvalue(), out.getvalue()
    assert sorted(p.name for p in (tmp_path / "a").glob("step_*")) == ["step_000003"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = loop.main(SMALL + ["--train-iters", "10", "--exit-duration-in-mins", "1e-9", "--save",
                                  str(tmp_path / "b")])
    assert code == 0 and "megalite: --exit-duration-in-mins 1e-09" in out.getvalue(), out.getvalue()
    assert "stopped after step 1, saved" in out.getvalue()
