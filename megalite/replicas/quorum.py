"""Which replica groups take part in a step, agreed every step through a key-value store.

The blueprint's decision 16: replica groups fail alone. Before each step the live groups agree on
the step's members; after its reduction they agree on its outcome. The store (torch's TCPStore, held
by whoever launches the groups: it must outlive any one of them) is the arbiter, so two groups can
never see two different quorums for one step:

    quorum (step k, round r):  each member sets q/k/r/here/<g>, waits for the previous quorum's
        members (a group whose heartbeat stopped for dead_after_s is not waited for; a slow one that
        still beats is, up to timeout_s), then proposes {the groups present} + {the restarted groups waiting to
        join} with compare_set on q/k/r/decision: the first proposal wins, everyone reads it.
        A group absent from it (late, or restarted) joins through `join`.
    outcome (k, r):  after the step's cross-group reduction each member reports ok or failed; the
        outcome is "ok" only when every member reported ok (a dead one never does; compare_set again).
        "retry": the survivors run round r + 1 of the same step without the missing groups.

The outcome round closes the window where one survivor's all-reduce completed and another's failed
(a peer died half way): without it they would move to different steps and split into two runs.

    join (a restarted or excluded group):  set join/<g> = a fresh nonce (and its process's
        incarnation), wait for admit/<nonce>, which a quorum that included it writes (the key of its
        decision). The decision names a healer (the lowest member that was not joining) that sends it
        the live state at that step boundary.

A replica group of W ranks runs agree/join/finish on its rank 0 only; each of its ranks reports its own
outcome (its position's link), and a group is dead when any of its ranks' heartbeats stands still.

Only the store API (set, get, check, wait, compare_set) is used; nothing here imports torch.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Sequence

PREFIX = "megalite/ft/"


class QuorumLost(RuntimeError):
    """Fewer live replica groups than the run's minimum, or a restarted group nobody admitted."""


class RunFinished(RuntimeError):
    """The live groups trained the last step while this restarted group waited to join."""


class Excluded(RuntimeError):
    """This group was not in the step's decision (it arrived after the others decided): it must heal."""


@dataclass(frozen=True)
class Decision:
    """One step's quorum: the live replica groups (ascending), the restarted ones among them that first
    receive the live state, and the member that sends it."""

    step: int
    round: int
    members: tuple[int, ...]
    joiners: tuple[int, ...]
    incarnations: tuple[str, ...] = ()  # per member, the process's id (its heartbeat's key)

    @property
    def key(self) -> str:
        return f"{self.step}/{self.round}"

    @property
    def healer(self) -> int | None:
        healthy = [g for g in self.members if g not in self.joiners]
        return healthy[0] if healthy and self.joiners else None

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "round": self.round, "members": list(self.members),
                           "joiners": list(self.joiners), "incarnations": list(self.incarnations)})

    @staticmethod
    def from_json(text) -> "Decision":
        d = json.loads(text.decode() if isinstance(text, (bytes, bytearray)) else text)
        return Decision(d["step"], d["round"], tuple(d["members"]), tuple(d["joiners"]), tuple(d["incarnations"]))


