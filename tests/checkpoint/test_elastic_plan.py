"""megalite.checkpoint.elastic: what a resume on another world decides, from metadata alone (no processes).

The end-to-end runs (losses, parameters, sample indices across a real resize) are in test_elastic_resize.py.
"""
import json
import math

import pytest

from megalite.checkpoint import storage
from megalite.checkpoint.elastic import ElasticState, find_checkpoint, plan_resume
from megalite.cli import given_settings, parse_args
from megalite.config import RunConfig
from megalite.errors import ConfigError


def fake_checkpoint(root, step=6, *, world=4, tp=2, pp=1, cp=1, global_batch=8, micro=2, lr=2e-3, min_lr=2e-4,
                    state=None, consumed=None, **settings):
    """A published checkpoint directory holding only what a resume plan reads (metadata + manifest)."""
    dp = world // (tp * pp * cp)
    train = RunConfig.build(tp=tp, pp=pp, cp=cp, dp=dp, global_batch_size=global_batch, micro_batch_size=micro,
                            lr=lr, min_lr=min_lr, **settings).to_dict()
    metadata = {"format_version": storage.FORMAT_VERSION, "step": step, "items": [], "train_config": train,
                "consumed_samples": global_batch * step if consumed is None else consumed,
                "layout": {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "world_size": world, "virtual_stages": 1},
                "extra": {} if state is None else {"elastic": state.to_dict()}}
    directory = root / storage.step_dir_name(step)
    directory.mkdir(parents=True)
    sha = storage.write_json_atomic(directory / storage.METADATA, metadata)
    size = (directory / storage.METADATA).stat().st_size
    storage.write_json_atomic(directory / storage.MANIFEST, {"files": {storage.METADATA: {"sha256": sha,
                                                                                          "bytes": size}}})
    storage.write_json_atomic(root / storage.LATEST, {"step_dir": directory.name})
    return root


def plan(argv, world):
    cfg, _ = parse_args(argv)
    return plan_resume(cfg, world, given_settings(argv))


def test_keep_holds_the_global_batch_rederives_dp_and_keeps_tp(tmp_path):
    root = fake_checkpoint(tmp_path / "ckpt", state=ElasticState(8, 2))
    # The first run's command line had --tp 2 --dp 2; this launch names neither tp nor dp.
    p = plan(["--load", str(root), "--global-batch-size", "8", "--micro-batch-size", "2"], world=2)
    cfg = p.cfg.resolved(2)
    assert (cfg.parallel.tp, cfg.dp, cfg.global_batch_size, cfg.num_microbatches) == (2, 1, 8, 4)
    assert cfg.optimizer.lr == 2e-3 and cfg.optimizer.min_lr == 2e-4  # unchanged, exactly
    assert any("--tp 2" in note for note in p.notes)
    r = p.resize.record()
    assert {k: r[k] for k in ("event", "step", "old_world_size", "new_world_size", "old_dp", "new_dp",
                              "old_global_batch_size", "new_global_batch_size", "old_num_microbatches",
                              "new_num_microbatches", "batch_rule", "lr_factor", "lr_factor_total",
                              "consumed_samples")} == {
        "event": "resize", "step": 6, "old_world_size": 4, "new_world_size": 2, "old_dp": 2, "new_dp": 1,
        "old_global_batch_size": 8, "new_global_batch_size": 8, "old_num_microbatches": 2, "new_num_microbatches": 4,
        "batch_rule": "keep", "lr_factor": 1.0, "lr_factor_total": 1.0, "consumed_samples": 48}
    line = p.resize.describe()
    assert "world 4 -> 2 ranks" in line and "global batch 8 kept" in line and "learning rate unchanged" in line


def test_context_parallel_is_kept_like_tp_and_pp(tmp_path):
    root = fake_checkpoint(tmp_path / "ckpt", world=8, tp=2, cp=2, global_batch=8, state=ElasticState(8, 2))
    p = plan(["--load", str(root), "--global-batch-size", "8", "--micro-batch-size", "2"], world=4)
    cfg = p.cfg.resolved(4)
    assert (cfg.parallel.tp, cfg.parallel.cp, cfg.dp, cfg.num_microbatches) == (2, 2, 1, 4)
    assert "(tp 2, pp 1, cp 2; dp 2 -> 1)" in p.resize.describe()
    with pytest.raises(ConfigError, match=r"not a multiple of the 4 ranks of one model replica \(tp 2 x pp 1 x cp 2\)"):
        plan(["--load", str(root), "--global-batch-size", "8", "--micro-batch-size", "2"], world=6)


