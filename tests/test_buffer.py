"""RolloutBuffer: priority order, waiting, back-pressure, min_version and drops, close, save/restore, and
that it holds what is queued and nothing else."""

import asyncio

import pytest

from streamrl.buffer import BufferClosed, BufferFull, RolloutBuffer
from streamrl.config import BufferConfig
from streamrl.types import Group, Sample


def group(gid: str, version: int, n: int = 2) -> Group:
    samples = [Sample(group_id=gid, index=i, prompt_ids=[1, 2]) for i in range(n)]
    for s in samples:
        s.append([3, 4], [-0.5, -0.25], version)
    return Group(group_id=gid, samples=samples, admitted_version=version)


def ids(groups: list[Group]) -> list[str]:
    return [g.group_id for g in groups]


async def test_oldest_version_first_ties_fifo() -> None:
    buf = RolloutBuffer()
    for gid, v in [("a", 3), ("b", 1), ("c", 2), ("d", 1), ("e", 0)]:
        await buf.put(group(gid, v))
    assert buf.oldest_version() == 0
    assert ids(await buf.get_batch(5)) == ["e", "b", "d", "c", "a"]
    assert buf.total_put == 5 and buf.total_got == 5 and len(buf) == 0


async def test_oldest_version_uses_the_oldest_token() -> None:
    buf = RolloutBuffer()
    mixed = group("mixed", 5)
    mixed.samples[0].append([9], [-1.0], 1)  # one resumed sample carries a token from version 1
    await buf.put(group("plain", 2))
    await buf.put(mixed)
    assert ids(await buf.get_batch(2)) == ["mixed", "plain"]


async def test_fifo() -> None:
    buf = RolloutBuffer(BufferConfig(priority="fifo"))
    for gid, v in [("a", 3), ("b", 1), ("c", 2)]:
        buf.put_nowait(group(gid, v))
    assert ids(await buf.get_batch(2)) == ["a", "b"]
    assert ids(await buf.get_batch(1)) == ["c"]


async def test_get_batch_waits_for_later_puts() -> None:
    buf = RolloutBuffer()
    task = asyncio.create_task(buf.get_batch(2))
    await asyncio.sleep(0)
    buf.put_nowait(group("a", 0))
    await asyncio.sleep(0)
    assert not task.done()
    await buf.put(group("b", 0))
    assert ids(await asyncio.wait_for(task, 1)) == ["a", "b"]


async def test_timeout_consumes_nothing() -> None:
    buf = RolloutBuffer()
    buf.put_nowait(group("a", 0))
    with pytest.raises(TimeoutError):
        await buf.get_batch(2, timeout=0.01)
    assert len(buf) == 1 and buf.total_got == 0


async def test_capacity_back_pressure() -> None:
    buf = RolloutBuffer(BufferConfig(capacity=2))
    await buf.put(group("a", 0))
    await buf.put(group("b", 0))
    assert buf.is_full()
    with pytest.raises(BufferFull):
        buf.put_nowait(group("x", 0))
    blocked = asyncio.create_task(buf.put(group("c", 0)))
    await asyncio.sleep(0.01)
    assert not blocked.done() and len(buf) == 2
    assert ids(await buf.get_batch(1)) == ["a"]
    await asyncio.wait_for(blocked, 1)
    assert ids(await buf.get_batch(2)) == ["b", "c"]
    with pytest.raises(ValueError):
        await buf.get_batch(3)  # could never fill


async def test_min_version_drops_and_reports_once() -> None:
    seen: list[str] = []
    buf = RolloutBuffer(on_drop=lambda g: seen.append(g.group_id))
    for gid, v in [("old", 0), ("new1", 3), ("older", 1), ("new2", 4)]:
        buf.put_nowait(group(gid, v))
    trainer_version = 4

    def fresh() -> int:  # at most one version behind the trainer
        return trainer_version - 1

    batch = await buf.get_batch(2, min_version=fresh)
    assert ids(batch) == ["new1", "new2"]
    assert seen == ["old", "older"] and buf.total_dropped == 2 and len(buf) == 0
    await buf.put(group("new3", 4))
    assert ids(await buf.get_batch(1, min_version=fresh)) == ["new3"]
    assert seen == ["old", "older"]  # each drop reported once, and nothing of it kept


