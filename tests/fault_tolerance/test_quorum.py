"""The per-step quorum (megalite/replicas/quorum.py) on a real TCPStore, its members as threads.

Each case is what a replica group sees: everyone present; a group absent past the timeout (dropped,
and refused if it arrives late); an outcome some member did not report (retry for all); a restarted
group admitted by the next quorum with a healer named; a quorum below the minimum ending in one line.
"""
import datetime
import threading
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megalite.errors import UsageError
from megalite.replicas.quorum import PREFIX, Decision, Excluded, Quorum, QuorumLost, beat_key
from megalite.fault_tolerance.replica_group import ReplicaGroup
from megalite.fault_tolerance.settings import FaultTolerantRun, check_run
from megalite.testing import free_port


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def _quorum(store, group, groups=3, **kw):
    kw = {"min_groups": 1, "timeout_s": 0.3, "join_timeout_s": 0.3, **kw}
    return Quorum(store, group=group, num_groups=groups, **kw)


def _together(calls):
    """Run each call on its own thread; return their results (an exception is returned, not raised)."""
    results = [None] * len(calls)

    def run(i, call):
        try:
            results[i] = call()
        except Exception as error:  # noqa: BLE001 - the test reads it
            results[i] = error
    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return results


def test_every_group_present_agrees_at_once_and_the_outcome_is_ok(store):
    groups = [_quorum(store, g, timeout_s=10) for g in range(3)]
    decisions = _together([lambda q=q: q.agree(0, 0, range(3)) for q in groups])
    assert {d.members for d in decisions} == {(0, 1, 2)} and decisions[0].joiners == ()
    assert _together([lambda q=q, d=d: q.outcome(d, True) for q, d in zip(groups, decisions)]) == [True] * 3


def test_an_absent_group_is_dropped_after_the_timeout_and_refused_when_late(store):
    groups = [_quorum(store, g) for g in range(3)]
    decisions = _together([lambda q=q: q.agree(4, 0, range(3)) for q in groups[:2]])
    assert {d.members for d in decisions} == {(0, 1)}
    with pytest.raises(Excluded, match="replica group 2 missed the quorum of step 4"):
        groups[2].agree(4, 0, range(3))


def test_a_slow_group_that_beats_is_waited_for_and_a_silent_one_is_not(store):
    groups = [_quorum(store, g, timeout_s=10, dead_after_s=0.3) for g in range(3)]
    for q in groups:
        q.known = {g: other.incarnation for g, other in enumerate(groups)}  # the last decision's members
    store.add(beat_key(2, groups[2].incarnation), 1)  # group 2 was alive once, then went silent (SIGKILL)

    def slow_group_1():
        for _ in range(10):  # 1 s of beats before it arrives: three times dead_after_s
            store.add(beat_key(1, groups[1].incarnation), 1)
            time.sleep(0.1)
        return groups[1].agree(5, 0, range(3))
    started = time.monotonic()
    decisions = _together([lambda: groups[0].agree(5, 0, range(3)), slow_group_1])
    assert {d.members for d in decisions} == {(0, 1)} and time.monotonic() - started < 5


def test_a_member_that_never_reports_makes_every_survivor_retry(store):
    groups = [_quorum(store, g, timeout_s=10) for g in range(3)]
    decision = _together([lambda q=q: q.agree(0, 0, range(3)) for q in groups])[0]
    groups[0].timeout_s = groups[1].timeout_s = 0.3
    # group 1's reduction completed, group 0's failed, group 2 died: nobody may apply the step
    assert _together([lambda: groups[0].outcome(decision, False), lambda: groups[1].outcome(decision, True)]) == \
        [False, False]
    again = _together([lambda q=q: q.agree(0, 1, decision.members) for q in groups[:2]])
    assert {d.members for d in again} == {(0, 1)} and again[0].round == 1


