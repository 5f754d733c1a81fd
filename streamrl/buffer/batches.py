"""The trainer's next batch, in parts: the buffer's groups as the controller lets them be trained.

    controller.wait_takeable -> buffer.get_batch(min_version=controller.min_version) -> controller.compose

Why in parts: the controller may make the trainer wait for an overdue group (one long sample due at
this version), but only for that group's place in the batch. Every other place may be filled now from
the finished groups, so the trainer computes on them while the overdue one still generates, and only
its optimizer step waits for the whole batch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ..types import Group
from .buffer import RolloutBuffer
from .controller import StalenessController


async def next_batch(buffer: RolloutBuffer, controller: StalenessController, size: int, *,
                     whole: bool = False) -> AsyncIterator[list[Group]]:
    """Yield the next batch's `size` groups in parts, each as soon as the controller allows it: within
    max_staleness (or kept by policy), within the off-policy cap, oldest first. A group dropped on
    the way frees its admission slot, so a fresh group replaces it. `whole`: the next `size`
    groups in the buffer's (FIFO) order, in one part: how they were split would change the step's
    floating-point sums."""
    if whole:  # controller.deterministic: the groups were judged and placed in their batch as they finished (`Lockstep`)
        got = await buffer.get_batch(size)
        controller.consumed(got)
        yield got
        return
    taken, offpolicy = 0, 0
    while taken < size:
        room = size - taken
        # Any finished group may fill one of the places that no overdue group needs: take what is here.
        want = min(await controller.wait_takeable(room), max(1, len(buffer)))
        got = await buffer.get_batch(want, min_version=controller.min_version)
        kept, offpolicy = controller.compose(got, offpolicy_taken=offpolicy)
        controller.consumed(kept)
        taken += len(kept)
        if kept:
            yield kept
