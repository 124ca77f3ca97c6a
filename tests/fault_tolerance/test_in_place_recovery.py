"""Recovery without a restart (megalite/fault_tolerance/): replica groups SIGKILLed mid-step, on gloo.

Each run's records are checked against the one-process reference that drops the same samples at the
same steps (reference.py): training never stops (every step has a record), every member of a step
logs the same loss and the same parameter bytes (so a healed group equals the others bit for bit at
its first step), the losses equal the reference's — exactly, parameters included, with two groups
(a + b is b + a); to 1e-5 with three (gloo's ring orders each chunk's sum) — and the dropped samples
and heals are the ones the faults imply.
"""
import os
import signal

import pytest
import torch

from megalite.fault_tolerance.launcher import Launcher, PlannedFault
from megalite.fault_tolerance.reference import verify
from megalite.fault_tolerance.settings import FaultTolerantRun


def _drill(tmp_path, *, groups, steps, faults, restart_delay_s=1.5, restart=True, raw_faults=False, **kw):
    """restart_delay_s 1.5 > dead_after_s 1: a killed group is declared dead (its samples dropped) before
    its restart asks to join; steps of ~0.2 s let it rejoin within ~10 steps."""
    torch.set_num_threads(1)  # as in the groups' processes: the reference's matmuls then sum alike
    kw = {"join_timeout_s": 20.0, "step_pause_s": 0.15, **kw}
    run = FaultTolerantRun(groups=groups, steps=steps, log_dir=str(tmp_path), timeout_s=30.0, dead_after_s=1.0, **kw)
    launcher = Launcher(run, restart_delay_s=restart_delay_s)
    if not raw_faults:
        faults = {g: [PlannedFault(*f) for f in fs] for g, fs in faults.items()}
    exits = launcher.supervise(faults=faults,
                               timeout_s=240, restart=restart)
    return run, launcher, exits


@pytest.mark.slow  # ~10 s of wall time (a restart delay, steps of stand-in compute); the quorum's quick tests stay
def test_two_groups_one_killed_mid_reduction_equal_the_reference_bit_for_bit(tmp_path):
    run, launcher, exits = _drill(tmp_path, groups=2, steps=12, faults={1: [(1, "mid-reduction")]})
    verdict = verify(run, launcher.records())
    assert exits == {0: 0, 1: 0} and len(launcher.kills) == 1
    assert verdict.steps == 12 and verdict.dropped[1] == (1,)
    assert [g for _, g in verdict.heals] == [1] and verdict.heals[0][0] not in verdict.dropped
    assert verdict.members_agree and verdict.losses_bitwise and verdict.params_bitwise


@pytest.mark.slow
def test_a_group_restarted_within_the_step_rejoins_it_and_nothing_is_dropped(tmp_path):
    run, launcher, exits = _drill(tmp_path, groups=2, steps=8, faults={1: [(2, "reduction")]}, restart_delay_s=0.2)
    verdict = verify(run, launcher.records())
    assert exits == {0: 0, 1: 0} and len(launcher.kills) == 1
    assert verdict.dropped == {} and verdict.heals == [(2, 1)]  # healed, then step 2 with both groups' samples
    assert verdict.members_agree and verdict.losses_bitwise and verdict.params_bitwise


@pytest.mark.slow
def test_two_groups_killed_at_three_moments_over_44_steps_equal_the_reference_bit_for_bit(tmp_path):
    faults = {0: [(27, "update")], 1: [(3, "forward"), (15, "reduction")]}
    run, launcher, exits = _drill(tmp_path, groups=2, steps=44, faults=faults)
    verdict = verify(run, launcher.records())
    assert exits == {0: 0, 1: 0} and len(launcher.kills) == 3 and verdict.steps == 44
    assert verdict.dropped[3] == verdict.dropped[15] == (1,) and 27 not in verdict.dropped  # killed after the outcome
    assert verdict.dropped[28] == (0,)  # group 0 (the healer until then) gone: group 1 heals it
    assert [g for _, g in verdict.heals] == [1, 1, 0]
    assert verdict.members_agree and verdict.losses_bitwise and verdict.params_bitwise


