"""tools/fault_drill.py: the verdict's arithmetic, and a real drill (3 faults under torchrun)."""
from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "fault_drill.py"
_spec = importlib.util.spec_from_file_location("fault_drill", _PATH)
fault_drill = importlib.util.module_from_spec(_spec)
sys.modules["fault_drill"] = fault_drill  # dataclasses look their module up there
_spec.loader.exec_module(fault_drill)


def test_plan_covers_both_kinds_and_every_moment_and_is_seeded():
    plan = fault_drill.plan_faults(3, 4, seed=5)
    assert sorted(f.kind for f in plan).count("SIGKILL") == 2 and {f.kind for f in plan} == {"SIGKILL", "SIGTERM"}
    assert sorted(f.moment for f in plan) == sorted(fault_drill.MOMENTS)
    assert all(0 <= f.rank < 4 for f in plan)
    assert fault_drill.plan_faults(3, 4, seed=5) == plan and fault_drill.plan_faults(3, 4, seed=6) != plan


def test_curves_compare_exactly_and_redone_steps_count_as_lost():
    reference = {1: 5.0, 2: 4.5, 3: 4.25, 4: 4.0}
    resumed = [(1, 5.0), (2, 4.5), (3, 4.25), (2, 4.5), (3, 4.25), (4, 4.0)]  # restarted from step 1
    assert fault_drill.compare_curves(reference, resumed, 4) is None
    assert fault_drill.steps_lost(resumed) == 2
    assert "step 3: loss 4.250001" in fault_drill.compare_curves(reference, resumed[:4] + [(3, 4.250001), (4, 4.0)], 4)
    assert "steps [4] were never logged" in fault_drill.compare_curves(reference, resumed[:5], 4)


@pytest.mark.slow
def test_drill_with_three_faults_matches_the_uninterrupted_run(tmp_path, capsys):
    code = fault_drill.main(["--faults", "3", "--seed", "0", "--train-iters", "32", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line.split() for line in out.splitlines() if re.match(r"^ +\d+ SIG", line)]
    assert len(rows) == 3 and {r[1] for r in rows} == {"SIGKILL", "SIGTERM"}, out
    assert {r[2] for r in rows} == set(fault_drill.MOMENTS), out  # every moment was hit, none fell back
    restarts = re.search(r"restarts: (\d+) \((\d+) by torchrun, (\d+) relaunches", out)
    assert restarts and int(restarts.group(1)) == 3 and int(restarts.group(3)) == 1, out  # one SIGTERM: a relaunch
    assert "faults injected: 3 of 3" in out and "verdict: MATCH" in out


def test_shrink_worlds_are_the_ones_the_kept_batch_fits():
    args = fault_drill.parse_args(["--shrink", "--nproc", "8"])
    flags = fault_drill.job_flags(args)
    assert flags[flags.index("--global-batch-size") + 1] == "16"  # micro 2 x dp 8: one microbatch per rank
    assert fault_drill.shrink_worlds(args) == [8, 4, 2, 1]
    args = fault_drill.parse_args(["--shrink", "--nproc", "4", "--", "--tp", "2", "--global-batch-size", "12"])
    assert fault_drill.shrink_worlds(args) == [4, 2]  # multiples of tp 2 whose dp divides 12 / micro 2
    assert fault_drill.compare_curves({1: 2.0}, [(1, 2.0 + 2e-7)], 1, rtol=2e-7) is None
    assert "rtol" in fault_drill.compare_curves({1: 2.0}, [(1, 2.0 + 5e-7)], 1, rtol=2e-7)


@pytest.mark.slow
def test_shrink_drill_loses_ranks_for_good_and_the_curve_continues(tmp_path, capsys):
    # Seed 7: a SIGKILL right after the first save (2 -> 1 rank, resumed from that checkpoint), then a
    # SIGTERM during a background write on the one rank left (the smallest world: relaunched as it is).
    code = fault_drill.main(["--shrink", "--faults", "2", "--seed", "7", "--train-iters", "12",
                             "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line.split() for line in out.splitlines() if re.match(r"^ +\d+ SIG", line)]
    assert [(r[1], r[2], r[-1]) for r in rows] == [("SIGKILL", "after-save", "2->1"),
                                                   ("SIGTERM", "during-async-write", "1")], out
    assert re.search(r"world-size changes: 2 -> 1 after step \d+ \(dp 2 -> 1, global batch 4 keep, "
                     r"accumulation 1 -> 2\)\n", out), out
    assert "restarts: 2 (0 by torchrun, 2 relaunches" in out and "verdict: MATCH" in out, out
