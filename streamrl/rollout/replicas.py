"""Which of an HTTP pool's servers are up: health checks, routing around lost ones, relaunch, rejoin.

A server is *lost* when a call to it fails at the connection (it died: refused, reset, closed) or it
misses two health checks in a row (it stopped answering: frozen, overloaded past the timeout). Then:

- every call in flight on it gives up at once (`ReplicaLost`): the pool answers those generation
  requests as aborted with no new tokens, and the rollout manager resubmits the samples, with the
  tokens they already had, to the servers still up (new request ids: nothing is trained twice);
- control calls (pause, resume, abort, weight loads, stats) skip it instead of failing the run;
- a server streamrl launched is killed (its whole process group) and launched again, with backoff,
  up to `max_restarts` times; a server given by URL is probed until it answers again;
- before it takes work again it *joins*: it loads the pool's current weights and matches the pool's
  pause state, re-checked until nothing changed meanwhile.

When no server is up, generation waits up to `all_lost_timeout_s` for one to come back, then the run
stops with `EnginesLost` (one line). With `weight_sync: distributed` a lost server breaks the gloo
group, so losing one stops the run the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from ..config import EnginesConfig
from ..errors import RolloutFailed
from ..weights.sync import load_into
from .pools import LeastLoaded

log = logging.getLogger("streamrl.http_pool")

# A connection-level failure: the server is gone (a 4xx/5xx answer is the server speaking, not lost).
CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError, TimeoutError)


class ReplicaLost(Exception):
    """The server a call went to was lost while the call ran."""


class EnginesLost(RolloutFailed):
    """No engine server is left to generate with: the run stops with this one line."""


@dataclass(eq=False)
class Replica:
    index: int
    url: str
    client: Any  # SGLangClient or VLLMClient
    server: Any = None  # the launched ServerProcess / VLLMServer; None for a server given by URL
    up: bool = True
    misses: int = 0  # health checks failed in a row
    restarts: int = 0
    lost: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Replicas:
    """The pool's servers and their state, under `cfg`'s health_check_*, control_timeout_s,
    max_restarts and all_lost_timeout_s. `make_client(url)` builds a client; `current()` is the pool's
    (version, weights folder) or None; `paused()` whether the pool is paused now; `enabled` False: no
    health checks, relaunch or rejoin (a router in front does its own); `breaks_on_loss`: a lost
    server ends the run (distributed weight sync)."""

    def __init__(self, cfg: EnginesConfig, make_client: Callable[[str], Any],
                 current: Callable[[], tuple[int, str] | None], paused: Callable[[], bool], *,
                 enabled: bool = True, breaks_on_loss: bool = False) -> None:
        self.cfg, self.enabled = cfg, enabled
        self.make_client, self.current, self.paused = make_client, current, paused
        self.breaks_on_loss = breaks_on_loss
        self.all: list[Replica] = []
        self.route = LeastLoaded(0)
        self.counters = {"servers_lost": 0, "servers_restarted": 0, "servers_rejoined": 0, "lost_requests": 0}
        self._fatal: EnginesLost | None = None
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._monitor: asyncio.Task[None] | None = None

    # ---- membership ------------------------------------------------------------------------------
    def add(self, url: str, server: Any = None) -> Replica:
        rep = Replica(len(self.all), url, self.make_client(url), server)
        self.all.append(rep)
        self.route.grow()
        return rep

    @property
    def up(self) -> list[Replica]:
        return [r for r in self.all if r.up]

    def start_monitor(self) -> None:
        if self.enabled and self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch(), name="http-pool-health")

    async def aclose(self) -> None:
        for t in [self._monitor, *self._tasks]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*[t for t in [self._monitor, *self._tasks] if t is not None], return_exceptions=True)
        for r in self.all:
            await r.client.aclose()

    def lose(self, rep: Replica, why: str) -> None:
        """Take `rep` out of rotation; its calls give up; relaunch or wait for it to come back."""
        if not rep.up:
            return
        rep.up = False
        self.route.set_out(rep.index, True)
        if not rep.lost.done():
            rep.lost.set_result(None)
        self.counters["servers_lost"] += 1
        log.warning("http pool: engine server %s lost (%s); %d of %d up", rep.url, why, len(self.up), len(self.all))
        if self.breaks_on_loss:
            self._fatal = EnginesLost(f"engine server {rep.url} was lost ({why}); weight_sync: distributed cannot "
                                      "go on without it (use weight_sync: disk to fail over)")
        elif not self.enabled:
            pass
        elif rep.server is not None:
            self._spawn(self._relaunch(rep))
        self._check_any_left()
        self._changed.set()

    def _check_any_left(self) -> None:
        hopeless = [r for r in self.all if not r.up and r.server is not None and r.restarts >= self.cfg.max_restarts]
        if self.all and len(hopeless) == len(self.all) and self._fatal is None:
            self._fatal = EnginesLost(f"every engine server was lost and relaunched {self.cfg.max_restarts} "
                                      f"times; see their logs ({hopeless[-1].server.log_path.parent})")

    def _spawn(self, coro: Awaitable[None]) -> None:
        t = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ---- calls -----------------------------------------------------------------------------------
    async def pick(self, k: int = 1) -> Replica:
        """An up server, counted with `k` more requests (give them back with `done`); waits for one
        while none is up."""
        deadline = time.monotonic() + self.cfg.all_lost_timeout_s
        while True:
            if self._fatal is not None:
                raise self._fatal
            if self.up:
                return self.all[self.route.pick(k)]
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0 or not self.enabled:
                raise EnginesLost(f"no engine server has answered for {self.cfg.all_lost_timeout_s:g} s "
                                  f"({', '.join(r.url for r in self.all)})")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def done(self, rep: Replica, k: int = 1) -> None:
        self.route.done(rep.index, k)

    async def on(self, rep: Replica, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        """`coro` (a call to `rep`), unless `rep` is lost first or the call fails at the connection or
        times out: then `rep` is lost and this raises ReplicaLost."""
        call = asyncio.ensure_future(coro)
        lost = rep.lost
        try:
            await asyncio.wait({call, lost}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            call.cancel()
            raise
        if not call.done():
            call.cancel()
            if not lost.done():
                self.lose(rep, f"no answer within {timeout:g} s")
            raise ReplicaLost(rep.url)
        try:
            return call.result()
        except CONNECTION_ERRORS as e:
            self.lose(rep, f"{type(e).__name__}: {e}".rstrip(": "))
            raise ReplicaLost(rep.url) from e

    async def each(self, fn: Callable[[Any], Awaitable[Any]]) -> list[Any]:
        """`fn(client)` on every up server at once, each bounded by the control timeout; lost servers
        are skipped (a server that joins later catches up in `_join`)."""
        if self._fatal is not None:
            raise self._fatal

        async def one(rep: Replica) -> Any:
            try:
                return await self.on(rep, fn(rep.client), self.cfg.control_timeout_s)
            except ReplicaLost:
                return ReplicaLost

        results = await asyncio.gather(*[one(r) for r in self.up])
        if self._fatal is not None:
            raise self._fatal
        return [r for r in results if r is not ReplicaLost]

    # ---- health, relaunch, rejoin ----------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_check_interval_s)
            await asyncio.gather(*[self._probe(r) for r in self.all], return_exceptions=True)

    async def _probe(self, rep: Replica) -> None:
        if not rep.up and rep.server is not None:
            return  # being relaunched
        try:
            ok = await asyncio.wait_for(rep.client.health(), self.cfg.health_check_timeout_s)
        except TimeoutError:
            ok = False
        if rep.up:
            rep.misses = 0 if ok else rep.misses + 1
            if rep.misses >= 2:
                self.lose(rep, f"{rep.misses} health checks missed")
        elif ok:  # a given URL that answers again
            await self._join(rep)

    async def _relaunch(self, rep: Replica) -> None:
        server = rep.server
        await server.stop(grace=0.5)  # SIGKILL soon: a frozen (SIGSTOPped) server never handles SIGTERM
        while rep.restarts < self.cfg.max_restarts:
            await asyncio.sleep(min(2.0 ** rep.restarts, 30.0))
            rep.restarts += 1
            try:
                url = await server.start()
            except Exception as e:  # noqa: BLE001 - tried again after the backoff, up to max_restarts
                log.warning("http pool: relaunching %s failed (%s)", rep.url, str(e).splitlines()[0])
                await server.stop(grace=0.5)
                continue
            old, rep.url, rep.client = rep.client, url, self.make_client(url)
            await old.aclose()
            self.counters["servers_restarted"] += 1
            if await self._join(rep):
                return
        self._check_any_left()
        self._changed.set()

    async def _join(self, rep: Replica) -> bool:
        """Bring `rep` to the pool's weights and pause state, then into rotation. False if it failed."""
        c, t = rep.client, self.cfg.control_timeout_s
        try:
            while True:
                state = (self.current(), self.paused())
                cur, paused = state
                if cur is not None:
                    await asyncio.wait_for(load_into(c, cur[1], str(cur[0])), t)
                await asyncio.wait_for(c.pause("abort") if paused else c.resume(), t)
                if (self.current(), self.paused()) == state:
                    break
        except (*CONNECTION_ERRORS, TimeoutError) as e:
            log.warning("http pool: %s did not rejoin (%s)", rep.url, type(e).__name__)
            return False
        rep.up, rep.misses = True, 0
        rep.lost = asyncio.get_running_loop().create_future()
        self.route.set_out(rep.index, False)
        self.counters["servers_rejoined"] += 1
        log.warning("http pool: engine server %s is back; %d of %d up", rep.url, len(self.up), len(self.all))
        self._changed.set()
        return True
