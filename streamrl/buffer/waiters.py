"""Waiters: tasks that wait for "something changed" and re-check their own condition.

Why not `asyncio.Condition`: waking it needs its lock, so a synchronous state change (a group
dropped inside the buffer's accept pass) could not wake anyone without scheduling a task. Here
`wake()` is synchronous and wakes every waiter; each re-checks its condition, so a spurious wake-up
costs one check. Few tasks wait at once (the trainer, the manager's admission loop), so waking all
of them is no herd.
"""

from __future__ import annotations

import asyncio


class Waiters:
    def __init__(self) -> None:
        self._futures: set[asyncio.Future[None]] = set()

    async def wait(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._futures.add(fut)
        try:
            await fut
        finally:
            self._futures.discard(fut)

    def wake(self) -> None:
        for fut in self._futures:
            if not fut.done():
                fut.set_result(None)