class Quorum:
    """One replica group's side of the protocol (module docstring). `num_groups`: the run's replica groups
    (ids 0..num_groups-1); `min_groups`: with fewer live, a quorum waits up to `join_timeout_s` for
    restarted groups, then ends the run (QuorumLost)."""

    def __init__(self, store, *, group: int, num_groups: int, min_groups: int, timeout_s: float,
                 join_timeout_s: float = 60.0, dead_after_s: float = 1.0, positions: int = 1, position: int = 0,
                 incarnation: str | None = None):
        """positions: the ranks of every replica group (W); position: this rank's (its link and report). Only
        position 0 runs agree/join/finish; every position reports outcomes. incarnation: this start of the
        group, the same on its W ranks (fresh when None)."""
        if not 1 <= min_groups <= num_groups:
            raise ValueError(f"min_groups must be in [1, {num_groups}], got {min_groups}")
        self.store, self.group, self.num_groups = store, group, num_groups
        self.min_groups, self.timeout_s, self.join_timeout_s = min_groups, timeout_s, join_timeout_s
        self.dead_after_s, self.positions, self.position = dead_after_s, positions, position
        self.incarnation = incarnation or uuid.uuid4().hex  # this start's id: its heartbeats, its join request
        self.known: dict[int, str] = {}  # the last decision's members -> their incarnations
        self.dead: set[str] = set()  # incarnations found silent: the next wait does not wait for them again

    def _key(self, *parts) -> str:
        return PREFIX + "/".join(str(p) for p in parts)

    def _wait_for(self, keys: Sequence[str], seconds: float) -> bool:
        """Poll until every key exists (True) or `seconds` pass (False). Polled with check(), not the
        store's wait(): a timed-out wait is a normal event here, and torch logs each one as a warning."""
        deadline, pause = time.monotonic() + seconds, 0.0005
        while not self.store.check(list(keys)):
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
        return True

    def _wait_for_groups(self, keys: dict[tuple[int, int], str], cap_s: float, done_key: str | None = None,
                         arrived=lambda: ()) -> bool:
        """Poll until every (group, position)'s key exists (its group in `arrived()` counts), or `done_key`
        does (True); False as soon as every group still missing is dead — the heartbeat of one of its
        ranks (of the incarnation the last decision named) has not moved for dead_after_s: a group lives
        or dies whole, and a restarted process beats under another key — or after cap_s. A slow group
        whose ranks' heartbeats all move is waited for (up to cap_s); one not known yet too."""
        start = time.monotonic()
        last: dict[tuple[int, int], tuple[int, float]] = {}  # (group, position) -> (beat seen, when it moved)
        pause = 0.0005
        while True:
            if done_key is not None and self.store.check([done_key]):
                return True
            missing = sorted({g for (g, _), key in keys.items() if g not in arrived() and not self.store.check([key])})
            if not missing:
                return True
            now = time.monotonic()
            dead = [g for g in missing if self._silent(g, last, now)]
            if len(dead) == len(missing) or now - start > cap_s:
                self.dead.update(self.known[g] for g in dead if g in self.known)
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.01)

    def _silent(self, group: int, last: dict, now: float) -> bool:
        """Whether a rank of `group` (its known incarnation) has a heartbeat that stood still for dead_after_s."""
        if group not in self.known:
            return False
        if self.known[group] in self.dead:
            return True
        silent = False
        for p in range(self.positions):
            beat = self.store.add(beat_key(group, self.known[group], p), 0)
            if (group, p) not in last or last[group, p][0] != beat:
                last[group, p] = (beat, now)
            silent = silent or (beat > 0 and now - last[group, p][1] > self.dead_after_s)
        return silent

    def agree(self, step: int, round: int, expected: Sequence[int], wait_s: float | None = None, *,
              admit: bool = True) -> Decision:
        """This step's members: the groups of `expected` (the previous quorum) present within timeout_s
        (or `wait_s`: the first step waits for every group to build), this group, and the restarted
        groups waiting to join (not with admit=False: the training program's retry of a step half done,
        which a restarted group joins at the next step's boundary)."""
        here = lambda g: self._key("q", step, round, "here", g)  # noqa: E731
        self.store.set(here(self.group), self.incarnation)
        self._wait_for_groups({(g, 0): here(g) for g in expected}, self.timeout_s if wait_s is None else wait_s,
                              arrived=lambda: [g for g, _ in self._waiting_joiners()])
        present, joiners = self._live(here, admit)
        deadline, pause = time.monotonic() + self.join_timeout_s, 0.005
        while len(present) + len(joiners) < self.min_groups and time.monotonic() < deadline:
            time.sleep(pause)  # below the minimum: wait for restarted groups to ask to join
            pause = min(2 * pause, 0.1)
            present, joiners = self._live(here, admit)
        incarnations = {**{g: request.split(":")[1] for g, request in joiners},
                        **{g: self.store.get(here(g)).decode() for g in present}}
        members = tuple(sorted(incarnations))
        proposal = Decision(step, round, members, tuple(sorted(dict(joiners))), tuple(incarnations[g] for g in members))
        decided = Decision.from_json(self.store.compare_set(self._key("q", step, round, "decision"), "",
                                                            proposal.to_json()))
        for g, nonce in self._waiting_joiners():
            if g in decided.joiners:
                self.store.set(self._key("admit", nonce), decided.key)
        self.known = dict(zip(decided.members, decided.incarnations))
        if self.group not in decided.members:
            raise Excluded(f"replica group {self.group} missed the quorum of step {step} (round {round})")
        self._check_size(decided)
        return decided

    def _live(self, here, admit: bool = True) -> tuple[list[int], list[tuple[int, str]]]:
        """(groups present at this round, (group, incarnation) of the restarted ones asking to join)."""
        present = [g for g in range(self.num_groups) if self.store.check([here(g)])]
        return present, [(g, nonce) for g, nonce in self._waiting_joiners() if g not in present and admit]

    def _waiting_joiners(self) -> list[tuple[int, str]]:
        out = []
        for g in range(self.num_groups):
            key = self._key("join", g)
            if g != self.group and self.store.check([key]):
                nonce = self.store.get(key).decode()
                if not self.store.check([self._key("admit", nonce)]):
                    out.append((g, nonce))
        return out

    def _check_size(self, decision: Decision) -> None:
        if len(decision.members) < self.min_groups:
            raise QuorumLost(f"only {len(decision.members)} of {self.num_groups} replica groups are live at step "
                             f"{decision.step} (members {list(decision.members)}), fewer than --ft-min-groups "
                             f"{self.min_groups} after waiting {self.join_timeout_s:g} s for restarted groups; restart the run "
                             f"from its last checkpoint, or lower --ft-min-groups")

    def join(self, timeout_s: float) -> Decision:
        """A restarted group: ask to join; return the decision that admitted it (QuorumLost after timeout_s)."""
        nonce = f"{uuid.uuid4().hex}:{self.incarnation}"  # fresh per request: an excluded group asks again
        self.store.set(self._key("join", self.group), nonce)
        admitted, finished = self._key("admit", nonce), self._key("finished")
        deadline = time.monotonic() + timeout_s
        while not self._wait_for([admitted], 0.05):
            if self.store.check([finished]):
                raise RunFinished(f"replica group {self.group}: the run finished before it could rejoin")
            if time.monotonic() > deadline:
                raise QuorumLost(f"replica group {self.group} was not admitted by a live quorum within {timeout_s:g} "
                                 f"s (no healthy group left to heal from?); restart the run from its last checkpoint")
        step_round = self.store.get(admitted).decode()
        decision = Decision.from_json(self.store.get(self._key("q", step_round, "decision")))
        self.known = dict(zip(decision.members, decision.incarnations))
        self._check_size(decision)
        return decision

    def finish(self) -> None:
        """A member trained the last step: restarted groups still waiting to join stop waiting."""
        self.store.set(self._key("finished"), "1")

    def failed_already(self, decision: Decision, phase: str = "reduction") -> bool:
        """Whether another member already settled `decision`'s outcome (it does so at once on a failure)."""
        return self.store.check([self._key("q", decision.key, phase, "outcome")])

    def outcome(self, decision: Decision, ok: bool, phase: str = "reduction") -> bool:
        """Report this rank's link collective of `phase` ("heal" or "reduction"); True when every rank of
        every member of `decision` reported ok within timeout_s."""
        final = self._key("q", decision.key, phase, "outcome")
        self.store.set(self._key("q", decision.key, phase, "report", self.group, self.position), "ok" if ok else "failed")
        if ok:
            ok = self._all_reported_ok(decision, final, phase)
        return self.store.compare_set(final, "", "ok" if ok else "retry") == b"ok"

    def _all_reported_ok(self, decision: Decision, final: str, phase: str) -> bool:
        """Every rank of every member reported ok (or the outcome is already decided: compare_set then
        returns it); False when a member died before reporting, or a report is missing after timeout_s."""
        reports = {(g, p): self._key("q", decision.key, phase, "report", g, p)
                   for g in decision.members for p in range(self.positions)}
        if not self._wait_for_groups(reports, self.timeout_s, done_key=final):
            return False
        if self.store.check([final]):
            return True
        return all(v == b"ok" for v in self.store.multi_get(list(reports.values())))


def beat_key(group: int, incarnation: str, position: int = 0) -> str:
    """The counter rank `position` of a replica group's start `incarnation` adds 1 to from its heartbeat
    thread (membership.Heartbeat) every dead_after_s / 5 seconds: a SIGKILLed process's stops moving."""
    return f"{PREFIX}beat/{group}/{incarnation}/{position}"
