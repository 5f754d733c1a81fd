"""EnginePool: the rollout manager's one handle on every engine replica.

Generation requests are routed to one replica (least in-flight first, so replicas pull work as they
have capacity and the data is never pre-split); `generate_many` sends a group's requests together
(one HTTP call where the server takes batches); control calls (pause, resume, abort_all, weight
updates) reach *every* replica.

The contract the rollout manager relies on: after `pause()` returns, a request sent to the pool waits
(in the engine, as SGLang, vLLM and TorchEngine all do while paused) until `resume()`, and then runs
with whatever weights were loaded meanwhile. So the manager resubmits interrupted samples at once.

`LocalPool` keeps TorchEngines in this process (unit tests, GPU benchmarks, the CPU quickstart).
`RayServePool` (ray_serve_pool.py) and `HttpPool` (http_pool.py) implement the same methods.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any, Protocol

from ..engine import TorchEngine


class EnginePool(Protocol):
    num_replicas: int

    async def start(self) -> None: ...
    async def aclose(self) -> None: ...
    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]: ...
    async def generate_many(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]],
                            rids: list[str]) -> list[dict[str, Any]]: ...
    async def abort_all(self) -> None: ...
    async def pause(self, mode: str = "abort") -> None: ...
    async def resume(self) -> None: ...
    async def stage_weights(self, named_tensors: Any, version: int) -> None: ...
    async def update_weights(self, named_tensors: Any, version: int) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    async def refresh_stats(self) -> None: ...


class PoolBase(ABC):
    """The base of the pools: pause / resume of every replica and the pool-wide paused state. A pool
    implements `generate`, `_pause_all(mode)` and `_resume_all()`; `generate_many` and
    `stage_weights` have defaults."""

    def __init__(self) -> None:
        self._paused = False

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
    async def _pause_all(self, mode: str) -> None: ...

    @abstractmethod
    async def _resume_all(self) -> None: ...

    async def pause(self, mode: str = "abort") -> None:
        self._paused = True
        await self._pause_all(mode)

    async def resume(self) -> None:
        await self._resume_all()
        self._paused = False

    async def stage_weights(self, named_tensors: Any, version: int) -> None:
        """Work for the next `update_weights` that can be done before the pause (HttpPool writes the
        folder its servers load). Nothing by default."""
        return None

    @property
    def is_paused(self) -> bool:
        return self._paused


class LocalPool(PoolBase):
    """Engines in the driver process."""

    def __init__(self, engines: list[TorchEngine]) -> None:
        if not engines:
            raise ValueError("LocalPool needs at least one engine")
        super().__init__()
        self.engines = engines
        self.num_replicas = len(engines)
        self._inflight = [0] * len(engines)

    async def start(self) -> None:
        for e in self.engines:
            await e.__aenter__()

    async def aclose(self) -> None:
        for e in reversed(self.engines):
            await e.aclose()

    def _pick(self) -> int:
        return min(range(len(self.engines)), key=lambda i: self._inflight[i])

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]:
        i = self._pick()
        self._inflight[i] += 1
        try:
            return await self.engines[i].generate(input_ids, sampling_params, rid)
        finally:
            self._inflight[i] -= 1

    async def abort_all(self) -> None:
        await asyncio.gather(*[e.abort_all() for e in self.engines])

    async def _pause_all(self, mode: str) -> None:
        await asyncio.gather(*[e.pause(mode) for e in self.engines])  # type: ignore[arg-type]

    async def _resume_all(self) -> None:
        await asyncio.gather(*[e.resume() for e in self.engines])

    async def update_weights(self, named_tensors: Any, version: int) -> None:
        await asyncio.gather(*[e.update_weights_from_state_dict(named_tensors, str(version)) for e in self.engines])

    async def refresh_stats(self) -> None:
        """In-process engines' stats are always current."""

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