def test_a_group_of_two_ranks_is_ok_only_when_both_ranks_reported_and_a_silent_rank_kills_it(store):
    """W = 2: every rank reports its own link's reduction; group 1's rank 1 was killed (its heartbeat stands
    still), so group 1 is dead as a whole and the step retries for every rank, its rank 0 included."""
    ranks = {(g, p): _quorum(store, g, groups=2, timeout_s=10, dead_after_s=0.3, positions=2, position=p,
                             incarnation=f"start{g}") for g in range(2) for p in range(2)}
    for q in ranks.values():
        q.known = {0: "start0", 1: "start1"}
    store.add(beat_key(1, "start1", 1), 1)  # group 1's rank 1 beat once, then died
    decision = Decision(3, 0, (0, 1), ())

    def beating(key):  # the live ranks' heartbeats, while the outcome is waited for
        for _ in range(7):
            store.add(key, 1)
            time.sleep(0.1)
    started = time.monotonic()
    calls = [lambda q=q: q.outcome(decision, True) for (g, p), q in ranks.items() if (g, p) != (1, 1)]
    calls += [lambda g=g, p=p: beating(beat_key(g, f"start{g}", p)) for g, p in ((0, 0), (0, 1), (1, 0))]
    assert _together(calls)[:3] == [False, False, False] and time.monotonic() - started < 5
    assert store.get(PREFIX + "q/3/0/reduction/outcome") == b"retry"


class _NeverDone:
    """An in-flight collective whose peer abandoned it: it never completes."""

    def is_completed(self):
        return False


def test_a_heal_in_flight_is_given_up_once_its_own_outcome_is_settled_not_the_reductions(store):
    """The heal's broadcast is polled like the reduction's all-reduce: a member that failed its heal settles
    the heal's outcome, and a member still waiting gives its broadcast up at once (not after the link's
    timeout); a settled reduction outcome (another phase) does not end a heal."""
    waiting, failed = _quorum(store, 0, groups=2), _quorum(store, 1, groups=2)
    member = SimpleNamespace(quorum=waiting)
    decision = Decision(6, 0, (0, 1), (1,))
    failed.outcome(decision, False)  # the reduction's outcome: not the heal's
    started = time.monotonic()

    def heal_wait():
        try:
            ReplicaGroup._wait_or_give_up(member, _NeverDone(), decision, "heal")
        except RuntimeError as error:
            return error, time.monotonic() - started
    result = _together([heal_wait, lambda: (time.sleep(0.3), failed.outcome(decision, False, phase="heal"))])
    error, seconds = result[0]
    assert "another member's heal failed" in str(error) and 0.3 <= seconds < 2
    assert store.get(PREFIX + "q/6/0/heal/outcome") == b"retry"


def test_a_restarted_group_is_admitted_by_the_next_quorum_with_a_healer(store):
    groups = [_quorum(store, g, join_timeout_s=10) for g in range(3)]
    def agree_once_group_2_asked(q):
        while not store.check([PREFIX + "join/2"]):  # the live groups reach step 7 after the request
            time.sleep(0.01)
        return q.agree(7, 0, (0, 1))
    *decisions, admitted = _together([lambda q=q: agree_once_group_2_asked(q) for q in groups[:2]] +
                                     [lambda: groups[2].join(10)])
    assert admitted == decisions[0] == decisions[1]
    assert admitted.members == (0, 1, 2) and admitted.joiners == (2,) and admitted.healer == 0 and admitted.step == 7


def test_below_the_minimum_the_quorum_waits_for_joiners_then_ends_in_one_line(store):
    lone = _quorum(store, 0, groups=2, min_groups=2)
    with pytest.raises(QuorumLost) as lost:
        lone.agree(3, 1, (0, 1))
    assert "only 1 of 2 replica groups are live at step 3" in str(lost.value) and "\n" not in str(lost.value)
    waiting = _quorum(store, 1, groups=2, min_groups=2, join_timeout_s=10)
    lone.join_timeout_s = 10
    decision, admitted = _together([lambda: lone.agree(4, 0, (0, 1)), lambda: waiting.join(10)])
    assert decision == admitted and decision.members == (0, 1) and decision.healer == 0
    with pytest.raises(QuorumLost, match="was not admitted by a live quorum within 0.2 s"):
        _quorum(store, 1, groups=2).join(0.2)


@pytest.mark.parametrize("kw, needle", [(dict(min_groups=3), "--ft-min-groups 3 must be in [1, 2]"),
                                        (dict(min_groups=0), "--ft-min-groups 0 must be in [1, 2]"),
                                        (dict(zero=3), "--zero 3: in-place recovery covers ZeRO 0 and 1")])
def test_what_the_run_cannot_do_is_one_line(kw, needle):
    with pytest.raises(UsageError) as refused:
        check_run(FaultTolerantRun(groups=2, steps=4, **kw))
    assert needle in str(refused.value) and "\n" not in str(refused.value)
