"""EnginePool: the rollout manager's one handle on every engine replica.

Generation requests are routed to one replica (least in-flight first, so replicas pull work as they
have capacity and the data is never pre-split); `generate_many` sends a group's requests together
(one HTTP call where the server takes batches); control calls (pause, resume, abort_all) and weight
pushes reach *every* replica.

The contract the rollout manager relies on: after `pause()` returns, a request sent to the pool waits
(in the engine, as SGLang, vLLM and TorchEngine all do while paused) until `resume()`, and then runs
with whatever weights were loaded meanwhile. So the manager resubmits interrupted samples at once.

`LocalPool` keeps TorchEngines in this process (unit tests, GPU benchmarks, the CPU quickstart).
`RayServePool` (ray_serve_pool.py) and `HttpPool` (http_pool.py) are the same class over other
processes. `build_pool(cfg.engines, ...)` (build.py) makes the one the config names.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Self

from ..weights import InProcessSync, WeightSync

if TYPE_CHECKING:
    from ..engine import TorchEngine


class EnginePool(ABC):
    """Every pool: `generate` routes one request, control calls reach every replica, and
    `push_weights` is one weight update (stage, pause, load, resume) through the pool's `WeightSync`.
    Use as an async context manager (start / aclose)."""

    num_replicas: int
    weight_sync: WeightSync

    def __init__(self) -> None:
        self._paused = False

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.aclose()  # what did start (servers, a router) is stopped
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def aclose(self) -> None: ...

    @abstractmethod
    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]: ...

    async def generate_many(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]],
                            rids: list[str]) -> list[dict[str, Any]]:
        """One `generate` per request, concurrently. `RayServePool` batches requests issued in one
        event-loop turn on its own; `HttpPool` overrides this with one batched HTTP request."""
        return list(await asyncio.gather(*[
            self.generate(i, p, r) for i, p, r in zip(input_ids, sampling_params, rids, strict=True)
        ]))

    @abstractmethod
    async def abort_all(self) -> None: ...

    @abstractmethod
    async def _pause_all(self, mode: str) -> None: ...

    @abstractmethod
    async def _resume_all(self) -> None: ...

    async def pause(self, mode: str = "abort") -> None:
        self._paused = True
        await self._pause_all(mode)

    async def resume(self) -> None:
        await self._resume_all()
        self._paused = False

    @property
    def is_paused(self) -> bool:
        return self._paused

    async def push_weights(self, named_tensors: Any, version: int, pause: str | None = "abort") -> float:
        """The trainer's weights, as `version`, into every replica; returns seconds.

        `pause`: how in-flight requests are held meanwhile (`abort`: they return partial and the
        manager resubmits them, to start with the new weights; `retract` / `in_place`: they stay in
        the engines). None loads without pausing (before generation starts)."""
        t0 = time.perf_counter()
        await self.weight_sync.stage(named_tensors, version)  # the engines keep generating meanwhile
        if pause is not None:
            await self.pause(pause)
        await self.weight_sync.load(named_tensors, version)
        if pause is not None:
            await self.resume()
        return time.perf_counter() - t0

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """running, busy_s, prefill_s (engine seconds computing / in prefill, summed), replicas."""

    async def refresh_stats(self) -> None:
        """Read the replicas' stats (remote pools); in-process stats are always current."""
        return None


class LocalPool(EnginePool):
    """Engines in the driver process."""

    def __init__(self, engines: list[TorchEngine]) -> None:
        if not engines:
            raise ValueError("LocalPool needs at least one engine")
        super().__init__()
        self.engines = engines
        self.num_replicas = len(engines)
        self.weight_sync = InProcessSync(engines)
        self._route = LeastLoaded(len(engines))

    async def start(self) -> None:
        for e in self.engines:
            await e.__aenter__()

    async def aclose(self) -> None:
        for e in reversed(self.engines):
            await e.aclose()

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]:
        i = self._route.pick()
        try:
            return await self.engines[i].generate(input_ids, sampling_params, rid)
        finally:
            self._route.done(i)

    async def generate_many(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]],
                            rids: list[str]) -> list[dict[str, Any]]:
        """A group to the least-loaded engine in one call (no task per request), as HttpPool sends it
        in one HTTP request."""
        n = len(input_ids)
        i = self._route.pick(n)
        try:
            return await self.engines[i].generate_many(input_ids, sampling_params, rids)
        finally:
            self._route.done(i, n)

    async def abort_all(self) -> None:
        await asyncio.gather(*[e.abort_all() for e in self.engines])

    async def _pause_all(self, mode: str) -> None:
        await asyncio.gather(*[e.pause(mode) for e in self.engines])  # type: ignore[arg-type]

    async def _resume_all(self) -> None:
        await asyncio.gather(*[e.resume() for e in self.engines])

    async def release_memory(self, weights: bool = True) -> None:
        """Every engine frees its KV cache (and with `weights` its weights); requests wait meanwhile."""
        await asyncio.gather(*[e.release_memory(weights) for e in self.engines])

    async def resume_memory(self) -> None:
        for e in self.engines:  # one by one: on a GPU each recaptures its CUDA graphs
            await e.resume_memory()

    def memory_bytes(self) -> int:
        """Device memory the engines hold now (KV cache and weights)."""
        return sum(e.memory_bytes() for e in self.engines)

    def stats(self) -> dict[str, Any]:
        per = [e.stats() for e in self.engines]
        return {
            "running": sum(s["running"] for s in per),
            "waiting": sum(s["waiting"] for s in per),
            "generated_tokens": sum(s["generated_tokens"] for s in per),
            "busy_s": sum(s["busy_s"] for s in per),
            "prefill_s": sum(s["prefill_s"] for s in per),
            "replicas": per,
        }


class LeastLoaded:
    """Routing: the replica with the fewest requests in flight, in O(log replicas) per request.

    A heap of (in flight, replica) with lazy deletion: every change pushes the replica's new count, and
    entries whose count is no longer current (or whose replica is out of rotation) are skipped when
    they surface."""

    def __init__(self, n: int) -> None:
        self.inflight = [0] * n
        self.out: set[int] = set()  # replicas out of rotation (lost servers)
        self._heap = [(0, i) for i in range(n)]

    def grow(self) -> int:
        """One more replica; returns its index."""
        self.inflight.append(0)
        heapq.heappush(self._heap, (0, len(self.inflight) - 1))
        return len(self.inflight) - 1

    def set_out(self, i: int, out: bool) -> None:
        if out:
            self.out.add(i)
        elif i in self.out:
            self.out.discard(i)
            heapq.heappush(self._heap, (self.inflight[i], i))

    def pick(self, k: int = 1) -> int:
        """The least-loaded replica in rotation, now counted with `k` more requests (IndexError if
        every replica is out)."""
        while True:
            n, i = heapq.heappop(self._heap)
            if n == self.inflight[i] and i not in self.out:
                self._add(i, k)
                return i

    def done(self, i: int, k: int = 1) -> None:
        self._add(i, -k)

    def _add(self, i: int, k: int) -> None:
        self.inflight[i] += k
        heapq.heappush(self._heap, (self.inflight[i], i))
        if len(self._heap) > 8 * len(self.inflight):  # drop the stale entries now and then
            self._heap = [(n, j) for j, n in enumerate(self.inflight) if j not in self.out]
            heapq.heapify(self._heap)
