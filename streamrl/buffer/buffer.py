"""RolloutBuffer: the asyncio priority queue of finished `Group`s between the rollout manager and the trainer.

It owns pop order (oldest weight version first by default, so staleness stays bounded; FIFO on ties),
back-pressure (`capacity`), batch assembly for the trainer (`get_batch` / `stream`), the groups a
caller's `accept` filter turned away (kept until drained, never dropped silently), the interrupted
samples parked for resumption, and a byte snapshot of all of it for checkpoints.

It knows nothing about torch, engines, the trainer's version or staleness rules: the controller
expresses those through `accept`. Pure asyncio on one event loop: no threads, no locks. Every state
change happens in synchronous code between awaits, so it is atomic with respect to other tasks.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import AsyncIterator, Callable
from typing import Literal

import msgspec

from streamrl.types import Group, Sample

Priority = Literal["oldest_version", "fifo"]


class BufferClosed(Exception):
    """Raised by put on a closed buffer, and by get_batch on a closed, empty one."""


class BufferFull(Exception):
    """Raised by put_nowait when the buffer holds `capacity` groups."""


class _Entry(msgspec.Struct, array_like=True, order=True):
    key: int  # the group's first version (`_first_version`) under "oldest_version", 0 under "fifo"
    seq: int  # insertion order: the tie-break, so equal keys pop FIFO
    group: Group


class _State(msgspec.Struct, kw_only=True):
    entries: list[_Entry]  # in pop order
    next_seq: int
    total_put: int
    total_got: int
    total_rejected: int
    partials: list[Sample]
    rejected: list[Group]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_State)


class RolloutBuffer:
    """Groups in, batches of groups out, in priority order.

    `get_batch` consumes nothing until it can return, so a cancelled or timed-out call loses no data.
    """

    def __init__(
        self,
        priority: Priority | str = "oldest_version",
        capacity: int | None = None,
        *,
        on_reject: Callable[[Group], None] | None = None,
    ) -> None:
        if priority not in ("oldest_version", "fifo"):
            raise ValueError(f"priority must be 'oldest_version' or 'fifo', got {priority!r}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {capacity}")
        self.priority = priority
        self.capacity = capacity
        self.on_reject = on_reject
        self.total_put = 0
        self.total_got = 0
        self.total_rejected = 0
        self._heap: list[_Entry] = []
        self._next_seq = 0
        self._closed = False
        self._rejected: list[Group] = []
        self._partials: list[Sample] = []
        self._getters: set[asyncio.Future[None]] = set()  # woken when groups arrive or on close
        self._putters: set[asyncio.Future[None]] = set()  # woken when room frees or on close

    # ---------------------------------------------------------------------------------- in

    def put_nowait(self, group: Group) -> None:
        if self._closed:
            raise BufferClosed("put on a closed RolloutBuffer")
        if self.is_full():
            raise BufferFull(f"RolloutBuffer holds {len(self._heap)} groups (capacity {self.capacity})")
        key = _first_version(group) if self.priority == "oldest_version" else 0
        heapq.heappush(self._heap, _Entry(key, self._next_seq, group))
        self._next_seq += 1
        self.total_put += 1
        self._wake(self._getters)

    async def put(self, group: Group) -> None:
        """Add a group, waiting while the buffer is at capacity (back-pressure on the rollout side)."""
        while self.is_full() and not self._closed:
            await self._wait(self._putters)
        self.put_nowait(group)

    # --------------------------------------------------------------------------------- out

    async def get_batch(
        self,
        num_groups: int,
        *,
        accept: Callable[[Group], bool] | None = None,
        timeout: float | None = None,
    ) -> list[Group]:
        """Wait for `num_groups` acceptable groups and return them in priority order.

        Queued groups for which `accept` returns False are removed and moved to the rejected list
        (see `drain_rejected`); `accept` is re-applied to the whole queue on every wake-up because its
        answer may change (the trainer's version moves on). Returns fewer groups only once the buffer
        is closed; raises BufferClosed if it is closed and empty, TimeoutError after `timeout` seconds
        (nothing is consumed in either case).
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        if self.capacity is not None and num_groups > self.capacity:
            raise ValueError(f"num_groups {num_groups} exceeds capacity {self.capacity}: it could never fill")
        async with asyncio.timeout(timeout):
            while True:
                if accept is not None:
                    self._reject_where(accept)
                if len(self._heap) >= num_groups or (self._closed and self._heap):
                    return self._pop(num_groups)
                if self._closed:
                    raise BufferClosed("RolloutBuffer is closed and empty")
                await self._wait(self._getters)

    async def stream(
        self, num_groups: int, *, accept: Callable[[Group], bool] | None = None
    ) -> AsyncIterator[list[Group]]:
        """Yield batches of `num_groups` groups until the buffer is closed and drained (last may be short)."""
        while True:
            try:
                batch = await self.get_batch(num_groups, accept=accept)
            except BufferClosed:
                return
            yield batch

    def drain_rejected(self) -> list[Group]:
        """Groups removed by an `accept` filter since the last call, in the order they were rejected."""
        out, self._rejected = self._rejected, []
        return out

    # ----------------------------------------------------------------------------- partials

    def park_partial(self, sample: Sample) -> None:
        """Hold an interrupted sample until the manager resumes it (so a checkpoint includes it)."""
        self._partials.append(sample)

    def unpark_partial(self, sample: Sample) -> bool:
        """Take back one parked sample (by identity) when it resumes; False if it was not parked."""
        for i, parked in enumerate(self._partials):
            if parked is sample:
                del self._partials[i]
                return True
        return False

    def take_partials(self) -> list[Sample]:
        out, self._partials = self._partials, []
        return out

    @property
    def num_partials(self) -> int:
        return len(self._partials)

    # ---------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """No more puts; getters drain what is queued, then see BufferClosed. Idempotent."""
        self._closed = True
        self._wake(self._getters)
        self._wake(self._putters)

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._heap)

    def is_full(self) -> bool:
        return self.capacity is not None and len(self._heap) >= self.capacity

    def oldest_version(self) -> int | None:
        """Oldest weight version among queued groups, or None when empty."""
        return min((e.group.oldest_version() for e in self._heap), default=None)

    def peek(self) -> list[Group]:
        """Queued groups in pop order, without removing them."""
        return [e.group for e in sorted(self._heap)]

    # ------------------------------------------------------------------------------- state

    def state_dict(self) -> bytes:
        """msgpack snapshot: queued groups in pop order, counters, parked partials, undrained rejects."""
        state = _State(
            entries=sorted(self._heap),
            next_seq=self._next_seq,
            total_put=self.total_put,
            total_got=self.total_got,
            total_rejected=self.total_rejected,
            partials=self._partials,
            rejected=self._rejected,
        )
        return _encoder.encode(state)

    def load_state_dict(self, data: bytes) -> None:
        """Replace the contents with a snapshot; pops then follow the same order as before the save.

        Keys are recomputed under this buffer's own priority, so a snapshot may be loaded into a
        buffer with a different priority; sequence numbers are kept, so ties still pop FIFO.
        """
        state = _decoder.decode(data)
        oldest = self.priority == "oldest_version"
        self._heap = [
            _Entry(_first_version(e.group) if oldest else 0, e.seq, e.group) for e in state.entries
        ]
        heapq.heapify(self._heap)
        self._next_seq = max(state.next_seq, max((e.seq + 1 for e in self._heap), default=0))
        self.total_put, self.total_got = state.total_put, state.total_got
        self.total_rejected = state.total_rejected
        self._partials = list(state.partials)
        self._rejected = list(state.rejected)
        self._wake(self._getters)
        self._wake(self._putters)

    # ----------------------------------------------------------------------------- internal

    def _pop(self, n: int) -> list[Group]:
        out = [heapq.heappop(self._heap).group for _ in range(min(n, len(self._heap)))]
        self.total_got += len(out)
        self._wake(self._putters)
        return out

    def _reject_where(self, accept: Callable[[Group], bool]) -> None:
        # O(queue) per wake-up; queues hold hundreds of groups, and accept is a cheap version check.
        keep, dropped = [], []
        for e in sorted(self._heap):
            (keep if accept(e.group) else dropped).append(e)
        if not dropped:
            return
        self._heap = keep  # a sorted list is a valid heap
        for e in dropped:
            self._rejected.append(e.group)
            self.total_rejected += 1
            if self.on_reject is not None:
                self.on_reject(e.group)
        self._wake(self._putters)

    @staticmethod
    async def _wait(waiters: set[asyncio.Future[None]]) -> None:
        fut = asyncio.get_running_loop().create_future()
        waiters.add(fut)
        try:
            await fut
        finally:
            waiters.discard(fut)

    @staticmethod
    def _wake(waiters: set[asyncio.Future[None]]) -> None:
        # Wake everyone; each waiter re-checks its own condition (few waiters, so no herd to speak of).
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


def _first_version(group: Group) -> int:
    """Admission version (no token of the group is older), or its oldest token if that is older
    (a group built elsewhere). Popping by admission is earliest-deadline-first for the controller,
    whose staleness bound counts from admission."""
    return min(group.admitted_version, group.oldest_version())
