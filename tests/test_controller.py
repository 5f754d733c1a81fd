"""The off-policy ratio controller: admission (AReaL's rule), stale policy, off-policy fraction."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.buffer import RolloutBuffer, StalenessController, next_batch
from streamrl.config import ControllerConfig
from streamrl.types import Group, Sample


def controller(batch_groups: int, max_groups: int | None = None, **cfg: object) -> StalenessController:
    return StalenessController(ControllerConfig(**cfg), batch_groups=batch_groups, max_groups=max_groups)  # type: ignore[arg-type]


def group(gid: str, versions: list[int], admitted: int = 0) -> Group:
    s = Sample(group_id=gid, prompt_ids=[1])
    for v in versions:
        s.append([5], [-0.1], v)
    return Group(group_id=gid, samples=[s], admitted_version=admitted)


@pytest.mark.parametrize(("eta", "batch", "expected"), [(0, 2, 2), (1, 2, 4), (4, 3, 15)])
async def test_admission_follows_areal_rule(eta: int, batch: int, expected: int) -> None:
    c = controller(batch_groups=batch, max_staleness=eta)
    assert c.capacity() == expected
    for _ in range(expected):
        assert await c.acquire() == 0
    assert c.capacity() == 0
    c.set_version(1)
    assert c.capacity() == batch  # each version admits one more batch


async def test_acquire_waits_for_a_new_version() -> None:
    c = controller(batch_groups=1, max_staleness=0)
    await c.acquire()
    waiter = asyncio.ensure_future(c.acquire())
    await asyncio.sleep(0.01)
    assert not waiter.done()  # sync mode: the next group waits for the next weights
    c.release(0)
    await asyncio.sleep(0.01)
    assert not waiter.done()  # finishing a group does not free its slot; training on it does
    c.set_version(1)
    assert await asyncio.wait_for(waiter, 1) == 1


async def test_trainer_version_moves_first_admission_waits_for_the_engines() -> None:
    """The run loop pushes a step's weights while the trainer composes the next batch: between
    `trainer_stepped(v)` and `set_version(v)`, staleness and deadlines count against v but
    admission still counts against the engines' weights, and a group admitted then gets their
    version (its first tokens come from them)."""
    c = controller(batch_groups=2, max_staleness=1)
    for _ in range(4):
        assert await c.acquire() == 0
    assert c.capacity() == 0
    c.trainer_stepped(1)
    assert c.version == 1 and c.engine_version == 0
    assert c.capacity() == 0  # no new group until the engines hold version 1
    assert c.must_wait_for() == 2  # but the two v0 groups beyond this batch are due by version 2
    assert c.staleness(group("v0", [0])) == 1  # a v0 token is one version old for the next batch
    waiter = asyncio.ensure_future(c.acquire())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    c.set_version(1)
    assert await asyncio.wait_for(waiter, 1) == 1
    assert c.capacity() == 1


async def test_returned_slots_and_concurrency_cap() -> None:
    c = controller(batch_groups=4, max_staleness=0, max_concurrent_groups=2)
    await c.acquire()
    await c.acquire()
    assert c.capacity() == 0  # concurrency cap, not staleness
    c.release(0, returned=True)  # a failed group gives its slot back
    assert c.capacity() == 1
    assert c.started - c.returned == 1


async def test_admission_stops_at_the_runs_budget() -> None:
    c = controller(batch_groups=2, max_staleness=4, max_groups=3)
    for _ in range(3):
        await c.acquire()
    assert c.capacity() == 0  # η alone would allow 10
    c.set_version(1)
    assert c.capacity() == 0  # a new version does not extend the budget
    c.release(0, returned=True)  # a failed group is replaced
    assert c.capacity() == 1
    assert c.min_version() == 1 - 4 <= group("fresh", [0]).oldest_version()  # within η: no slot comes back
    assert c.capacity() == 1
    c.set_version(9)
    stale = group("stale", [0], admitted=0)
    assert stale.oldest_version() < c.min_version()
    assert c.capacity() == 1  # a check: it changes nothing
    c.dropped(stale)  # the buffer dropped it: its slot comes back, and it is replaced as well
    assert c.capacity() == 2


def test_stale_groups_dropped_or_kept() -> None:
    drop = controller(batch_groups=2, max_staleness=1, stale_policy="drop")
    drop.version = 3
    assert drop.min_version() == 2  # "fresh" [3, 3] and "one-behind" [2, 3] may be trained
    too_stale = group("too-stale", [1, 3])
    assert too_stale.oldest_version() < drop.min_version()
    assert drop.stats.dropped_stale == 0 and drop.returned == 0  # a check, not a decision
    drop.dropped(too_stale)
    assert drop.stats.dropped_stale == 1 and drop.stats.dropped_tokens == 2 and drop.returned == 1
    assert any("too-stale" in d for d in drop.drain_decisions())

    keep = controller(batch_groups=2, max_staleness=1, stale_policy="keep")
    keep.version = 3
    assert keep.min_version() is None  # every group may be trained
    kept, _ = keep.compose([group("too-stale", [0])])
    assert len(kept) == 1 and keep.stats.kept_stale == 1 and keep.stats.dropped_stale == 0


async def test_a_stale_group_is_counted_once_however_often_the_buffer_wakes() -> None:
    """The buffer re-applies `min_version` to its whole queue on every wake-up. Under `keep` a stale group
    stays queued through many wake-ups and is counted once, when a batch takes it; under `drop` it
    leaves the buffer on the first and is counted once."""
    for policy in ("keep", "drop"):
        c = controller(batch_groups=2, max_staleness=0, stale_policy=policy)
        buf = RolloutBuffer(on_drop=c.dropped)
        for gid in ("stale", "old"):
            await c.acquire()
            buf.put_nowait(group(gid, [0]))
        c.set_version(2)
        getter = asyncio.ensure_future(buf.get_batch(3, min_version=c.min_version))
        for i in range(5):  # five wake-ups, each re-checking the queue
            await asyncio.sleep(0)
            buf.put_nowait(group(f"fresh{i}", [2], admitted=2))
            await asyncio.sleep(0)
        got = await asyncio.wait_for(getter, 1)
        kept, _ = c.compose(got)
        if policy == "keep":
            assert [g.group_id for g in kept] == ["stale", "old", "fresh0"]
            assert (c.stats.kept_stale, c.stats.dropped_stale) == (2, 0)
        else:
            assert [g.group_id for g in kept] == ["fresh0", "fresh1", "fresh2"]
            assert (c.stats.kept_stale, c.stats.dropped_stale, c.returned, buf.total_dropped) == (0, 2, 2, 2)
        assert len(buf) == 7 - len(got) - buf.total_dropped  # what is queued, and nothing else


def test_offpolicy_fraction_caps_a_batch() -> None:
    c = controller(batch_groups=4, max_staleness=4, max_offpolicy_fraction=0.5)
    c.version = 2
    groups = [group("a", [1]), group("b", [2]), group("c", [0]), group("d", [1]), group("e", [2])]
    kept, offp = c.compose(groups)
    assert [g.group_id for g in kept] == ["a", "b", "c", "e"]  # "d" is the third off-policy group
    assert offp == 2 and c.stats.dropped_stale == 1 and c.returned == 1
    kept2, offp2 = c.compose([group("f", [1])], offpolicy_taken=offp)
    assert kept2 == [] and offp2 == 2  # the cap spans the whole batch, across calls
    on_policy_only = controller(batch_groups=4, max_staleness=4, max_offpolicy_fraction=0.0)
    on_policy_only.version = 1
    assert on_policy_only.compose([group("x", [0]), group("y", [1])])[0][0].group_id == "y"


async def test_trainer_waits_for_groups_that_would_become_too_stale() -> None:
    c = controller(batch_groups=2, max_staleness=1)
    for _ in range(4):
        await c.acquire()  # admitted at version 0: due at version 1, so two must be in this batch
    assert c.must_wait_for() == 2
    c.release(0)
    c.release(0)
    assert c.must_wait_for() == 0
    c.consumed([Group(group_id=f"g{i}", samples=[], admitted_version=0) for i in range(2)])
    c.set_version(1)
    assert c.must_wait_for() == 2  # the other two are due now
    waiter = asyncio.ensure_future(c.wait_takeable(2))
    await asyncio.sleep(0.01)
    assert not waiter.done()  # no place of the batch may be filled before one of them finishes
    c.release(0)
    assert await asyncio.wait_for(waiter, 1) == 1  # the finished one may go in; the other's place waits
    c.release(0)
    assert c.must_wait_for() == 0


async def test_newer_short_groups_do_not_crowd_out_old_long_ones() -> None:
    """B=2, eta=2: six groups start at version 0, four of them long. Were the trainer to fill its
    batches with whatever finished first (two short v0 groups, then two short v1 groups), four v0
    groups would be due at version 2 and two of them dropped. The controller makes it wait for old
    groups early enough, and the buffer pops them first."""
    c = controller(batch_groups=2, max_staleness=2)
    buf = RolloutBuffer()
    groups = {}
    for i in range(6):
        a = await c.acquire()
        groups[i] = Group(group_id=f"g{i}", samples=[], admitted_version=a)

    async def finish(i: int) -> None:
        await buf.put(groups[i])
        c.release(groups[i].admitted_version)

    async def take() -> list[str]:
        return [g.group_id async for part in next_batch(buf, c, 2) for g in part]

    await finish(4)
    await finish(5)
    assert await take() == ["g4", "g5"]  # version 0: nothing old is due yet
    c.set_version(1)
    for i in (6, 7):
        a = await c.acquire()
        groups[i] = Group(group_id=f"g{i}", samples=[], admitted_version=a)
        await finish(i)
    assert c.must_wait_for() == 2  # four v0 groups are due by version 2: two must go now
    waiter = asyncio.ensure_future(take())
    await asyncio.sleep(0.01)
    assert not waiter.done()  # g6, g7 are finished, but taking them would strand v0 groups
    await finish(0)
    await finish(1)
    assert sorted(await asyncio.wait_for(waiter, 1)) == ["g0", "g1"]
    c.set_version(2)
    await finish(2)
    await finish(3)
    assert await take() == ["g2", "g3"]
    assert c.stats.dropped_stale == 0


async def test_a_restored_controller_admits_and_waits_like_the_original() -> None:
    """B = 2, η = 2: after one trained batch, a controller restored from the queued and generating
    groups (by their admission versions) has the same capacity and the same deadlines."""
    c = controller(batch_groups=2, max_staleness=2, max_groups=12)
    admitted = [Group(group_id=f"g{i}", samples=[], admitted_version=await c.acquire()) for i in range(6)]
    for _ in range(4):
        c.release(0)
    c.consumed(admitted[:2])
    c.set_version(1)
    admitted += [Group(group_id=f"n{i}", samples=[], admitted_version=await c.acquire()) for i in range(1)]
    queued, generating = admitted[2:4], [*admitted[4:6], admitted[6]]
    r = controller(batch_groups=2, max_staleness=2, max_groups=12)
    r.restore(version=1, trained_groups=2, queued=queued, generating=generating)
    assert (r.capacity(), r.must_wait_for(), r.running) == (c.capacity(), c.must_wait_for(), c.running) == (1, 0, 3)
    for ctl in (c, r):
        ctl.consumed(queued)
        ctl.set_version(2)
    assert r.must_wait_for() == c.must_wait_for() == 2  # the two v0 groups still generating are due now
    for ctl in (c, r):
        ctl.release(0)
    assert r.must_wait_for() == c.must_wait_for() == 1
    assert r.capacity() == c.capacity() == 3


async def test_next_batch_starts_on_finished_groups_while_an_overdue_one_generates() -> None:
    """B = 2, η = 1, version 1: a v0 group is due now and still generating (a long sample), two v1
    groups have finished. The trainer gets one v1 group at once (the other place is the v0 group's)
    and the v0 group the moment it finishes; it never takes the second v1 group instead, which would
    leave the v0 group one version too stale. Nothing is dropped."""
    c = controller(batch_groups=2, max_staleness=1)
    buf = RolloutBuffer()
    old = Group(group_id="old", samples=[], admitted_version=await c.acquire())
    c.set_version(1)
    new = [Group(group_id=f"new{i}", samples=[], admitted_version=await c.acquire()) for i in range(2)]
    for g in new:
        await buf.put(g)
        c.release(1)
    assert (c.must_wait_for(), c.takeable(2), c.takeable(1)) == (1, 1, 0)
    parts = next_batch(buf, c, 2)
    assert [g.group_id for g in await asyncio.wait_for(anext(parts), 1)] == ["new0"]
    second = asyncio.ensure_future(anext(parts))
    await asyncio.sleep(0.02)
    assert not second.done()  # the rest of the batch is the overdue group, still generating
    await buf.put(old)
    c.release(0)
    assert [g.group_id for g in await asyncio.wait_for(second, 1)] == ["old"]
    assert await anext(parts, None) is None
    assert [g.group_id for g in buf.peek()] == ["new1"] and c.stats.dropped_stale == 0


async def test_next_batch_takes_a_free_batch_at_once_and_whatever_is_ready_when_short() -> None:
    """Nothing due: the whole batch comes as one part when it is there; when only some groups have
    finished (the trainer is ahead of generation), those come first and the rest as they finish."""
    c = controller(batch_groups=3, max_staleness=2)
    buf = RolloutBuffer()
    gs = [Group(group_id=f"g{i}", samples=[], admitted_version=await c.acquire()) for i in range(6)]
    for g in gs[:3]:
        await buf.put(g)
        c.release(0)
    assert c.takeable(3) == 3
    assert [[g.group_id for g in p] async for p in next_batch(buf, c, 3)] == [["g0", "g1", "g2"]]
    await buf.put(gs[3])
    c.release(0)
    parts = next_batch(buf, c, 3)
    assert [g.group_id for g in await anext(parts)] == ["g3"]
    nxt = asyncio.ensure_future(anext(parts))
    await asyncio.sleep(0.02)
    assert not nxt.done()
    for g in gs[4:]:
        await buf.put(g)
        c.release(0)
    rest = [g.group_id for g in await asyncio.wait_for(nxt, 1)]
    if rest != ["g4", "g5"]:  # the two may arrive as one part or as two
        rest += [g.group_id for g in await asyncio.wait_for(anext(parts), 1)]
    assert rest == ["g4", "g5"]
    assert await anext(parts, None) is None