def test_expert_parallelism_is_kept_and_fitted_to_the_new_dp(tmp_path):
    # Saved on 8 ranks at dp 8, ep 4, 8 experts: ep is kept like tp; where the new dp no longer holds it (the
    # checkpoint's ep, kept or given again), the largest ep dividing dp and the experts; another --ep is validated.
    root = fake_checkpoint(tmp_path / "ckpt", world=8, tp=1, global_batch=24, state=ElasticState(24, 1), micro=1,
                           num_experts=8, ep=4)
    batch = ["--load", str(root), "--global-batch-size", "24", "--micro-batch-size", "1", "--num-experts", "8"]
    kept = plan(batch, world=4)
    assert (kept.cfg.parallel.ep, kept.resize.old_ep, kept.resize.new_ep) == (4, 4, 4)
    assert "dp 8 -> 4, ep 4)" in kept.resize.describe() and any("--ep 4" in n for n in kept.notes)
    for argv, world, ep in [(batch, 2, 2), (batch + ["--ep", "4"], 2, 2), (batch, 6, 2), (batch, 1, 1),
                            (batch + ["--ep", "8"], 2, 8)]:  # the last: the person's choice, refused later
        p = plan(argv, world)
        assert p.cfg.parallel.ep == ep, (argv, world)
        fitted = [n for n in p.notes if "(the checkpoint's) does not divide" in n]
        assert bool(fitted) == (ep not in (4, 8)), p.notes
    assert "dp 8 -> 2, ep 4 -> 2)" in plan(batch, 2).resize.describe()


def test_keep_holds_a_defaulted_global_batch_too_and_the_same_dp_flag_is_rederived(tmp_path):
    # The first run left the global batch to default (micro * dp = 2 * 4); at dp 2 it would be 4.
    root = fake_checkpoint(tmp_path / "ckpt", world=4, tp=1, global_batch=8, state=ElasticState(None, 2))
    p = plan(["--load", str(root), "--dp", "4", "--micro-batch-size", "2"], world=2)
    cfg = p.cfg.resolved(2)
    assert (cfg.dp, cfg.global_batch_size, cfg.num_microbatches) == (2, 8, 2)
    assert p.resize.old_num_microbatches == 1 and any("--dp 4 is the checkpoint's" in n for n in p.notes)


@pytest.mark.parametrize("rule,factor", [("linear", 0.5), ("sqrt", math.sqrt(0.5))])
def test_scale_follows_dp_and_rescales_the_learning_rate(tmp_path, rule, factor):
    root = fake_checkpoint(tmp_path / "ckpt", state=ElasticState(8, 2))
    p = plan(["--load", str(root), "--tp", "2", "--global-batch-size", "8", "--micro-batch-size", "2",
              "--elastic-batch", "scale", "--elastic-lr-rule", rule], world=2)
    cfg = p.cfg.resolved(2)
    assert (cfg.dp, cfg.global_batch_size, cfg.num_microbatches) == (1, 4, 2)  # each replica: same microbatches
    assert p.resize.lr_factor == factor and p.resize.lr_factor_total == factor and p.state.lr_factor == factor
    assert cfg.optimizer.lr == 2e-3 * factor and cfg.optimizer.min_lr == 2e-4 * factor
    assert f"x{factor:.6g} by the {rule} rule" in p.resize.describe()


def test_the_factor_compounds_and_a_plain_restart_keeps_the_scaled_run(tmp_path):
    # A run scaled once already (8 -> 4 at dp 2 -> 1, LR x0.5) checkpointed on 2 ranks; its flags still say 8.
    root = fake_checkpoint(tmp_path / "ckpt", world=2, global_batch=4, lr=1e-3, min_lr=1e-4,
                           state=ElasticState(8, 2, lr_factor=0.5))
    argv = ["--load", str(root), "--tp", "2", "--global-batch-size", "8", "--micro-batch-size", "2",
            "--elastic-batch", "scale"]
    again = plan(argv, world=2)  # the same command on the same world: still the scaled run
    assert again.resize is None and again.cfg.training.global_batch_size == 4 and again.cfg.optimizer.lr == 1e-3
    assert again.state == ElasticState(8, 2, lr_factor=0.5)
    grown = plan(argv, world=8)  # back to 8 ranks (dp 4): the batch follows dp, the factor compounds
    assert grown.cfg.training.global_batch_size == 16 and grown.state.lr_factor == 0.5 * 4.0
    assert grown.cfg.optimizer.lr == 2e-3 * 2.0 and grown.resize.lr_factor == 4.0


