"""How the rollout side is scheduled: a strategy the manager is given.

`FreeRunning` (the default): groups, requests and weight pushes go as they come, in wall-clock order.

`Lockstep` (`controller.deterministic`): an async run whose every scheduling decision follows logical
events instead of wall time, so two runs of one config and seed are the same run.

What varies with wall time in a free-running async run, and what decides it here instead:

- *What an engine step holds.* The engine steps only when the rollout side is settled: every group
  task is waiting for the engine (`busy == 0`) and admission has no room left. The requests waiting
  then are admitted in request-id order, not arrival order (`Scheduler.order_key`).
- *When weights land.* The trainer's weights for version v land when the batch after batch v is
  complete (the engine waits for them if the trainer is late, they wait for the engine if it is
  early), or at once when the engine has run out of work. Samples in flight then are interrupted and
  resume with the new weights, as in a free run.
- *Which groups form a batch.* A finished group is placed in its batch when it finishes, in admission
  order among the groups that finished in the same engine step, and the trainer takes whole batches in
  that order; the staleness and off-policy rules judge it against that batch's trainer version
  (`StalenessController.assign`), not against wherever the trainer happens to be.
- *What a metrics row counts.* The rollout counters of step v's row are read at the moment its weights
  land.

What it costs: the engine cannot run ahead more than one batch of a slow trainer, and the trainer
takes each batch whole (no computing on its first groups while the last ones generate).
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from ..buffer import RolloutBuffer, StalenessController
from ..buffer.waiters import Waiters
from ..types import Group

if TYPE_CHECKING:
    from ..engine import TorchEngine
    from .pools import EnginePool

Counters = Callable[[], dict[str, Any]]


class FreeRunning:
    """Every decision in wall-clock order. The manager calls the same hooks on every strategy: the
    admission and engine-wait hooks do nothing here."""

    wall_clock = True  # samples carry their groups' wall-clock timings
    whole_batches = False  # the trainer computes a batch's groups as they may be trained

    def __init__(self, *, buffer: RolloutBuffer, pool: EnginePool, seed: int = 0) -> None:
        self.buffer, self.pool = buffer, pool
        self.next_seed = seed * 1_000_003  # one per episode: a checkpoint holds where it stands

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def enter(self) -> None: ...

    def leave(self) -> None: ...

    def group_id(self, order: int) -> str:
        return uuid.uuid4().hex[:12]

    def seed(self, key: str) -> int:
        self.next_seed += 1
        return self.next_seed - 1

    async def deliver(self, order: int, group: Group) -> None:
        await self.buffer.put(group)

    async def publish(self, weights: Any, version: int, pause_mode: str, counters: Counters) -> float:
        return await self.pool.push_weights(weights, version, pause_mode)

    def landed(self, version: int) -> dict[str, Any] | None:
        """The rollout counters as they stood when `version` landed (Lockstep); None: read them now."""
        return None


class Lockstep:
    wall_clock = False  # a reproducible run's samples hold nothing of wall time
    whole_batches = True  # the groups were judged and placed in their batch as they finished

    def __init__(self, *, controller: StalenessController, buffer: RolloutBuffer, pool: EnginePool, steps: int,
                 seed: int = 0) -> None:
        """`steps`: the versions the run will push. Puts `pool`'s engine in lockstep: it asks before every
        step and admits requests in id order, and `buffer` pops in the order groups were placed."""
        self.controller, self.buffer, self.pool, self.steps, self._seed = controller, buffer, pool, steps, seed
        self.next_seed = 0  # seeds are functions of the request, not a sequence
        self.counters: Counters = dict
        self.pause_mode = "abort"
        self.active = False  # only while the producer runs: evaluations before and after go through freely
        self.busy = 0  # group tasks (and the admission of one) not waiting for the engine
        self.kept = 0  # groups placed in batches
        self._finished: list[tuple[int, Group]] = []  # (admission order, group), not placed yet
        self._offered: dict[int, Any] = {}  # version -> the trainer's weights, waiting to land
        self._landed: dict[int, asyncio.Future[float]] = {}
        self.landed_counters: dict[int, dict[str, Any]] = {}  # version -> the counters at its landing
        self._changed = Waiters()
        buffer.cfg = msgspec.structs.replace(buffer.cfg, priority="fifo")
        for engine in pool.engines:  # type: ignore[attr-defined] - LocalPool (config-checked)
            engine.step_gate = self
            engine.scheduler.order_key = _rid

    def group_id(self, order: int) -> str:
        return f"g{order}"  # their requests are admitted in id order

    def seed(self, key: str) -> int:
        return int.from_bytes(hashlib.blake2b(f"{self._seed}:{key}".encode(), digest_size=8).digest()) >> 1

    async def deliver(self, order: int, group: Group) -> None:
        self._finished.append((order, group))  # placed in its batch at the next settled point

    def landed(self, version: int) -> dict[str, Any] | None:
        return self.landed_counters.pop(version)

    # ---- the rollout side reports ----------------------------------------------------------------
    def start(self) -> None:
        self.active, self.busy = True, 0

    def stop(self) -> None:
        self.active = False
        self._changed.wake()

    def enter(self) -> None:
        """A group task can run (admitted, or its engine call answered)."""
        self.busy += 1

    def leave(self) -> None:
        """A group task waits for the engine, or ended."""
        self.busy -= 1
        if self.busy <= 0:
            self._changed.wake()

    def caller_waits(self, requests: list[Any]) -> None:
        """The engine queued one call's requests: its caller waits now, and can run again the moment the
        last one ends (not when its task next gets the loop, which a step could slip in before)."""
        left = len(requests)

        def answered() -> None:
            nonlocal left
            left -= 1
            if left == 0:
                self.enter()

        for r in requests:
            r.on_finish = answered
        self.leave()

    # ---- the trainer side ------------------------------------------------------------------------
    async def publish(self, weights: Any, version: int, pause_mode: str, counters: Counters) -> float:
        """Offer `version`'s weights; returns the push's seconds once they landed. `counters`: the rollout
        counters a metrics row reads, taken at the landing (`landed`)."""
        self.pause_mode, self.counters = pause_mode, counters
        self._offered[version] = weights
        self._changed.wake()
        return await self._landing(version)

    def _landing(self, version: int) -> asyncio.Future[float]:
        if version not in self._landed:
            self._landed[version] = asyncio.get_running_loop().create_future()
        return self._landed[version]

    # ---- the engine asks before every step -------------------------------------------------------
    async def before_step(self, engine: TorchEngine) -> None:
        """Return when the engine may step: the rollout side settled, finished groups placed, and the
        weights due by now landed. Returns at once while the producer is not running."""
        ctl, b = self.controller, self.controller.batch_groups
        while self.active:
            if self.busy > 0 or ctl.capacity() > 0:  # a task still runs, or admission has room to fill
                await self._changed.wait()
                continue
            if self._finished:
                await self._place()  # a dropped group gives its slot back: admission may go on
                continue
            v = ctl.engine_version + 1
            has_work = engine.scheduler.has_work()
            if v <= self.steps and (self.kept >= (v + 1) * b or not has_work):
                if v not in self._offered:  # the trainer is late: the engine waits for it
                    await self._changed.wait()
                    continue
                await self._land(v)
                continue
            if has_work:
                return
            await self._changed.wait()

    async def _place(self) -> None:
        done, self._finished = sorted(self._finished, key=lambda x: x[0]), []
        for _, group in done:
            if self.controller.assign(group, version=self.kept // self.controller.batch_groups):
                self.kept += 1
                await self.buffer.put(group)

    async def _land(self, version: int) -> None:
        # Groups the trainer has not trained by this version, rather than what its wall-clock pops left queued.
        queued = self.kept - version * self.controller.batch_groups
        self.landed_counters[version] = self.counters() | {"buffer_size": queued,
                                                           "decisions": self.controller.drain_decisions()}
        seconds = await self.pool.push_weights(self._offered.pop(version), version, self.pause_mode)
        self.controller.set_version(version)
        self._landing(version).set_result(seconds)



def _rid(request: Any) -> str:
    return request.rid
