"""FP8 settings the run cannot honour end in one line naming the fix, before anything starts."""
import subprocess
import sys

import pytest

from megalite.config import RunConfig
from megalite.training.launch_checks import machine_problems


def test_settings_fp8_does_not_combine_with():
    assert RunConfig.build(fp8_format="hybrid", fp8_recipe="rowwise").validate() == []
    assert RunConfig.build(fp8_param_gather=True).validate() == ["--fp8-param-gather needs --fp8-format e4m3|hybrid"]
    problems = RunConfig.build(fp8_format="e4m3", precision="fp16", cp=2, fp8_param_gather=True).validate()
    assert [p.split(":")[0] for p in problems] == ["--fp8-format with --fp16",
                                                   "--fp8-param-gather needs --zero 3 (it is ZeRO-3's parameter "
                                                   "all-gather) and --fp8-recipe tensorwise (one scale per weight)"]
    assert RunConfig.build(fp8_format="e4m3", zero=3, fp8_param_gather=True).validate() == []


def test_the_machine_fp8_cannot_run_on(monkeypatch):
    # with the interpreter on, the FP8 line is the only problem (without it, the triton backend's own
    # "set TRITON_INTERPRET=1" line comes first)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = RunConfig.build(fp8_format="hybrid")
    assert machine_problems(cfg, cuda_available=False, kernel_backend="torch") == []
    interpreter = machine_problems(cfg, cuda_available=False, kernel_backend="triton")
    assert len(interpreter) == 1 and "interpreter" in interpreter[0]


@pytest.mark.slow  # a fresh interpreter importing torch: seconds
def test_the_cli_refuses_in_one_line_with_exit_code_2():
    run = subprocess.run([sys.executable, "examples/pretrain_gpt.py", "--fp8-format", "hybrid", "--fp16",
                          "--train-iters", "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "--fp8-format with --fp16" in run.stderr and "Traceback" not in run.stderr, run.stderr
