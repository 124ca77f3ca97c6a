"""RunConfig: every setting declared once; the parser, config files and --print-config come from it."""
import dataclasses
import json
import subprocess
import sys

import pytest

from megalite.cli import ACTIONS, ConfigFileError, build_parser, parse_args, read_config_file, to_toml
from megalite.config.megatron import non_setting_dests
from megalite.config import PARTS, Precision, Recompute, RunConfig, Schedule, settings
from megalite.errors import ConfigError
from megalite.training.launch_checks import launch_problems


def _option_dests(parser):
    return {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}


def test_generated_parser_is_exactly_the_declarations():
    declared = {f.name for cls in PARTS.values() for f in dataclasses.fields(cls)}
    assert set(settings()) == declared  # every field is a setting, names unique across parts
    parser = build_parser()
    # every setting has a flag, and vice versa (besides the Megatron flags that are no setting: config/megatron.py)
    assert _option_dests(parser) == declared | set(ACTIONS) | non_setting_dests()
    flags = {s for a in parser._actions for s in a.option_strings}
    for spec in settings().values():
        assert spec.flag in flags, spec.flag
        assert spec.flag == "--" + spec.name.replace("_", "-")  # Megatron-LM's spelling
    assert {"--bf16", "--fp16", "--no-sequence-parallel"} <= flags  # aliases and negations


def test_defaults_are_declared_once():
    cfg, actions = parse_args([])
    assert cfg == RunConfig()
    assert actions == {"config": None, "print_config": False, "dry_run": False, "simulate": False,
                       "simulate_ranks": "representatives", "simulate_json": None}
    assert cfg.training.micro_batch_size == 8 and cfg.parallel.recompute is Recompute.NONE


def test_flags_parse_into_typed_settings():
    cfg, _ = parse_args(["--tp", "2", "--bf16", "--recompute", "selective", "--pipeline-schedule", "zb-h1",
                         "--data-path", "0.3", "a", "0.7", "b", "--profile-steps", "2", "4"])
    assert cfg.parallel.tp == 2 and cfg.precision.precision is Precision.BF16
    assert cfg.parallel.recompute is Recompute.SELECTIVE and cfg.parallel.pipeline_schedule is Schedule.ZB_H1
    assert cfg.data.data_path == ("0.3", "a", "0.7", "b") and cfg.logging.profile_steps == (2, 4)


def test_toml_file_flat_or_grouped_and_flags_override_it(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('hidden-size = 64\nbf16 = true\nmicro_batch_size = 2\n'
                    '[parallel]\ntp = 2\nsequence-parallel = true\n[optimizer]\nlr = 1e-3\n')
    cfg, _ = parse_args(["--config", str(path), "--tp", "4", "--no-sequence-parallel"])
    assert cfg.model.hidden_size == 64 and cfg.precision.precision == "bf16" and cfg.training.micro_batch_size == 2
    assert cfg.optimizer.lr == 1e-3
    assert cfg.parallel.tp == 4 and cfg.parallel.sequence_parallel is False  # the command line wins


def test_flag_synonym_sets_the_same_setting(tmp_path):
    """Megatron's --expert-model-parallel-size is --ep: on the command line and as a config-file key."""
    assert settings()["ep"].synonyms == ("--expert-model-parallel-size",)
    assert parse_args(["--expert-model-parallel-size", "4"])[0].parallel.ep == 4
    assert parse_args(["--expert-model-parallel-size=2"])[0] == parse_args(["--ep", "2"])[0]
    path = tmp_path / "run.toml"
    path.write_text("[parallel]\nexpert-model-parallel-size = 2\n")
    assert read_config_file(path) == {"ep": 2}
    assert parse_args(["--config", str(path), "--ep", "4"])[0].parallel.ep == 4  # the command line wins
    path.write_text("ep = 2\nexpert_model_parallel_size = 4\n")
    with pytest.raises(ConfigFileError, match="ep is set twice"):
        read_config_file(path)
    path.write_text("[model]\nexpert-model-parallel-size = 2\n")
    with pytest.raises(ConfigFileError, match=r"'expert-model-parallel-size' is a \[parallel\] setting"):
        read_config_file(path)


def test_expert_tensor_parallel_size_is_etp():
    """Megatron's --expert-tensor-parallel-size is --etp (default 1: whole experts on every tp rank)."""
    assert RunConfig().parallel.etp == 1
    assert parse_args(["--tp", "2", "--expert-tensor-parallel-size", "2"])[0].parallel.etp == 2


def test_bad_synonym_value_names_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--expert-model-parallel-size", "two"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--expert-model-parallel-size" in err and "invalid int value" in err
    with pytest.raises(ConfigError, match="--ep must be an integer >= 1, got 0"):  # the declared bound holds too
        parse_args(["--expert-model-parallel-size", "0"])


def test_json_config(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"parallel": {"pp": 2, "virtual-stages": 2}, "train_iters": 7}))
    assert read_config_file(path) == {"pp": 2, "virtual_stages": 2, "train_iters": 7}


@pytest.mark.parametrize("text,needle", [
    ("hiden-size = 64\n", "unknown key 'hiden-size'; did you mean 'hidden-size'?"),
    ("[model]\ntp = 2\n", "'tp' is a [parallel] setting, not [model]"),
    ("tp = 'two'\n", "tp takes an integer, got 'two'"),
    ("recompute = 'most'\n", "recompute = 'most' is not one of ['none', 'selective', 'full']"),
    ("sequence-parallel = 1\n", "sequence-parallel takes true or false"),
    ("tp = \n", "not valid TOML"),
])
def test_bad_config_file_names_the_key(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigFileError) as error:
        parse_args(["--config", str(path)])
    assert needle in str(error.value)


