"""RolloutBuffer: priority order, waiting, back-pressure, accept/rejected, close, stream, save/restore."""

import asyncio

import pytest

from streamrl.buffer import BufferClosed, BufferFull, RolloutBuffer
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
    buf = RolloutBuffer(priority="fifo")
    for gid, v in [("a", 3), ("b", 1), ("c", 2)]:
        buf.put_nowait(group(gid, v))
    assert ids(await buf.get_batch(2)) == ["a", "b"]
    assert ids(await buf.get_batch(1)) == ["c"]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        RolloutBuffer(priority="newest")
    with pytest.raises(ValueError):
        RolloutBuffer(capacity=0)


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
    buf = RolloutBuffer(capacity=2)
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


async def test_accept_rejects_and_reports() -> None:
    seen: list[str] = []
    buf = RolloutBuffer(on_reject=lambda g: seen.append(g.group_id))
    for gid, v in [("old", 0), ("new1", 3), ("older", 1), ("new2", 4)]:
        buf.put_nowait(group(gid, v))
    trainer_version = 4

    def fresh(g: Group) -> bool:
        return trainer_version - g.oldest_version() <= 1

    batch = await buf.get_batch(2, accept=fresh)
    assert ids(batch) == ["new1", "new2"]
    assert seen == ["old", "older"] and buf.total_rejected == 2
    assert ids(buf.drain_rejected()) == ["old", "older"]
    assert buf.drain_rejected() == []


async def test_accept_is_reapplied_while_waiting() -> None:
    buf = RolloutBuffer(capacity=2)
    limit = {"min_version": 0}
    buf.put_nowait(group("a", 0))
    task = asyncio.create_task(buf.get_batch(2, accept=lambda g: g.oldest_version() >= limit["min_version"]))
    await asyncio.sleep(0)
    limit["min_version"] = 1  # the trainer moved on while the getter waited
    buf.put_nowait(group("b", 1))
    await asyncio.sleep(0)
    buf.put_nowait(group("c", 2))  # fits: "a" was rejected when the getter woke for "b"
    assert ids(await asyncio.wait_for(task, 1)) == ["b", "c"]
    assert ids(buf.drain_rejected()) == ["a"]


async def test_rejection_frees_capacity() -> None:
    buf = RolloutBuffer(capacity=1)
    buf.put_nowait(group("stale", 0))
    blocked = asyncio.create_task(buf.put(group("fresh", 5)))
    getter = asyncio.create_task(buf.get_batch(1, accept=lambda g: g.oldest_version() > 0))
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
    buf = RolloutBuffer(capacity=1)
    buf.put_nowait(group("a", 0))
    blocked = asyncio.create_task(buf.put(group("b", 0)))
    await asyncio.sleep(0)
    buf.close()
    with pytest.raises(BufferClosed):
        await blocked


async def test_stream() -> None:
    buf = RolloutBuffer()

    async def produce() -> None:
        for i in range(5):
            await buf.put(group(f"g{i}", i))
            await asyncio.sleep(0)
        buf.close()

    producer = asyncio.create_task(produce())
    batches = [ids(b) async for b in buf.stream(2)]
    await producer
    assert batches == [["g0", "g1"], ["g2", "g3"], ["g4"]]


async def test_partials() -> None:
    buf = RolloutBuffer()
    s = Sample(group_id="g", prompt_ids=[1], status="partial")
    s.append([5], [-0.1], 0)
    buf.park_partial(s)
    assert buf.num_partials == 1
    assert buf.take_partials() == [s]
    assert buf.take_partials() == [] and buf.num_partials == 0


@pytest.mark.parametrize("priority", ["oldest_version", "fifo"])
async def test_state_round_trip(priority: str) -> None:
    buf = RolloutBuffer(priority=priority)
    for gid, v in [("a", 2), ("b", 0), ("c", 2), ("d", 1), ("e", 0)]:
        buf.put_nowait(group(gid, v))
    await buf.get_batch(1)
    await buf.get_batch(1, accept=lambda g: g.group_id != "c")  # "c" is rejected
    partial = Sample(group_id="p", prompt_ids=[7, 8], status="partial", meta={"answer": "15"})
    partial.append([1, 2], [-0.3, -0.4], 1)
    buf.park_partial(partial)

    restored = RolloutBuffer(priority=priority)
    restored.load_state_dict(buf.state_dict())
    assert len(restored) == len(buf) == 2
    assert (restored.total_put, restored.total_got, restored.total_rejected) == (5, 2, 1)
    assert ids(restored.drain_rejected()) == ids(buf.drain_rejected())
    assert restored.take_partials() == buf.take_partials() == [partial]

    # later puts tie-break after restored groups, exactly as they would have in the original
    for b in (buf, restored):
        b.put_nowait(group("f", 0))
        b.put_nowait(group("g", 2))
    expected = ids(await buf.get_batch(4))
    assert ids(await restored.get_batch(4)) == expected
    if priority == "oldest_version":
        assert expected == ["f", "d", "a", "g"]
    else:
        assert expected == ["d", "e", "f", "g"]


def test_unpark_partial_takes_back_one_sample() -> None:
    from streamrl.buffer import RolloutBuffer
    from streamrl.types import Sample

    buf = RolloutBuffer()
    a, b = Sample(group_id="a", prompt_ids=[1]), Sample(group_id="b", prompt_ids=[1])
    buf.park_partial(a)
    buf.park_partial(b)
    assert buf.unpark_partial(a) and not buf.unpark_partial(a)
    assert buf.take_partials() == [b]