async def test_min_version_is_asked_again_while_waiting() -> None:
    seen: list[str] = []
    buf = RolloutBuffer(BufferConfig(capacity=2), on_drop=lambda g: seen.append(g.group_id))
    limit = {"min_version": 0}
    buf.put_nowait(group("a", 0))
    task = asyncio.create_task(buf.get_batch(2, min_version=lambda: limit["min_version"]))
    await asyncio.sleep(0)
    limit["min_version"] = 1  # the trainer moved on while the getter waited
    buf.put_nowait(group("b", 1))
    await asyncio.sleep(0)
    buf.put_nowait(group("c", 2))  # fits: "a" was rejected when the getter woke for "b"
    assert ids(await asyncio.wait_for(task, 1)) == ["b", "c"]
    assert seen == ["a"]


async def test_rejection_frees_capacity() -> None:
    buf = RolloutBuffer(BufferConfig(capacity=1))
    buf.put_nowait(group("stale", 0))
    blocked = asyncio.create_task(buf.put(group("fresh", 5)))
    getter = asyncio.create_task(buf.get_batch(1, min_version=lambda: 1))
    await asyncio.wait_for(blocked, 1)
    assert ids(await asyncio.wait_for(getter, 1)) == ["fresh"]


async def test_close_semantics() -> None:
    buf = RolloutBuffer()
    waiting = asyncio.create_task(buf.get_batch(1))
    await asyncio.sleep(0)
    buf.close()
    with pytest.raises(BufferClosed):
        await waiting
    with pytest.raises(BufferClosed):
        await buf.put(group("x", 0))

    buf = RolloutBuffer()
    for gid in "abc":
        buf.put_nowait(group(gid, 0))
    buf.close()
    buf.close()  # idempotent
    assert ids(await buf.get_batch(2)) == ["a", "b"]
    assert ids(await buf.get_batch(2)) == ["c"]  # short only because closed
    with pytest.raises(BufferClosed):
        await buf.get_batch(2)


async def test_close_wakes_blocked_put() -> None:
    buf = RolloutBuffer(BufferConfig(capacity=1))
    buf.put_nowait(group("a", 0))
    blocked = asyncio.create_task(buf.put(group("b", 0)))
    await asyncio.sleep(0)
    buf.close()
    with pytest.raises(BufferClosed):
        await blocked


async def test_the_buffer_holds_what_is_queued_and_nothing_else() -> None:
    """A long run's worth of traffic (puts, batches, drops): the snapshot grows with the queue only."""
    buf = RolloutBuffer(on_drop=lambda g: None)
    version = 0
    sizes = []
    for i in range(400):
        buf.put_nowait(group(f"g{i}", i // 4))
        if i % 4 == 3:
            version = i // 4
            await buf.get_batch(2, min_version=lambda v=version: v - 1)
            sizes.append(len(buf.state_dict()))
    assert len(buf) <= 6 and buf.total_dropped > 100 and buf.total_put == buf.total_got + buf.total_dropped + len(buf)
    assert max(sizes) < 3 * min(sizes)  # 100 rounds of drops later, no bigger than after the first


@pytest.mark.parametrize("priority", ["oldest_version", "fifo"])
async def test_state_round_trip(priority: str) -> None:
    buf = RolloutBuffer(BufferConfig(priority=priority))
    for gid, v in [("a", 2), ("b", 0), ("c", 2), ("d", 1), ("e", 0)]:
        buf.put_nowait(group(gid, v))
    oldest_first = priority == "oldest_version"
    assert ids(await buf.get_batch(1)) == (["b"] if oldest_first else ["a"])
    # Version-0 groups are dropped: "e" (oldest first), "b" and "e" (fifo).
    assert ids(await buf.get_batch(1, min_version=lambda: 1)) == (["d"] if oldest_first else ["c"])

    restored = RolloutBuffer(BufferConfig(priority=priority))
    restored.load_state_dict(buf.state_dict())
    assert len(restored) == len(buf) == (2 if oldest_first else 1)
    assert (restored.total_put, restored.total_got, restored.total_dropped) == (5, 2, 1 if oldest_first else 2)

    # later puts tie-break after restored groups, exactly as they would have in the original
    for b in (buf, restored):
        b.put_nowait(group("f", 0))
        b.put_nowait(group("g", 2))
    n = len(buf)
    expected = ids(await buf.get_batch(n))
    assert ids(await restored.get_batch(n)) == expected
    assert expected == (["f", "a", "c", "g"] if oldest_first else ["d", "f", "g"])
