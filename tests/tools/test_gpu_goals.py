"""tools/gpu_goals.py turns each GPU-plan step's output into GOAL lines: bench_kernels' own summary (as
goal_lines prints it), pytest's summary, bench_step_time's rows, a training run's metrics; a step with
no figure is reported, never silent. tools/gpu_plan.sh's parts fit one device call each."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"


def _load(name, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gg(monkeypatch):
    return _load("gpu_goals", monkeypatch)


def test_bench_kernels_summary_becomes_goal_lines(gg, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(TOOLS))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bench = _load("bench_kernels", monkeypatch)
    rows = [dict(op="grouped_mm", provider="megalite", mode="fwd+bwd", shape="mixtral", x_loop=1.3,
                 x_torch_grouped_mm=0.7),
            dict(op="grouped_mm", provider="megalite", mode="fwd+bwd", shape="skewed", x_loop=0.9,
                 x_torch_grouped_mm=0.95)]
    text = "goals (from gpu_ms; printed, never asserted):\n" + "\n".join(bench.goal_lines(rows)) + "\n"
    (tmp_path / "bench_moe_kernels.txt").write_text(text)
    lines = gg.goals("bench_moe_kernels", tmp_path)
    assert lines == [
        "GOAL bench_moe_kernels grouped_mm fwd+bwd: x a loop of per-expert matmuls: >= 1 | measured 0.90 "
        "(worst of 2: grouped_mm skewed fwd+bwd) | NOT met",
        "GOAL bench_moe_kernels grouped_mm fwd+bwd: x torch._grouped_mm: >= 0.8 | measured 0.70 "
        "(worst of 2: grouped_mm mixtral fwd+bwd) | NOT met"]
    (tmp_path / "bench_kernels.txt").write_text(text)
    lines = gg.goals("bench_kernels", tmp_path)
    assert len(lines) == len(bench.GOALS) and "rms_norm fwd+bwd 8192x4096: % of copy: >= 60 | measured - |" \
        " not measured" in lines[0]


def test_pytest_step_time_and_training_figures(gg, tmp_path):
    (tmp_path / "kernel_tests.txt").write_text("....F..\n1 failed, 165 passed, 5 skipped, 120 errors in 40.1s\n")
    assert gg.goals("kernel_tests", tmp_path) == [
        "GOAL kernel_tests: every kernel test passes on the GPU | measured 1 failed, 165 passed, 5 skipped, "
        "120 errors | NOT met"]
    (tmp_path / "step_time.txt").write_text(
        "NVIDIA H200: measured ...\n  gpt2-124m 8x1024             measured    40.5 ms  predicted    47.3 ms  "
        "ratio 1.168  (goal: within 15%)\n")
    assert gg.goals("step_time", tmp_path) == [
        "GOAL step_time gpt2-124m 8x1024: planner within 15% of the measured step | measured 40.5 ms, planner "
        "47.3 ms, ratio 1.168 | NOT met"]
    records = [dict(step=s, step_time_s=0.1444 if s > 5 else 1.0, tokens_per_sec=56.7e3, mfu=0.471,
                    mem_peak_bytes=37.2e9) for s in range(1, 11)] + [dict(step=10, eval_loss=11.8)]
    (tmp_path / "train_llama3.jsonl").write_text("\n".join(map(json.dumps, records)))
    assert gg.goals("train_llama3", tmp_path, mfu_goal=0.5) == [
        "GOAL train_llama3: MFU >= 50% | measured MFU 47.1%, 144.4 ms/step, 56.7k tok/s, peak 37.2 GB | NOT met"]
    (tmp_path / "bench_train.txt").write_text("GOAL bench_train gpt2-124m 8x1024: a | measured 2.019x | met\n")
    assert gg.goals("bench_train", tmp_path) == ["GOAL bench_train gpt2-124m 8x1024: a | measured 2.019x | met"]
    assert gg.goals("missing", tmp_path)[0].endswith("| NOT measured")


def test_steps_without_a_goal_and_steps_that_did_not_end_cleanly(gg, tmp_path):
    (tmp_path / "host_overhead.txt").write_text("...\nhost CPU ms per step     all             663.6        1040.9    0.64\n")
    (tmp_path / "tune_norms.txt").write_text("lines for kernels/rms_norm.py ...\n")
    (tmp_path / "bench_train_graph.txt").write_text("GOAL bench_train gpt2-124m 8x1024 --cuda-graph: x | measured 2.0x | met\n")
    (tmp_path / "plan.txt").write_text("host_overhead: exit 0 after 20 s (limit 50 s): python ...\n"
                                       "tune_norms: exit 124 after 60 s (limit 60 s): python ...\n"
                                       "bench_train_graph: exit 124 after 50 s (limit 50 s): python ...\n")
    assert gg.goals("host_overhead", tmp_path) == [
        "GOAL host_overhead: none (issue 26's per-step counts, megalite against transformers) | measured host CPU ms "
        "per step all 663.6 1040.9 0.64 (megalite, transformers, ratio) | -"]
    assert gg.goals("tune_norms", tmp_path)[0].endswith("| NOT measured")  # cut off: no clean end, no figure
    assert gg.goals("bench_train_graph", tmp_path)[1] == (
        "GOAL bench_train_graph: ends cleanly | measured exit 124 (its time limit) | NOT met")


def test_plan_parts_fit_one_device_call_each():
    """Each part's step limits sum under the device tool's 10 minutes (600 s) less start-up slack."""
    script = (TOOLS / "gpu_plan.sh").read_text()
    parts = dict(re.findall(r"^\s*(part\d)\)\s*steps=\"([^\"]+)\"", script, re.M))
    limits = dict(re.findall(r"^step (\w+) (\d+) ", script, re.M))
    assert set(parts) >= {"part1", "part2"}
    every = [name for steps in parts.values() for name in steps.split()]
    assert len(every) == len(set(every)) and set(every) == set(limits)  # each step in exactly one part
    for part, steps in parts.items():
        assert sum(int(limits[name]) for name in steps.split()) <= 540, part


def test_plan_lists_its_parts_on_cpu(tmp_path):
    result = subprocess.run(["bash", str(TOOLS / "gpu_plan.sh"), "--list"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0 and "part1:" in result.stdout and "part2:" in result.stdout, result.stderr


@pytest.mark.slow
def test_a_step_that_cannot_run_here_reports_not_measured(tmp_path):
    """The plan's plumbing on CPU: bench_attention refuses without a GPU; the step still ends with its line
    in plan.txt and a GOAL line saying nothing was measured."""
    result = subprocess.run(["bash", str(TOOLS / "gpu_plan.sh"), str(tmp_path), "bench_attention"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "bench_attention: exit 1 after" in (tmp_path / "plan.txt").read_text()
    goals = (tmp_path / "goals.txt").read_text().splitlines()
    assert goals == ["GOAL bench_attention: see bench_attention.txt | measured nothing (the step failed, timed out "
                     "or printed no figure) | NOT measured"]
    assert "needs a GPU" in (tmp_path / "bench_attention.txt").read_text()


class _Parsed(Exception):
    """Raised in place of running a tool once its command line has parsed."""


def test_every_step_command_line_parses(monkeypatch):
    """Each step's command, as --list prints it, is accepted by its tool's own parser (nothing runs): a flag
    misspelt in the plan is found here, not after minutes of device time."""
    import argparse
    import runpy
    import shlex

    listing = subprocess.run(["bash", str(TOOLS / "gpu_plan.sh"), "--list"], capture_output=True, text=True,
                             timeout=60, cwd=ROOT).stdout
    commands = re.findall(r"^  (\w+) \(limit \d+ s\): (.+)$", listing, re.M)
    assert len(commands) == 17
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.syspath_prepend(str(TOOLS))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what importing the kernel tools sets without a GPU
    checked, tools, before = [], {path.stem for path in TOOLS.glob("*.py")}, set(sys.modules)
    try:
        for name, command in commands:
            argv = shlex.split(command)
            if argv[:3] == ["python", "-m", "pytest"]:
                continue
            assert argv[0] == "python", name
            monkeypatch.setattr(sys, "argv", [str(ROOT / argv[1])] + argv[2:])
            with pytest.raises(_Parsed):
                runpy.run_path(str(ROOT / argv[1]), run_name="__main__")
            checked.append(name)
    finally:  # the tools the scripts imported (bench_train, tune_attention, ...) leave with them
        for module in (tools & set(sys.modules)) - before:
            del sys.modules[module]
    assert len(checked) == 16