@pytest.mark.slow
def test_three_groups_lose_one_at_a_time_and_the_losses_equal_the_reference(tmp_path):
    faults = {0: [(16, "mid-reduction")], 1: [(4, "forward")], 2: [(28, "update")]}
    run, launcher, exits = _drill(tmp_path, groups=3, steps=44, faults=faults)
    verdict = verify(run, launcher.records())
    assert exits == {0: 0, 1: 0, 2: 0} and len(launcher.kills) == 3 and verdict.steps == 44
    assert verdict.dropped[4] == (1,) and verdict.dropped[16] == (0,) and verdict.dropped[29] == (2,)
    assert [g for _, g in verdict.heals] == [1, 0, 2] and verdict.members_agree
    assert verdict.max_loss_rel_diff <= 1e-5  # the parity tolerance (measured ~5e-8 here)


@pytest.mark.slow  # ~15 s: 4 ranks, two restarts
def test_groups_of_two_ranks_lose_a_rank_and_equal_the_reference_bit_for_bit(tmp_path):
    """Each group its own world of 2 ranks (ZeRO 1 over them), one link per shard position: rank 1 of group
    1 killed with the all-reduce in flight, later rank 0 of group 0 (the healer until then) in its forward.
    The killed rank's sibling leaves on its own (its collective inside the group fails: one line, exit 1, no hang), the
    group restarts whole and heals position by position; every rank equals the 2-rank reference bit for bit."""
    faults = {0: [(14, "forward", 0)], 1: [(2, "mid-reduction", 1)]}
    run, launcher, exits = _drill(tmp_path, groups=2, steps=24, faults=faults, ranks_per_group=2)
    verdict = verify(run, launcher.records())
    assert exits == {0: 0, 1: 0} and [g for _, g in launcher.kills] == [1, 0]
    assert launcher.left == [(1, 0, 1), (0, 1, 1)]  # each killed rank's sibling left on its own
    assert verdict.steps == 24 and verdict.dropped[2] == (1,) and verdict.dropped[14] == (0,)
    assert [g for _, g in verdict.heals] == [1, 0] and {r["rank"] for r in launcher.records()} == {0, 1}
    assert verdict.members_agree and verdict.losses_bitwise and verdict.params_bitwise


class _AtItsFirstHeal:
    """SIGKILL this group with its first heal's broadcast in flight (whatever the step)."""

    def __call__(self, step, moment):
        if moment == "mid-heal":
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow  # ~15 s: 3 groups, two restarts
def test_a_group_dying_during_its_heal_costs_the_others_seconds_and_nothing_is_lost(tmp_path):
    """Group 1 dies in a forward, restarts, and dies again with group 0's heal broadcast in flight: group 0
    and the bystander group 2 retry the step within seconds (here gloo fails the broadcast at once for
    both, with or without the heal's poll: test_quorum proves the poll itself), group 1 restarts again and
    heals, and the losses equal the reference."""
    faults = {1: [PlannedFault(2, "forward"), _AtItsFirstHeal()]}
    run, launcher, exits = _drill(tmp_path, groups=3, steps=36, faults=faults, raw_faults=True)
    verdict = verify(run, launcher.records())
    assert exits == {0: 0, 1: 0, 2: 0} and [g for _, g in launcher.kills] == [1, 1] and verdict.steps == 36
    assert [g for _, g in verdict.heals] == [1] and verdict.members_agree and verdict.max_loss_rel_diff <= 1e-5
    failed = [r for r in launcher.records() if r["group"] != 1 and r["heal_s"] > 0 and r["rounds"] > 1]
    assert failed and max(r["step_s"] for r in failed) < 10, [(r["step"], r["step_s"]) for r in failed]


@pytest.mark.slow
def test_a_quorum_below_the_minimum_ends_every_group_in_one_line(tmp_path, capfd):
    run, launcher, exits = _drill(tmp_path, groups=2, steps=8, faults={1: [(2, "reduction")]}, restart_delay_s=0,
                                  restart=False, min_groups=2, join_timeout_s=3.0)
    assert exits == {0: 1, 1: -9}
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("megalite:")]
    assert lines == [f"megalite: only 1 of 2 replica groups are live at step 2 (members [0]), fewer than "
                     f"--ft-min-groups 2 after waiting 3 s for restarted groups; restart the run from its last "
                     f"checkpoint, or lower --ft-min-groups"]
