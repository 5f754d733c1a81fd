"""Running engine requests for the HTTP routes: `GenItem` (one engine request) and `Streams`.

Closing a `Streams` (client gone, handler cancelled) aborts every unfinished request, so a disconnect
frees the engine slot as SGLang does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..protocol import GenerateChunk
from .common import BadRequest, ServerState


@dataclass
class GenItem:
    """One engine request of an HTTP call (a batch or `n > 1` makes several)."""

    input_ids: list[int]
    params: dict[str, Any]
    rid: str
    return_logprob: bool = False
    text_in_logprobs: bool = False
    ids: list[int] = field(default_factory=list)  # output so far (streaming)
    logprobs: list[float] = field(default_factory=list)
    version: str = ""


class Streams:
    """Runs GenItems through the engine concurrently and merges their chunks.

    With `stream=False` (a plain `/generate`) each request goes through `engine.generate` and yields
    one finishing chunk: no per-token chunk objects, queue hops and task wake-ups in the engine's
    process, which on a CPU engine cost a few percent of the process (bench/async_vs_sync.py).

    `start()` validates: every request is checked and submitted synchronously on its pump's first
    step, so after one loop turn each has either been accepted or raised (→ BadRequest, nothing keeps
    running). `events()` yields `(index, chunks)` with every chunk already delivered for that request
    coalesced, so a request's last token and its finish arrive as one event. `aclose()` aborts every
    unfinished request.
    """

    def __init__(self, st: ServerState, items: list[GenItem], *, stream: bool = True) -> None:
        self.st, self.items, self.stream = st, items, stream
        self._queue: asyncio.Queue[tuple[int, GenerateChunk | Exception]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._open = len(items)
        self.errors: list[Exception] = []

    async def start(self) -> None:
        self.st.inflight.update(it.rid for it in self.items)
        self._tasks = [asyncio.create_task(self._pump(i, it)) for i, it in enumerate(self.items)]
        await asyncio.sleep(0)  # each pump validates + submits (or fails) on its first step
        if self.errors:
            await self.aclose()
            raise BadRequest(str(self.errors[0]))

    async def _pump(self, i: int, it: GenItem) -> None:
        try:
            if not self.stream:
                result = await self.st.engine.generate(it.input_ids, it.params, it.rid)
                version = result.get("meta_info", {}).get("weight_version", "")
                self._queue.put_nowait(
                    (i, GenerateChunk(rid=it.rid, token_ids=[], logprobs=[], weight_version=version,
                                      finished=True, result=result))
                )
                return
            async for chunk in self.st.engine.generate_stream(it.input_ids, it.params, it.rid):
                self._queue.put_nowait((i, chunk))
        except Exception as e:  # noqa: BLE001 - reported to the HTTP caller
            self.errors.append(e)
            self._queue.put_nowait((i, e))
        finally:
            self.st.inflight.discard(it.rid)

    async def events(self) -> AsyncIterator[tuple[int, list[GenerateChunk]]]:
        while self._open:
            got = [await self._queue.get()]
            while not self._queue.empty():
                got.append(self._queue.get_nowait())
            grouped: dict[int, list[GenerateChunk]] = {}
            for i, x in got:
                if isinstance(x, Exception):
                    raise x
                grouped.setdefault(i, []).append(x)
                self._open -= x.finished
            for i, chunks in grouped.items():
                yield i, chunks

    async def aclose(self) -> None:
        pending = [t for t in self._tasks if not t.done()]
        for t in pending:
            t.cancel()  # the engine's stream aborts its request when closed early
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for it in self.items:
            self.st.inflight.discard(it.rid)

    async def collect(self) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = [{} for _ in self.items]
        async for i, chunks in self.events():
            if chunks[-1].finished:
                results[i] = chunks[-1].result or {}
        return results


def feed(it: GenItem, chunks: list[GenerateChunk]) -> GenerateChunk | None:
    """Accumulate streamed tokens into `it`; return the finishing chunk if there is one."""
    for c in chunks:
        it.ids += c.token_ids
        it.logprobs += c.logprobs
        it.version = c.weight_version
        if c.finished:
            return c
    return None
