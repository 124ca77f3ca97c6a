"""What a run does with checkpoints it did not write, and how a resume names its differences (issue 49):
a --save directory holding another run's checkpoints is refused unless loaded or overwritten on
purpose; a checkpoint of another model is named before the schedule; the settings notice names the
step that loads."""
import dataclasses
import json

import pytest

from megalite.checkpoint.lock import foreign_checkpoints_problem
from megalite.checkpoint.resume_settings import check_resumed_settings
from megalite.cli import parse_args
from megalite.errors import ConfigError
from ckpt_helpers import SMALL_RUN, run_in_process

SMALL, _main = SMALL_RUN, run_in_process


def _published(root, *steps, latest=None):
    """Step directories with a manifest (published) and `latest` naming the newest, as a run leaves them."""
    for step in steps:
        (root / f"step_{step:06d}").mkdir(parents=True)
        (root / f"step_{step:06d}" / "manifest.json").write_text("{}")
    (root / "latest").write_text(json.dumps({"step_dir": f"step_{latest or max(steps):06d}"}))


@pytest.mark.parametrize("load,resumed,refused", [
    (None, None, [2, 4]),  # a fresh run
    ("same", 4, []),  # resuming the newest: nothing is overwritten
    ("same", 2, [4]),  # --load-step 2: step 4 would be written over
    ("other", 7, [2, 4]),  # loading another directory's checkpoint
    ("same", None, [2, 4]),  # weights only (--no-load-optim) or nothing found: a new run
])
def test_checkpoints_a_run_did_not_load_are_named(tmp_path, load, resumed, refused):
    save = tmp_path / "save"
    _published(save, 2, 4)
    load_dir = {None: None, "same": str(save), "other": str(tmp_path / "other")}[load]
    problem = foreign_checkpoints_problem(str(save), load_dir=load_dir, resumed_step=resumed, overwrite=False)
    if not refused:
        assert problem is None
        return
    steps = ", ".join(map(str, refused))
    assert problem.startswith(f"--save {save} holds checkpoints this run did not load (step {steps})"), problem
    assert f"--load {save}" in problem and "--overwrite-checkpoints" in problem and "\n" not in problem
    assert foreign_checkpoints_problem(str(save), load_dir=load_dir, resumed_step=resumed, overwrite=True) is None


def test_unpublished_step_directories_and_a_step_directory_as_load_count_as_such(tmp_path):
    _published(tmp_path, 2, 4, 6, latest=4)  # step 6 finished after `latest` was last moved: never published
    assert foreign_checkpoints_problem(str(tmp_path), load_dir=str(tmp_path), resumed_step=4, overwrite=False) is None
    assert foreign_checkpoints_problem(str(tmp_path), load_dir=str(tmp_path / "step_000004"), resumed_step=4,
                                       overwrite=False) is None
    assert foreign_checkpoints_problem(str(tmp_path / "empty"), load_dir=None, resumed_step=None,
                                       overwrite=False) is None


@pytest.mark.slow  # training runs in this process (3-8 s)
def test_a_fresh_run_keeps_another_runs_checkpoints_and_says_how_to_go_on(tmp_path):
    first = SMALL + ["--train-iters", "2", "--save-interval", "1", "--save", str(tmp_path)]
    assert _main(first)[0] == 0
    shard, latest = tmp_path / "step_000002" / "shard_r00000.bin", (tmp_path / "latest").read_text()
    before = shard.read_bytes()
    code, out, err = _main(first)  # the same command again, without --load
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"resume them with --load {tmp_path}" in err and "--overwrite-checkpoints" in err, err
    assert shard.read_bytes() == before and (tmp_path / "latest").read_text() == latest
    assert not (tmp_path / "megalite.lock").exists()
    code, out, err = _main(first + ["--load", str(tmp_path), "--load-step", "1"])  # would write over step 2
    assert code == 2 and "would write over the newer step 2" in err, err
    code, out, err = _main(first + ["--overwrite-checkpoints", "--seed", "7"])
    assert code == 0, err
    assert shard.read_bytes() != before  # replaced, as asked


@pytest.mark.slow  # training runs in this process (3-8 s)
def test_another_model_is_named_first_with_every_other_refused_change(tmp_path):
    run = SMALL + ["--save", str(tmp_path), "--load", str(tmp_path)]
    assert _main(run + ["--train-iters", "1", "--hidden-size", "64"])[0] == 0
    code, _, err = _main(run + ["--train-iters", "3", "--seed", "5"])
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 4 and lines[0] == "megalite: configuration error:", err
    assert lines[1].startswith("  - resuming checkpoint step 1: it holds another model (--hidden-size 64 -> 32, "
                               "--ffn-hidden-size 256 -> 128)"), err
    assert "--seed 1234 -> 5 changes the order of the samples read" in lines[2], err
    assert "--train-iters 1 -> 3 changes the learning-rate schedule" in lines[3], err


@pytest.mark.slow  # training runs in this process (3-8 s)
def test_the_settings_notice_names_the_step_that_loads_when_the_newest_is_damaged(tmp_path):
    run = SMALL + ["--save", str(tmp_path), "--load", str(tmp_path)]
    assert _main(run + ["--train-iters", "2", "--save-interval", "1"])[0] == 0
    shard = tmp_path / "step_000002" / "shard_r00000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    code, out, err = _main(run + ["--train-iters", "2", "--save-interval", "1", "--weight-decay", "0.2"])
    assert code == 0, err
    assert "checkpoint" in out and "is damaged" in out, out
    assert "megalite: resuming checkpoint step 1 with settings that differ from its run: --weight-decay 0.1 -> 0.2" \
        in out, out
    assert "resuming checkpoint step 2" not in out, out


def test_every_refused_difference_is_listed_at_once_the_model_first():
    saved, _ = parse_args(SMALL + ["--hidden-size", "64", "--train-iters", "2"])
    saved = saved.resolved(1, 257)
    now, _ = parse_args(SMALL + ["--num-layers", "2", "--train-iters", "4", "--seed", "5"])
    now = now.resolved(1, 257)
    model = dataclasses.asdict(saved.gpt_config())  # what a checkpoint's metadata holds as model_config
    with pytest.raises(ConfigError) as caught:
        check_resumed_settings(now, 2, saved.to_dict(), saved_model=model)
    lines = str(caught.value).splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("  - resuming checkpoint step 2: it holds another model (--num-layers 1 -> 2, "
                               "--hidden-size 64 -> 32, --ffn-hidden-size 256 -> 128)"), lines
    assert "changes the order of the samples read" in lines[1] and "changes the learning-rate schedule" in lines[2]
    same = check_resumed_settings(saved, 2, saved.to_dict(), saved_model=model)
    assert same == []