def test_print_config_round_trips(tmp_path):
    cfg, _ = parse_args(["--tp", "2", "--pp", "2", "--virtual-stages", "2", "--fp16", "--data-path", "x",
                         "--global-batch-size", "32", "--micro-batch-size", "2"])
    resolved = cfg.resolved(world_size=8, tokenizer_vocab_size=257)
    text = to_toml(resolved, resolved.derived())
    path = tmp_path / "printed.toml"
    path.write_text(text)
    again, _ = parse_args(["--config", str(path)])
    assert again == resolved
    assert "#   num_microbatches = 8" in text and '#   pipeline_schedule = "interleaved"' in text


def test_derived_values_are_computed_in_one_place():
    cfg = RunConfig.build(tp=2, pp=2, micro_batch_size=2, global_batch_size=16, virtual_stages=2).resolved(8, 100)
    assert (cfg.dp, cfg.num_microbatches, cfg.schedule, cfg.world_size) == (2, 4, "interleaved", 8)
    derived = cfg.derived()
    assert derived["padded_vocab_size"] == 256 and derived["chunk_layers"] == [1, 1, 1, 1]
    assert RunConfig.build(micro_batch_size=4).resolved(4, 100).global_batch_size == 16  # micro * dp


def test_validate_lists_every_problem_with_its_fix():
    cfg = RunConfig.build(tp=3, micro_batch_size=3, global_batch_size=8, zero=3, save_interval=5,
                          grad_reduce_dtype="fp16", recompute_num_layers=2, overlap_param_gather=True).resolved(4, 257)
    text = "\n".join(launch_problems(cfg, 4, 257))
    for needle in ("world size 4 != tp*pp*dp", "choose tp in", "choose a multiple of 3",
                   "ZeRO-3 gathers each unit right before it runs",
                   "--grad-reduce-dtype fp16 is modelled", "--recompute-num-layers 2 needs --recompute full",
                   "--save-interval needs --save DIR"):
        assert needle in text, (needle, text)
    assert launch_problems(RunConfig().resolved(1, 257), 1, 257) == []
    # the settings' own problems need no world: RunConfig.validate(); values out of bounds come first
    assert cfg.validate() == [p for p in launch_problems(cfg, 4, 257) if "--" in p.split()[0]]
    bad = RunConfig.build(zero3_prefetch=-1, tp=3)
    assert launch_problems(bad, 4, 257) == bad.validate() == ["--zero3-prefetch must be an integer >= 0, got -1; "
                                                              "e.g. --zero3-prefetch 1 (the default)"]


def test_the_planner_loads_without_torch():
    code = "import sys, megalite.plan, megalite.config, megalite.cli; from megalite.plan import estimate, suggest; " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_context_parallel_settings():
    from megalite.config import CPCommType
    from megalite.context_parallel.checks import CP_COMM_TYPES

    assert tuple(c.value for c in CPCommType) == CP_COMM_TYPES  # one list of methods, the model's and the flag's
    cfg, _ = parse_args(["--cp", "2", "--cp-comm-type", "a2a", "--tp", "2", "--global-batch-size", "16",
                         "--micro-batch-size", "2"])
    assert (cfg.parallel.cp, cfg.parallel.cp_comm_type) == (2, CPCommType.A2A)
    cfg = cfg.resolved(16, 257)  # dp = world / (tp*cp*pp)
    assert (cfg.dp, cfg.world_size, cfg.num_microbatches) == (4, 16, 2)
    assert launch_problems(cfg, 16, 257) == [] and RunConfig.from_dict(cfg.to_dict()) == cfg
    text = "\n".join(launch_problems(cfg.replace(cp=4, seq_length=100), 16, 257))
    for needle in ("world size 16 != tp*cp*pp*dp = 2*4*1*4 = 32", "seq_length=100 is not divisible by 2*cp = 8",
                   "num_attention_heads/tp = 4/2 = 2 is not divisible by cp=4"):
        assert needle in text, (needle, text)


def test_grad_compression_settings():
    from megalite.config import GradCompression

    cfg, _ = parse_args(["--grad-compression", "powersgd", "--powersgd-rank", "8", "--powersgd-warmup-steps", "10",
                         "--powersgd-min-compression", "4", "--zero", "1"])
    p = cfg.parallel
    assert (p.grad_compression, p.powersgd_rank, p.powersgd_warmup_steps, p.powersgd_min_compression) == \
        (GradCompression.POWERSGD, 8, 10, 4.0)
    assert RunConfig().parallel.powersgd_rank == 4 and RunConfig().parallel.grad_compression == "none"
    cfg = cfg.resolved(4, 257)
    assert launch_problems(cfg, 4, 257) == [] and RunConfig.from_dict(cfg.to_dict()) == cfg
    text = "\n".join(launch_problems(cfg.replace(zero=3, grad_reduce_dtype="bf16"), 4, 257))
    for needle in ("composes with --zero 0, 1 or 2 only", "drop --grad-reduce-dtype bf16"):
        assert needle in text, (needle, text)
    text = "\n".join(cfg.replace(powersgd_rank=0, powersgd_warmup_steps=-1, powersgd_min_compression=-1.0).validate())
    for needle in ("--powersgd-rank must be an integer >= 1, got 0; 4 is a good start",
                   "--powersgd-warmup-steps must be an integer >= 0", "--powersgd-min-compression must be a finite "
                   "number >= 0"):
        assert needle in text, (needle, text)
