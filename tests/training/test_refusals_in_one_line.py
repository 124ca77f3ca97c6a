"""Mistakes that ended in a traceback end in one line naming the fix, exit 2 (issue 49, item 8): flags,
output paths, W&B, a hardware profile, the Python API's arguments, preprocessing's line numbers, a full
disk's sizes, and Ctrl-C before the trainer's imports are done."""
import contextlib
import dataclasses
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from megalite import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megalite.checkpoint import storage
from megalite.cli import parse_args
from megalite.data import DataError
from megalite.data.gpt_dataset import parse_data_path, parse_split
from megalite.errors import ConfigError, UsageError
from megalite.plan.hardware import A100_80GB
from megalite.tensor_parallel.parallelize import parallelize
from megalite.training import loop

SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "1", "--eval-iters", "0", "--train-iters", "1"]


def _run(main, argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def _one_line(code, err, *needles):
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (code, err)
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("split", ["inf,1,1", "1,nan,1", "1e400,1"])
def test_a_split_of_non_finite_weights_is_refused(split):
    with pytest.raises(DataError, match="finite non-negative numbers"):
        parse_split(split)


@pytest.mark.parametrize("weight", ["inf", "nan", "-1", "0"])
def test_a_blend_weight_that_is_not_a_finite_positive_number_is_refused(weight):
    with pytest.raises(DataError, match=f"weight {weight} of 'G' must be a finite positive number"):
        parse_data_path([weight, "G", "1", "G2"])


def test_a_split_flag_of_infinity_is_one_line():
    _one_line(*_run(loop.main, SMALL + ["--split", "inf,1,1"]), "--split 'inf,1,1'")


@pytest.mark.parametrize("flags,needle", [
    (["--simulate-ranks", "all"], "--simulate-ranks: only used by --simulate"),
    (["--simulate-json", "out.json"], "--simulate-json: only used by --simulate"),
])
def test_simulate_flags_without_simulate_are_refused(flags, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_args(flags)
    assert parse_args(["--simulate"])[1]["simulate_ranks"] == "representatives"


def test_simulate_json_naming_a_directory_or_a_path_below_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=f"--simulate-json {tmp_path} is a directory"):
        parse_args(["--simulate", "--simulate-json", str(tmp_path)])
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        parse_args(["--simulate", "--simulate-json", str(tmp_path / "file" / "out.json")])


def test_output_directories_that_cannot_be_made_or_are_files_are_one_line(tmp_path):
    _one_line(*_run(loop.main, SMALL + ["--tensorboard-dir", "/proc/no/such"]), "--tensorboard-dir /proc/no/such",
              "cannot create")
    (tmp_path / "file").write_text("")
    _one_line(*_run(loop.main, SMALL + ["--metrics-file", "/proc/no/m.jsonl"]), "cannot create")
    code, err = _run(loop.main, SMALL + ["--wandb-project", "p", "--wandb-save-dir", str(tmp_path / "file")])
    assert code == 2 and f"--wandb-save-dir {tmp_path / 'file'} is a file" in err, err
    assert not (tmp_path / "no").exists()


def test_wandb_without_an_api_key_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    _one_line(*_run(loop.main, SMALL + ["--wandb-project", "p"]), "--wandb-project p: no W&B API key",
              "WANDB_MODE=offline")


@pytest.mark.parametrize("field,value,needle", [
    ("memory_bandwidth_gbs", "fast", "memory_bandwidth_gbs takes a number, got 'fast'"),
    ("peak_tflops", {"bf16": "lots"}, "peak_tflops takes an object of numbers"),
    ("matmul_efficiency", [["big", 0.5]], "matmul_efficiency takes a list of rows [float, float]"),
    ("devices_per_node", "8", "devices_per_node takes an integer"),
])
def test_a_hardware_file_with_text_where_a_number_belongs_is_one_line(tmp_path, field, value, needle):
    from megalite.tools.plan import main as plan_main

    profile = {**dataclasses.asdict(A100_80GB), field: value}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(profile))
    _one_line(*_run(plan_main, ["--hardware", str(path)]), f"--hardware {path}: {needle}")


@pytest.mark.parametrize("make,error,needle", [
    (lambda: ColumnParallelLinear("64", 32), TypeError, "ColumnParallelLinear: in_features takes a positive int, "
                                                        "got '64' (str)"),
    (lambda: ColumnParallelLinear(64, 0), ValueError, "ColumnParallelLinear: out_features takes a positive int, got 0"),
    (lambda: ColumnParallelLinear(64, 32.5), TypeError, "ColumnParallelLinear: out_features takes a positive int, "
                                                        "got 32.5 (float)"),
    (lambda: RowParallelLinear(64, 32, tp_group="tp"), TypeError, "RowParallelLinear: tp_group takes a "
                                                                  "torch.distributed ProcessGroup"),
    (lambda: RowParallelLinear(True, 32), TypeError, "RowParallelLinear: in_features takes a positive int"),
    (lambda: VocabParallelEmbedding(-3, 8), ValueError, "VocabParallelEmbedding: num_embeddings takes a positive int"),
    (lambda: parallelize(torch.nn.Linear(2, 2), None, ["0"]), TypeError, "parallelize: plan takes a dict {glob: "
                                                                          "style}"),
    (lambda: parallelize(torch.nn.Linear(2, 2), "tp", {}), TypeError, "parallelize: mesh takes a megalite Mesh"),
])
def test_the_python_api_names_the_argument_and_what_it_takes(make, error, needle):
    with pytest.raises(error) as caught:
        make()
    assert str(caught.value).startswith(needle) and "\n" not in str(caught.value)
    assert isinstance(caught.value, UsageError)
    assert ColumnParallelLinear(4, 2).weight.shape == (2, 4)  # sizes that numpy gives are ints too
    import numpy as np
    assert RowParallelLinear(np.int64(4), 2).weight.shape == (2, 4)


def test_preprocessing_names_the_line_that_is_not_utf8(tmp_path):
    from megalite.tools.preprocess_data import main as preprocess_main

    lines = [json.dumps({"text": f"document {i} " + "x" * 100}).encode() for i in range(40)]
    lines[30] = b'{"text": "caf\xe9"}'  # Latin-1, on line 31, well inside the decoder's first read
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    code, err = _run(preprocess_main, ["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                                       str(tmp_path / "out"), "--tokenizer", "byte", "--workers", "1"])
    _one_line(code, err, f"{tmp_path / 'in.jsonl'}:31: not UTF-8 text")


def test_a_full_disk_says_the_real_sizes(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: usage._replace(free=1234))
    problems = storage.check_save_dir(str(tmp_path), 56_789)
    assert len(problems) == 1 and "1.23 kB (1234 bytes) free" in problems[0] and "56.79 kB (56789 bytes)" in problems[0]


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid`, running the trainer's entry (not the fork before its exec), has a handler for
    `sig` (SigCgt in /proc/PID/status)."""
    try:
        if b"megalite.commands" not in open(f"/proc/{pid}/cmdline", "rb").read():
            return False
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.slow  # a subprocess starting the trainer (seconds of imports)
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_ctrl_c_while_the_trainer_imports_is_one_line():
    child = subprocess.Popen([sys.executable, "-m", "megalite.commands", *SMALL], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not _catches(child.pid, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.005)  # the entry's handlers are in: torch is being imported
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 128 + signal.SIGINT and "step 1" not in out, (out, err)
    assert err.strip() in ("megalite: SIGINT while starting (before set-up): stopped, nothing trained or saved",
                           "megalite: SIGINT during set-up (before the first step): stopped, nothing trained or saved"), err
