"""The off-policy ratio controller: how stale may a sample be, and what happens when it is too stale.

Three decisions, all pure logic (no torch, no engines):
1. *Admission* (AReaL's rule): with weight version v in the engines, batch size B (groups) and max
   staleness η, a new group may start only while ``started_groups < (η + v + 1) * B``. Each batch the
   trainer consumes was therefore started at most η versions before it is trained on. η = 0 is
   synchronous RL: the engines produce exactly the next batch, then wait for the new weights. With ``max_groups`` (the
   run's budget, steps × B) no group starts that the run would never train: without it the last η
   batches' worth of generation is thrown away when the run ends.
2. *Acceptance* at batch time: a group whose oldest trainable token is more than η versions behind is
   `drop`ped (counted, its tokens reported as discarded) or `keep`t (trained with importance correction).
   The buffer applies it as `min_version`, one integer compare per queued group.
3. *Composition*: at most ``max_offpolicy_fraction`` of a batch's groups may contain tokens from older
   versions; the excess goes back to the buffer to wait for a later batch.
Every decision is counted so the run can log it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from ..config import ControllerConfig
from ..types import Group
from .waiters import Waiters


@dataclass
class ControllerStats:
    admitted: int = 0
    dropped_stale: int = 0
    dropped_tokens: int = 0
    kept_stale: int = 0
    deferred_offpolicy: int = 0
    decisions: list[str] = field(default_factory=list)  # human-readable log, drained per step

    def note(self, msg: str) -> None:
        self.decisions.append(msg)
        if len(self.decisions) > 200:
            del self.decisions[:100]


class StalenessController:
    def __init__(self, cfg: ControllerConfig, *, batch_groups: int, max_groups: int | None = None) -> None:
        """`batch_groups`: groups per trainer step; `max_groups`: groups the trainer will ever take
        (the run's budget), None = no end."""
        self.cfg = cfg
        self.batch_groups = batch_groups
        self.max_staleness = cfg.max_staleness
        self.max_groups = max_groups
        self.version = 0  # the trainer's: staleness, deadlines and batches are counted against it
        # The weights the engines hold: admission counts against it, and a group admitted now gets it as
        # its admission version. It trails `version` while a step's weights are being pushed.
        self.engine_version = 0
        self.started = 0  # groups ever admitted (AReaL's accepted + running)
        self.running = 0
        self.returned = 0  # groups dropped after admission: their slot is given back
        self.stats = ControllerStats()
        self._inflight: Counter[int] = Counter()  # admitted version -> groups still generating
        self._pending: Counter[int] = Counter()  # admitted version -> groups admitted, not yet trained
        self._changed = Waiters()  # woken on every change that may let admission or a batch go on
        self._offpolicy_placed: dict[int, int] = {}  # deterministic: trainer version -> off-policy groups placed

    # ---- admission -------------------------------------------------------------------------------
    def capacity(self) -> int:
        """How many more groups may start now."""
        limit = (self.max_staleness + self.engine_version + 1) * self.batch_groups
        if self.max_groups is not None:
            limit = min(limit, self.max_groups)  # the run's budget is a ceiling on the same count
        free = limit - (self.started - self.returned)
        if self.cfg.max_concurrent_groups is not None:
            free = min(free, self.cfg.max_concurrent_groups - self.running)
        return max(0, free)

    async def acquire(self) -> int:
        """Wait for room for one group; returns the version at admission."""
        while self.capacity() <= 0:
            await self._changed.wait()
        self.started += 1
        self.running += 1
        self.stats.admitted += 1
        self._inflight[self.engine_version] += 1
        self._pending[self.engine_version] += 1
        return self.engine_version

    def release(self, admitted_version: int, *, returned: bool = False) -> None:
        """A group finished generating (returned=True: it was thrown away and its slot is free again)."""
        self.running -= 1
        self._inflight[admitted_version] -= 1
        if self._inflight[admitted_version] <= 0:
            del self._inflight[admitted_version]
        if returned:
            self.returned += 1
            self._forget(admitted_version)
        self._changed.wake()

    def must_wait_for(self, room: int | None = None) -> int:
        """How many more groups must finish before the next batch's remaining `room` places (default:
        the whole batch) may be filled (0: take them now).

        A group admitted at version a must be trained at trainer version a + max_staleness at the
        latest. The batch taken now (version v) is followed by one batch per version, so for every
        j >= 0 the groups admitted at <= v - max_staleness + j and not yet trained, U(j), must fit in
        this batch and the j after it: this batch must hold at least ``U(j) - j * B`` of them. The
        buffer pops by admission version, so it holds that many once that many have finished.
        Waiting only for the groups due now is not enough: while long old groups are still
        generating, the trainer would fill its batches with newer short ones and find more old groups
        due at once than one batch can hold (seen with a long-tail task once the trainer got fast).
        """
        if not self._pending:
            return 0
        b, first = self.batch_groups, self.version - self.max_staleness
        room = b if room is None else room
        worst = due = generating = 0
        for a in range(min(self._pending), max(self._pending) + 1):
            due += self._pending.get(a, 0)
            generating += self._inflight.get(a, 0)
            j = a - first
            if j < 0:
                continue  # groups already past due: they are in this batch's count at j = 0
            need = min(room, due - j * b)
            worst = max(worst, need - (due - generating))
        return max(0, worst)

    def takeable(self, room: int) -> int:
        """How many of the next batch's `room` remaining places may be filled now, from the oldest
        finished groups, without stranding a group that is still generating past its deadline.

        Taking k <= room - must_wait_for(room) of the oldest leaves, for every j, room - k places for
        the U(j) - j * B - (finished ones) that must still come: the same bound as waiting, so the
        trainer can start on part of a batch while its overdue groups finish (`batches.next_batch`).
        """
        return room - self.must_wait_for(room)

    async def wait_takeable(self, room: int) -> int:
        """Wait until part of the next batch's `room` places may be filled; returns how many."""
        while (k := self.takeable(room)) <= 0:
            await self._changed.wait()
        return k

    def consumed(self, groups: list[Group]) -> None:
        """The trainer took these groups: they no longer count against future batches."""
        for g in groups:
            self._forget(g.admitted_version)
        self._changed.wake()

    def _forget(self, admitted_version: int) -> None:
        if self._pending.get(admitted_version, 0) > 1:
            self._pending[admitted_version] -= 1
        else:
            self._pending.pop(admitted_version, None)  # also groups restored from a checkpoint

    def restore(self, *, version: int, trained_groups: int, queued: list[Group], generating: list[Group]) -> None:
        """Continue a run from a checkpoint: the trainer at `version` has trained `trained_groups`
        groups; `queued` wait in the buffer, `generating` are still being generated. They keep their
        admission versions, so their deadlines (admitted + max_staleness) are the ones they had."""
        self.version = self.engine_version = version
        self.started = trained_groups + len(queued) + len(generating)
        self.returned = 0
        self.running = len(generating)
        self.stats.admitted = self.started
        self._pending = Counter(g.admitted_version for g in [*queued, *generating])
        self._inflight = Counter(g.admitted_version for g in generating)

    def set_version(self, version: int) -> None:
        """Trainer and engines are both at `version` (the step's weights have reached the engines)."""
        self.version = self.engine_version = version
        self._changed.wake()

    def trainer_stepped(self, version: int) -> None:
        """The trainer is at `version`, its weights not yet in the engines: the next batch is composed
        against it, while admission keeps counting against the engines' version until `set_version`.

        Why the split: the run loop pushes a step's weights while the trainer already computes on the
        next batch's finished groups. Admitting against the new version before the engines hold it
        would start groups whose first tokens come from the old weights, one version older than
        their admission version, and so one version past η by their deadline.
        """
        self.version = version
        self._changed.wake()

    # ---- acceptance and composition --------------------------------------------------------------
    def staleness(self, group: Group) -> int:
        return self.version - group.oldest_version()

    def min_version(self) -> int | None:
        """The oldest token version a batch may take now: older groups are beyond max_staleness and
        dropped (the buffer hands each to `dropped`, once). None under `keep`: every group is taken."""
        return None if self.cfg.stale_policy == "keep" else self.version - self.max_staleness

    def dropped(self, group: Group) -> None:
        """The buffer dropped a group `accept` turned away: count it, and give its admission slot back
        so a fresh group replaces it for the batch it was meant for."""
        self._drop(group, f"staleness {self.staleness(group)} > {self.max_staleness}")

    def compose(self, groups: list[Group], *, offpolicy_taken: int = 0) -> tuple[list[Group], int]:
        """Keep at most floor(max_offpolicy_fraction * batch_groups) off-policy groups in a batch.

        Excess off-policy groups are dropped (counted like stale drops) and their admission slots given
        back, so fresh on-policy groups can replace them; deferring them instead could deadlock the
        trainer behind groups that only get staler. Each group passes here once, so a stale group kept
        by policy `keep` is counted here. Returns (kept groups, off-policy count in them).
        """
        allowed = math.floor(self.cfg.max_offpolicy_fraction * self.batch_groups + 1e-9)
        kept, offp = [], offpolicy_taken
        for g in groups:
            if self.staleness(g) > 0:
                if offp >= allowed:
                    self.stats.dropped_stale += 1
                    self.stats.dropped_tokens += g.num_tokens
                    self.stats.deferred_offpolicy += 1
                    self.returned += 1
                    self._forget(g.admitted_version)
                    self.stats.note(f"drop {g.group_id}: off-policy fraction cap {self.cfg.max_offpolicy_fraction}")
                    self._changed.wake()
                    continue
                offp += 1
            if (s := self.staleness(g)) > self.max_staleness:
                self.stats.kept_stale += 1
                self.stats.note(f"keep {g.group_id}: staleness {s} > {self.max_staleness}")
            kept.append(g)
        return kept, offp

    def assign(self, group: Group, *, version: int) -> bool:
        """`controller.deterministic`: judge a finished group now, for the batch the trainer will take
        at `version`, by the rules `min_version` and `compose` apply at batch time in a free run (a
        placed group is trained in that batch, so the answer cannot change). False: dropped, its
        slot given back."""
        stale = version - group.oldest_version()
        if stale > self.max_staleness and self.cfg.stale_policy == "drop":
            return self._drop(group, f"staleness {stale} > {self.max_staleness}")
        if stale > 0:
            allowed = math.floor(self.cfg.max_offpolicy_fraction * self.batch_groups + 1e-9)
            if self._offpolicy_placed.get(version, 0) >= allowed:
                self.stats.deferred_offpolicy += 1
                return self._drop(group, f"off-policy fraction cap {self.cfg.max_offpolicy_fraction}")
            self._offpolicy_placed[version] = self._offpolicy_placed.get(version, 0) + 1
        if stale > self.max_staleness:
            self.stats.kept_stale += 1
            self.stats.note(f"keep {group.group_id}: staleness {stale} > {self.max_staleness}")
        return True

    def _drop(self, group: Group, why: str) -> bool:
        self.stats.dropped_stale += 1
        self.stats.dropped_tokens += group.num_tokens
        self.stats.note(f"drop {group.group_id}: {why}")
        self._forget(group.admitted_version)
        self.returned += 1
        self._changed.wake()
        return False

    def drain_decisions(self) -> list[str]:
        out, self.stats.decisions = self.stats.decisions, []
        return out
