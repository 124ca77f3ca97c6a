"""Goodput you can plan (megalite/plan/goodput.py, tools/plan.py --goodput): the formulas against seeded
Monte Carlo failure traces of the same models, within 2%; the interval rules; the CLI's refusals."""
import importlib.util
import json
import math
import pathlib

import pytest

from megalite.plan.goodput import (Failures, daly_interval, inplace_goodput, monte_carlo, optimal_interval,
                                   plan_goodput, restart_goodput, young_interval)

# Llama 3 405B's pre-training: 419 unexpected interruptions in 54 days on 16,384 GPUs
LLAMA3 = Failures.from_hardware(16384, mtbf_hours=16384 * 54 * 24 / 419, save_s=30, load_s=60, restart_s=300,
                                heal_s=30, step_s=15, replica_groups=16)

_PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "plan.py"


def _plan_tool():
    spec = importlib.util.spec_from_file_location("plan_tool_goodput", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("interval", [100.0, 798.0, 3000.0])
def test_formulas_match_a_monte_carlo_failure_trace(interval):
    restart, inplace = monte_carlo(LLAMA3, interval, horizon_s=2000 * LLAMA3.job_mtbf_s, seed=7)
    assert abs(restart / restart_goodput(LLAMA3, interval) - 1) < 0.02, (restart, restart_goodput(LLAMA3, interval))
    assert abs(inplace / inplace_goodput(LLAMA3, interval) - 1) < 0.02


def test_a_slow_restart_is_what_in_place_recovery_saves():
    """Node MTBF, two failure rates: the in-place goodput beats restart-only, more so when failures are frequent."""
    for hours in (2000.0, 200.0):
        f = Failures.from_hardware(1024, mtbf_hours=hours, per="node", gpus_per_node=8, save_s=20, load_s=40,
                                   restart_s=600, heal_s=20, step_s=5, replica_groups=8)
        tau = optimal_interval(f)
        restart, inplace = monte_carlo(f, tau, horizon_s=2000 * f.job_mtbf_s, seed=3)
        assert abs(restart / restart_goodput(f, tau) - 1) < 0.02 and abs(inplace / inplace_goodput(f, tau) - 1) < 0.02
        assert inplace_goodput(f, tau) > restart_goodput(f, tau)
    assert f.job_mtbf_s == 200 * 3600 / 128


def test_young_daly_and_the_optimum():
    assert young_interval(LLAMA3) == pytest.approx(math.sqrt(2 * 30 * LLAMA3.job_mtbf_s))
    best = optimal_interval(LLAMA3)
    assert abs(daly_interval(LLAMA3) / best - 1) < 0.02  # Daly's expansion is close; Young a little longer
    for tau in (young_interval(LLAMA3), daly_interval(LLAMA3), 0.5 * best, 2 * best):
        assert restart_goodput(LLAMA3, tau) <= restart_goodput(LLAMA3, best) + 1e-12
    plan = plan_goodput(LLAMA3)
    assert plan.optimal_interval_s == pytest.approx(best) and 0.85 < plan.restart_goodput < plan.inplace_goodput < 1


def test_plan_goodput_cli(capsys):
    tool = _plan_tool()
    argv = ["--goodput", "--gpus", "16384", "--mtbf-hours", "50700", "--checkpoint-save-s", "30", "--checkpoint-load-s",
            "60", "--restart-s", "300", "--heal-s", "30", "--step-s", "15", "--tp", "8", "--pp", "16", "--dp", "128",
            "--dp-shard", "8"]
    assert tool.main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["replica_groups"] == 16 and out["gpus"] == 16384
    assert abs(out["monte_carlo"]["restart_goodput"] / out["restart_goodput"] - 1) < 0.02
    assert tool.main(["--goodput", "--gpus", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--goodput needs --mtbf-hours" in err[0]
