"""RolloutManager against a real TorchEngine (LocalPool): what happens to a group at a weight update."""

from __future__ import annotations

import asyncio
from pathlib import Path

from transformers import AutoTokenizer

from streamrl.buffer import RolloutBuffer, StalenessController
from streamrl.config import ControllerConfig, RolloutConfig
from streamrl.engine import TorchEngine
from streamrl.rollout import LocalPool, RolloutManager
from streamrl.tasks import Task


async def test_interrupted_samples_wait_in_the_paused_engine_and_resume_with_new_weights(
    engine_model_dir: Path,
) -> None:
    """Paused with mode abort, the pool hands back partial samples; the manager resubmits them at once
    (kept in the manager's generating groups meanwhile), the paused engine holds them, and after the update they go on
    with the new weights: old tokens keep version 0, new ones are version 1, none is lost."""
    engine = TorchEngine(str(engine_model_dir), device="cpu", max_running_requests=8, weight_version="0")
    pool = LocalPool([engine])
    buffer = RolloutBuffer()
    task = Task(train=[{"prompt": "12+34=", "answer": "46"}], held_out=[],
                reward_fn=lambda text, answer: float(text == answer))
    manager = RolloutManager(
        RolloutConfig(group_size=4, max_new_tokens=40), pool=pool,
        tokenizer=AutoTokenizer.from_pretrained(engine_model_dir), task=task, buffer=buffer,
        controller=StalenessController(ControllerConfig(), batch_groups=1), seed=0,
    )
    await pool.start()
    producer = asyncio.create_task(manager.run())
    try:
        while engine.stats()["running"] == 0:  # the inline engine yields after every step
            await asyncio.sleep(0)
        await pool.pause("abort")  # between two steps: every running sample is interrupted
        tokens_at_pause = engine.stats()["generated_tokens"]
        for _ in range(100):
            if engine.stats()["waiting"] and engine.stats()["waiting"] == manager.num_partial:
                break
            await asyncio.sleep(0.01)
        interrupted = manager.num_partial
        assert interrupted >= 1 and engine.stats()["waiting"] == interrupted  # resubmitted, held while paused
        assert engine.stats()["generated_tokens"] == tokens_at_pause  # nothing runs while paused
        await pool.weight_sync.load({}, 1)  # a new version (same tensors): the labels are what is checked
        await pool.resume()
        [group] = await asyncio.wait_for(buffer.get_batch(1), 60)
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await pool.aclose()
    resumed = [s for s in group.samples if s.num_resumes]
    assert len(resumed) == interrupted and manager.num_partial == 0
    for s in resumed:
        k = s.versions.index(1)
        assert k >= 1 and s.versions == [0] * k + [1] * (s.num_tokens - k)
        assert s.status in ("completed", "truncated") and len(s.logprobs) == s.num_tokens


async def test_a_snapshot_taken_at_an_update_resumes_in_a_new_manager(engine_model_dir: Path) -> None:
    """Snapshot the groups being generated while the engine is paused at an update (what a checkpoint
    does), stop everything, and restore into a new manager, controller and engine at the new version:
    the same group finishes, each interrupted sample keeps its tokens (version 0) and goes on at
    version 1; the prompt stream and the sampling seeds continue where they were."""
    tok = AutoTokenizer.from_pretrained(engine_model_dir)
    prompts = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(10, 20)]

    def make(version: str) -> tuple[TorchEngine, LocalPool, RolloutBuffer, StalenessController, RolloutManager]:
        engine = TorchEngine(str(engine_model_dir), device="cpu", max_running_requests=8, weight_version=version)
        pool, buffer = LocalPool([engine]), RolloutBuffer()
        ctl = StalenessController(ControllerConfig(), batch_groups=1, max_groups=1)
        manager = RolloutManager(RolloutConfig(group_size=4, max_new_tokens=40), pool=pool, tokenizer=tok,
                                 task=Task(train=prompts, held_out=[], reward_fn=lambda text, answer: 0.0),
                                 buffer=buffer, controller=ctl, seed=3)
        return engine, pool, buffer, ctl, manager

    engine, pool, buffer, ctl, manager = make("0")
    await pool.start()
    producer = asyncio.create_task(manager.run())
    try:
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0)
        await pool.pause("abort")
        for _ in range(100):
            if manager.num_partial and engine.stats()["waiting"] == manager.num_partial:
                break
            await asyncio.sleep(0.01)
        blob, counters = manager.snapshot()
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await pool.aclose()
    assert counters["generating_groups"] == 1 and counters["prompts_drawn"] == 1 and counters["partials"] >= 1

    engine, pool, buffer, ctl, manager = make("1")
    [restored] = manager.restore(blob, prompts_drawn=counters["prompts_drawn"], next_seed=counters["next_seed"])
    before = {s.index: (list(s.response_ids), list(s.versions)) for s in restored.samples}
    partial = [i for i, s in enumerate(restored.samples) if s.status == "partial"]
    assert partial and all(before[i][0] for i in partial)  # interrupted with tokens
    ctl.restore(version=1, trained_groups=0, queued=[], generating=[restored])
    await pool.start()
    producer = asyncio.create_task(manager.run())
    try:
        [group] = await asyncio.wait_for(buffer.get_batch(1), 60)
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await pool.aclose()
    assert group.group_id == restored.group_id and manager.prompts_drawn == 1  # the budget of 1 was this group
    assert manager.num_partial == 0
    for s in group.samples:
        ids, versions = before[s.index]
        assert s.response_ids[: len(ids)] == ids and s.versions[: len(versions)] == versions  # nothing lost
        assert set(s.versions[len(versions):]) <= {1} and s.status in ("completed", "truncated")
        assert len(s.logprobs) == s.num_tokens
    assert manager.scheduling.next_seed >= counters["next_seed"] + len(partial)  # an episode seed each
