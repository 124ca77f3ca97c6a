"""tools/scaling.py: world sizes, the job's command line, efficiency and the 80% flag (no job is run here)."""
import argparse
import importlib.util
import json
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "scaling.py"
_spec = importlib.util.spec_from_file_location("scaling_tool", _PATH)
scaling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scaling)


def test_sizes_efficiency_and_flags():
    assert scaling.world_sizes(8, 1) == [1, 2, 4, 8] and scaling.world_sizes(8, 2) == [2, 4, 8]
    rows = scaling.efficiency_rows({1: 100.0, 2: 190.0, 4: 300.0})
    assert [round(r["efficiency"], 3) for r in rows] == [1.0, 0.95, 0.75]
    assert [r["flagged"] for r in rows] == [False, False, True]
    lines = scaling.describe(rows).splitlines()
    assert "< 80%" in lines[3] and not any("< 80%" in line for line in lines[:3])
    relative = scaling.efficiency_rows({2: 100.0, 8: 320.0})  # a tp=2 layout: relative to world 2
    assert relative[1]["efficiency"] == 0.8 and not relative[1]["flagged"]


def test_job_command_and_throughput(tmp_path):
    args = argparse.Namespace(tp=2, pp=1, cp=1, script="examples/pretrain_gpt.py")
    command = scaling.job_command(8, args, ["--train-iters", "5"], tmp_path / "m.jsonl")
    # this Python's torchrun (not PATH's), a short job by default that the job's own flags override
    assert command[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "8"]
    flags = command[command.index(str(scaling.ROOT / "examples/pretrain_gpt.py")) + 1:]
    assert flags[:6] == ["--train-iters", "20", "--eval-iters", "0", "--train-iters", "5"]
    assert command[command.index("--dp") + 1] == "4" and command[command.index("--tp") + 1] == "2"
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "tokens_per_sec": rate}) + "\n"
                               for i, rate in enumerate([10.0, 100.0, 120.0, 110.0])))
    assert scaling.measured_throughput(metrics) == 110.0  # the median after the warm-up step


@pytest.mark.parametrize("argv,needle", [
    (["--sizes", "1,two"], "--sizes 1,two: world sizes are whole numbers separated by commas"),
    (["--sizes", "0"], "--sizes 0: give one or more world sizes >= 1"),
    (["--tp", "0"], "--tp 0: must be >= 1"),
    (["--max-world", "x"], "--max-world: invalid int value"),
])
def test_bad_arguments_are_one_line(argv, needle, capsys):
    try:
        code = scaling.main(argv)
    except SystemExit as exc:  # argparse's own mistakes
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_oversubscribed_cpus_get_a_caveat():
    rows = scaling.efficiency_rows({1: 100.0, 2: 230.0})  # 115%: the baseline was held back
    assert "reflect contention, not scaling" in scaling.oversubscription_note(rows, cores=8)
    assert "2 ranks on 1 CPU cores" in scaling.oversubscription_note(scaling.efficiency_rows({1: 1.0, 2: 1.5}), 1)
    assert scaling.oversubscription_note(scaling.efficiency_rows({1: 1.0, 2: 1.5}), cores=8) is None
