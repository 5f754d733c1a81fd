"""RolloutBuffer: the asyncio priority queue of finished `Group`s between the rollout manager and the trainer.

Its one job: queue finished groups and hand out batches. It owns pop order (oldest weight version
first by default, so staleness stays bounded; FIFO on ties), back-pressure (`capacity`) and a byte
snapshot of what is queued, for checkpoints. A caller may ask for groups no older than `min_version`
(their oldest trainable token); a queued group older than that leaves the buffer at once and is
handed to `on_drop` exactly once. Nothing else is kept: the buffer holds what is queued and no more.

It knows nothing about torch, engines, the trainer's version or staleness rules: the controller
turns those into `min_version` and handles the drops. Pure asyncio on one event loop: no threads,
no locks. Every state change happens in synchronous code between awaits, so it is atomic with
respect to other tasks.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable

import msgspec

from ..config import BufferConfig
from ..types import Group
from .waiters import Waiters


class BufferClosed(Exception):
    """Raised by put on a closed buffer, and by get_batch on a closed, empty one."""


class BufferFull(Exception):
    """Raised by put_nowait when the buffer holds `capacity` groups."""


class _Entry(msgspec.Struct, array_like=True, order=True):
    key: int  # the group's first version (`_first_version`) under "oldest_version", 0 under "fifo"
    seq: int  # insertion order: the tie-break, so equal keys pop FIFO
    group: Group
    oldest: int = 0  # its oldest trainable token's version, computed once: checked on every wake-up


class _State(msgspec.Struct, kw_only=True):
    entries: list[_Entry]  # in pop order
    next_seq: int
    total_put: int
    total_got: int
    total_dropped: int = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_State)


class RolloutBuffer:
    """Groups in, batches of groups out, in priority order.

    `get_batch` consumes nothing until it can return, so a cancelled or timed-out call loses no data.
    """

    def __init__(self, cfg: BufferConfig | None = None, *, on_drop: Callable[[Group], None] | None = None) -> None:
        self.cfg = cfg or BufferConfig()
        self.on_drop = on_drop
        self.total_put = 0
        self.total_got = 0
        self.total_dropped = 0
        self._heap: list[_Entry] = []
        self._next_seq = 0
        self._closed = False
        self._getters = Waiters()  # woken when groups arrive or on close
        self._putters = Waiters()  # woken when room frees or on close

    # ---------------------------------------------------------------------------------- in

    def put_nowait(self, group: Group) -> None:
        if self._closed:
            raise BufferClosed("put on a closed RolloutBuffer")
        if self.is_full():
            raise BufferFull(f"RolloutBuffer holds {len(self._heap)} groups (capacity {self.cfg.capacity})")
        heapq.heappush(self._heap, self._entry(group, self._next_seq))
        self._next_seq += 1
        self.total_put += 1
        self._getters.wake()

    async def put(self, group: Group) -> None:
        """Add a group, waiting while the buffer is at capacity (back-pressure on the rollout side)."""
        while self.is_full() and not self._closed:
            await self._putters.wait()
        self.put_nowait(group)

    # --------------------------------------------------------------------------------- out

    async def get_batch(
        self,
        num_groups: int,
        *,
        min_version: Callable[[], int | None] | None = None,
        timeout: float | None = None,
    ) -> list[Group]:
        """Wait for `num_groups` groups no older than `min_version()` and return them in priority order.

        Queued groups whose oldest trainable token is older leave the buffer and go to `on_drop`;
        `min_version` is asked again on every wake-up because its answer may change (the trainer's
        version moves on); None takes every group. Returns fewer groups only once the buffer is
        closed; raises BufferClosed if it is closed and empty, TimeoutError after `timeout` seconds
        (nothing is consumed in either case).
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        cap = self.cfg.capacity
        if cap is not None and num_groups > cap:
            raise ValueError(f"num_groups {num_groups} exceeds capacity {cap}: it could never fill")
        async with asyncio.timeout(timeout):
            while True:
                if min_version is not None and (floor := min_version()) is not None:
                    self._drop_older_than(floor)
                if len(self._heap) >= num_groups or (self._closed and self._heap):
                    return self._pop(num_groups)
                if self._closed:
                    raise BufferClosed("RolloutBuffer is closed and empty")
                await self._getters.wait()

    # ---------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """No more puts; getters drain what is queued, then see BufferClosed. Idempotent."""
        self._closed = True
        self._getters.wake()
        self._putters.wake()

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._heap)

    def is_full(self) -> bool:
        return self.cfg.capacity is not None and len(self._heap) >= self.cfg.capacity

    def oldest_version(self) -> int | None:
        """Oldest weight version among queued groups, or None when empty."""
        return min((e.group.oldest_version() for e in self._heap), default=None)

    def peek(self) -> list[Group]:
        """Queued groups in pop order, without removing them."""
        return [e.group for e in sorted(self._heap)]

    # ------------------------------------------------------------------------------- state

    def state_dict(self) -> bytes:
        """msgpack snapshot: queued groups in pop order and the counters."""
        state = _State(entries=sorted(self._heap), next_seq=self._next_seq, total_put=self.total_put,
                       total_got=self.total_got, total_dropped=self.total_dropped)
        return _encoder.encode(state)

    def load_state_dict(self, data: bytes) -> None:
        """Replace the contents with a snapshot; pops then follow the same order as before the save.

        Keys are recomputed under this buffer's own priority, so a snapshot may be loaded into a
        buffer with a different priority; sequence numbers are kept, so ties still pop FIFO.
        """
        state = _decoder.decode(data)
        self._heap = [self._entry(e.group, e.seq) for e in state.entries]
        heapq.heapify(self._heap)
        self._next_seq = max(state.next_seq, max((e.seq + 1 for e in self._heap), default=0))
        self.total_put, self.total_got, self.total_dropped = state.total_put, state.total_got, state.total_dropped
        self._getters.wake()
        self._putters.wake()

    # ----------------------------------------------------------------------------- internal

    def _pop(self, n: int) -> list[Group]:
        out = [heapq.heappop(self._heap).group for _ in range(min(n, len(self._heap)))]
        self.total_got += len(out)
        self._putters.wake()
        return out

    def _entry(self, group: Group, seq: int) -> _Entry:
        # Popping by admission version (or its oldest token, if older: a group built elsewhere) is
        # earliest-deadline-first for the controller, whose staleness bound counts from admission.
        oldest = group.oldest_version()
        key = min(group.admitted_version, oldest) if self.cfg.priority == "oldest_version" else 0
        return _Entry(key, seq, group, oldest)

    def _drop_older_than(self, floor: int) -> None:
        # One integer compare per queued group and wake-up; the heap is rebuilt only when one goes.
        if all(e.oldest >= floor for e in self._heap):
            return
        dropped = [e for e in self._heap if e.oldest < floor]
        self._heap = [e for e in self._heap if e.oldest >= floor]
        heapq.heapify(self._heap)
        for e in sorted(dropped):
            self.total_dropped += 1
            if self.on_drop is not None:
                self.on_drop(e.group)
        self._putters.wake()