def test_changed_batch_flags_are_a_deliberate_change(tmp_path):
    root = fake_checkpoint(tmp_path / "ckpt", world=2, global_batch=4, lr=1e-3, state=ElasticState(8, 2, 0.5))
    p = plan(["--load", str(root), "--tp", "2", "--global-batch-size", "16", "--micro-batch-size", "2"], world=4)
    assert p.cfg.training.global_batch_size == 16 and p.cfg.optimizer.lr == 2e-3 and p.state.lr_factor == 1.0
    assert p.resize.batch_rule == "flags" and any("batch flags differ" in n for n in p.notes)


def test_a_checkpoint_without_elastic_state_counts_its_own_batch_as_the_request(tmp_path):
    root = fake_checkpoint(tmp_path / "ckpt", global_batch=8)  # written before ElasticState existed
    p = plan(["--load", str(root), "--tp", "2", "--global-batch-size", "8", "--micro-batch-size", "2"], world=2)
    assert p.resize.batch_rule == "keep" and p.cfg.training.global_batch_size == 8


def test_no_load_optim_means_weights_only():
    # argparse's BooleanOptionalAction reads any flag starting with --no- as False: megalite's own
    # --no-... settings are plain switches, undone by the flag without --no-.
    assert parse_args(["--no-load-optim"])[0].checkpoint.no_load_optim is True
    assert parse_args(["--no-load-optim", "--load-optim"])[0].checkpoint.no_load_optim is False


def test_no_checkpoint_or_weights_only_plans_nothing(tmp_path):
    assert plan(["--load", str(tmp_path / "empty")], world=2).step is None
    root = fake_checkpoint(tmp_path / "ckpt")
    p = plan(["--load", str(root), "--no-load-optim"], world=2)
    assert p.step is None and p.resize is None and p.cfg == parse_args(["--load", str(root), "--no-load-optim"])[0]
    same = plan(["--load", str(root), "--tp", "2", "--global-batch-size", "8", "--micro-batch-size", "2"], world=4)
    assert same.step == 6 and same.resize is None and same.notes == ()


def test_the_checkpoint_is_the_one_load_takes(tmp_path):
    root = fake_checkpoint(tmp_path / "ckpt", step=4, global_batch=8)
    fake_checkpoint(root, step=6, global_batch=4)
    assert find_checkpoint(str(root))[0] == 6 and find_checkpoint(str(root), 4)[0] == 4
    assert find_checkpoint(str(root / "step_000004"))[0] == 4  # a step directory itself
    (root / "step_000006" / storage.METADATA).write_text(json.dumps({"format_version": 1}))  # sha mismatch
    assert find_checkpoint(str(root))[0] == 4  # load_checkpoint falls back past it too
    assert find_checkpoint(str(root), 5) is None


@pytest.mark.parametrize("argv,world,needles", [
    (["--global-batch-size", "8", "--micro-batch-size", "2"], 3,
     ["on 3 ranks: 3 is not a multiple of the 2 ranks of one model replica (tp 2 x pp 1)", "launch 2, 4, 6, 8"]),
    (["--tp", "1", "--global-batch-size", "8", "--micro-batch-size", "2"], 3,
     ["--elastic-batch keep holds checkpoint step 6's global batch 8, which is not divisible by micro 2 x dp 3",
      "a world of 1, 2 or 4 ranks", "or --elastic-batch scale"]),
    (["--tp", "1", "--global-batch-size", "8", "--micro-batch-size", "4"], 4,
     ["not divisible by micro 4 x dp 4 = 16; use --micro-batch-size 1 or 2"]),
])
def test_a_resize_that_cannot_work_names_the_fix(tmp_path, argv, world, needles):
    root = fake_checkpoint(tmp_path / "ckpt", world=4, tp=2, global_batch=8, state=ElasticState(8, 2))
    with pytest.raises(ConfigError) as error:
        plan(["--load", str(root), *argv], world)
    for needle in needles:
        assert needle in str(error.value), str(error.value)
