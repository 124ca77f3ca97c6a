"""Every declared setting refuses the invalid values its declaration implies: one line, exit 2.

The cases are generated from RunConfig's declarations (config.bounds.Bounds of each setting), so
a setting added tomorrow is covered by these tests the day it is declared. Each case runs the
training program's entry point in-process, the way examples/pretrain_gpt.py does
(`sys.exit(main(argv))`); one subprocess checks the real script.
"""
import json
import math
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from megalite.config import RunConfig, settings
from megalite.training.loop import main

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "pretrain_gpt.py"


def _run(argv, capsys) -> tuple[int, str]:
    """(exit code, stderr) of the program given `argv`, as `sys.exit(main(argv))` ends it."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's mistakes
        code = exc.code
    return code, capsys.readouterr().err


def _numbers_kind(spec):
    return typing.get_args(spec.type)[0] if typing.get_origin(spec.type) is tuple else spec.type


def _outside(spec) -> list:
    """Values of a number setting its bounds refuse: below the minimum (zero, negative), at or past
    an exclusive bound, above the maximum, and NaN/+-inf for a finite float."""
    b, kind, values = spec.bounds, _numbers_kind(spec), []
    step = 1 if kind is int else 0.5
    if b.minimum is not None:
        values.append(kind(b.minimum - step))
    if b.above is not None:
        values += [kind(b.above), kind(b.above - step)]
    if b.below is not None:
        values += [kind(b.below), kind(b.below + step)]
    if b.maximum is not None:  # (next to a large float maximum, + 0.5 is the same float)
        values.append(kind(b.maximum + step) if kind is int else max(b.maximum + step, math.nextafter(b.maximum, math.inf)))
    if kind is float and b.finite:
        values += [math.nan, math.inf, -math.inf]
    elif kind is float:
        values.append(math.nan)
    return values


def _number_cases():
    for spec in settings().values():
        if _numbers_kind(spec) not in (int, float):
            continue
        for value in _outside(spec):
            width = len(typing.get_args(spec.type)) if typing.get_origin(spec.type) is tuple else 1
            yield spec, [spec.flag, *[str(value)] * width] if width > 1 else [f"{spec.flag}={value}"]


def test_every_number_setting_declares_bounds():
    """A number setting without bounds (or choices) would accept 0 and -1: every one declares them."""
    unbounded = [s.flag for s in settings().values()
                 if _numbers_kind(s) in (int, float) and not s.bounds.declared and not s.choices]
    assert unbounded == []
    assert sum(1 for _ in _number_cases()) >= 100  # the generator reaches every declared number setting


def test_every_out_of_bounds_value_is_refused_in_one_line(capsys):
    failures = []
    for spec, argv in _number_cases():
        code, err = _run(argv, capsys)
        if code != 2 or len(err.strip().splitlines()) != 1 or spec.flag not in err or "Traceback" in err:
            failures.append((argv, code, err[-300:]))
    assert failures == []


def test_relations_between_settings_are_refused(capsys):
    related = [s for s in settings().values() if s.bounds.at_most]
    assert related  # min_lr <= lr
    for spec in related:
        other = settings()[spec.bounds.at_most]
        code, err = _run([f"{spec.flag}={other.default * 10}", f"{other.flag}={other.default}"], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"it must be <= {other.flag}" in err and spec.flag in err


def _wrong_type(spec):
    """A JSON value of the wrong type for the setting (a tuple setting: a wrong item)."""
    kind = _numbers_kind(spec) if typing.get_origin(spec.type) is tuple else spec.type
    wrong = {int: "two", float: "two", str: 5, bool: "yes"}.get(kind, "no-such-choice")
    if kind is int and spec.choices:
        wrong = max(spec.choices) + 1  # an integer outside the declared choices
    return [wrong] if typing.get_origin(spec.type) is tuple else wrong


def test_every_setting_refuses_a_wrong_type_in_a_config_file_and_on_the_command_line(tmp_path, capsys):
    failures = []
    for spec in settings().values():
        path = tmp_path / f"{spec.name}.json"
        path.write_text(json.dumps({spec.name: _wrong_type(spec)}))
        code, err = _run(["--config", str(path)], capsys)
        if code != 2 or len(err.strip().splitlines()) != 1 or spec.name.replace("_", "-") not in err:
            failures.append((spec.name, "file", code, err[-300:]))
        if spec.type is bool or spec.type is str or typing.get_origin(spec.type) is tuple:
            continue  # a flag's text is any string; switches take no value
        code, err = _run([f"{spec.flag}=no-such-value"], capsys)
        if code != 2 or len(err.strip().splitlines()) != 1 or spec.flag not in err:
            failures.append((spec.name, "flag", code, err[-300:]))
    assert failures == []


@pytest.mark.parametrize("argv,needle", [
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--lr", "-1"], "--lr must be a finite number >= 0, got -1.0"),
    (["--adam-beta1", "2"], "--adam-beta1 must be a finite number >= 0 and < 1, got 2.0"),
    (["--tp", "0"], "--tp must be an integer >= 1, got 0"),
    (["--num-attention-heads", "0"], "--num-attention-heads must be an integer >= 1"),
    (["--hidden-size", "0"], "--hidden-size must be an integer >= 1"),
    (["--seq-length", "0"], "--seq-length must be an integer >= 1"),
    (["--global-batch-size", "-8"], "--global-batch-size must be an integer >= 1, got -8"),
    (["--clip-grad", "-1"], "--clip-grad must be a finite number >= 0"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout must be a finite number >= 0 and < 1"),
    (["--seed", "-1"], "--seed must be an integer >= 0"),
    (["--min-lr", "1"], "--min-lr 1.0 is above --lr 0.002"),
    (["--lr-warmup-iters", "-1"], "--lr-warmup-iters must be an integer >= 0"),
    (["--eval-interval", "-1"], "--eval-interval must be an integer >= 0"),
    (["--vocab-size", "0"], "--vocab-size must be an integer >= 1"),
    (["--tp", "two"], "argument --tp/--tensor-model-parallel-size: invalid int value: 'two'"),
])
def test_the_mistakes_users_made(argv, needle, capsys):
    code, err = _run(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize("name,text,needle", [
    ("list.json", "[1, 2]", "the top level must be an object of settings"),
    ("twice.json", '{"hidden_size": 64, "hidden-size": 128}', "hidden-size is set twice"),
    ("same.json", '{"tp": 1, "tp": 2}', "key 'tp' appears twice"),
    ("twice.toml", "hidden_size = 64\n[model]\nhidden-size = 128\n", "hidden-size is set twice"),
    ("alias.toml", 'bf16 = true\nprecision = "fp32"\n', "precision is set twice"),
    ("nan.toml", "lr = nan\n", "--lr must be a finite number"),
    ("binary.toml", b"\xff\xfe\x00", "not a text file"),
])
def test_config_file_mistakes(tmp_path, capsys, name, text, needle):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, err = _run(["--config", str(path)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_the_bounds_do_not_refuse_the_defaults_or_the_presets():
    assert RunConfig().bound_problems() == []
    for name in ("gpt2-1.3b", "llama-70b"):
        assert RunConfig.build(model=name).bound_problems() == []


def test_the_script_itself_prints_one_line_and_exits_2():
    done = subprocess.run([sys.executable, str(SCRIPT), "--lr", "nan"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        "megalite: configuration error: --lr must be a finite number >= 0, got nan; e.g. --lr 0.002 (the default)"]
