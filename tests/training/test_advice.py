"""Advice from measured step times: printed once when it applies, naming the fix; silent otherwise."""
import torch
import torch.nn.functional as F
from torch import nn

from megalite.pipeline import Pipeline
from megalite.testing import run_distributed
from megalite.training.advice import Advisor

HIDDEN, SEQ, MICRO = 256, 32, 2  # linears of ~1 ms dominate the loss and the Python per layer: equal stages


def test_exposed_dp_advice_once_after_warmup():
    printed = []
    advisor = Advisor(print_fn=printed.append)
    assert advisor.observe(step_s=1.0, exposed_dp_comm_s=0.9) == []  # the warm-up step is not judged
    assert advisor.observe(step_s=1.0, exposed_dp_comm_s=0.1) == []
    given = advisor.observe(step_s=1.0, exposed_dp_comm_s=0.5)  # 0.6 of 2.0 s: 30%
    assert len(given) == 1 and "30%" in given[0] and "bf16 reduction" in given[0] and "PowerSGD" in given[0]
    assert advisor.observe(step_s=1.0, exposed_dp_comm_s=0.9) == [] and printed == given  # once only
    alone = Advisor(print_fn=None)  # one replica: nothing to reduce, whatever the wrapper's timer says
    assert [alone.observe(step_s=1.0, exposed_dp_comm_s=0.9, dp=1) for _ in range(3)] == [[], [], []]


def test_replay_gives_the_known_bubbles():
    from megalite.pipeline import build_schedule
    from megalite.pipeline.replay import replay_bubble

    equal = [{"FWD": 1.0, "BWD": 2.0}] * 4
    assert abs(replay_bubble(build_schedule("1f1b", 4, 8), 4, 1, equal) - 3 / 11) < 1e-12  # (pp-1)/(m+pp-1)
    halves = [{"FWD": 0.5, "BWD": 1.0}] * 4  # v = 2 chunks of half the work each
    assert replay_bubble(build_schedule("interleaved", 4, 8, 2), 4, 2, halves) < 0.6 * 3 / 11
    slow_last = [{"FWD": 1.0, "BWD": 2.0}] * 3 + [{"FWD": 3.0, "BWD": 6.0}]  # an unbalanced split idles the rest
    assert replay_bubble(build_schedule("1f1b", 4, 8), 4, 1, slow_last) > 0.5


def _measure(num_microbatches: int, steps: int = 2) -> list[dict]:
    """pp = 2 stages under 1F1B: each step's measured stats (step seconds, replayed bubble fraction)."""
    from megalite.distributed.mesh import init_mesh

    mesh = init_mesh(pp=2)
    torch.manual_seed(0)
    stages = [nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(4)]) for _ in range(2)]
    pipe = Pipeline(stages, mesh, lambda y, target: F.mse_loss(y, target, reduction="sum"),
                    num_microbatches=num_microbatches, activation_shape=(SEQ, MICRO, HIDDEN))
    data = [(torch.randn(SEQ, MICRO, HIDDEN), torch.randn(SEQ, MICRO, HIDDEN)) for _ in range(num_microbatches)]
    measured = []
    for _ in range(steps):
        stats = {}
        pipe.step(data, stats=stats, measure_bubble=True)
        measured.append({"step_s": stats["step_s"], "bubble_fraction": stats["bubble_fraction"]})
    return measured


def test_the_pipeline_measures_a_bubble_the_advisor_reads():
    """The plumbing: Pipeline.step(measure_bubble=True) hands the advisor a fraction of a real step. Its
    value depends on the machine's timings (a loaded machine skews the stages), so it is not compared."""
    for per_step in run_distributed(_measure, 2, 2):
        for stats in per_step:
            assert stats["step_s"] > 0 and 0.0 <= stats["bubble_fraction"] < 1.0, stats


def test_bubble_advice_fires_on_few_microbatches_and_not_on_many():
    """The decision, on the bubbles the schedule gives equal stages: 1F1B's (pp-1)/(m+pp-1) replayed."""
    from megalite.pipeline import build_schedule
    from megalite.pipeline.replay import replay_bubble

    equal = [{"FWD": 1.0, "BWD": 2.0}] * 2
    given = {}
    for m in (2, 16):  # 1/3 and 1/17 of the step
        advisor = Advisor(print_fn=None)
        bubble = replay_bubble(build_schedule("1f1b", 2, m), 2, 1, equal)
        for _ in range(2):
            advisor.observe(step_s=1.0, pipeline_bubble=bubble, pp=2)
        given[m] = advisor.given
    assert len(given[2]) == 1 and "increase microbatches or interleave" in given[2][0], given
    assert given[16] == [], given
