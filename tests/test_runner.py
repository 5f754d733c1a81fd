"""The runner (rollout/runner.py): the one place a sample's requests are made. Partial resume across a
weight update is driven here through the single-turn workflow and a multi-turn one, against a pool
that interrupts requests as a weight update does; and every request is sampled as the rollout says,
held-out evaluation included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from streamrl.buffer import RolloutBuffer, StalenessController
from streamrl.config import ControllerConfig, RolloutConfig, ToolsConfig
from streamrl.engine import build_result
from streamrl.engine.protocol import finish_reason
from streamrl.rollout import EnginePool, RolloutManager, ToolBox
from streamrl.tasks import Task
from streamrl.types import Sample

HERE = Path(__file__).parent
PROMPT = [1, 5, 6]


class Tok:
    """Token ids as text: enough for decoding, tools' observations and prompts."""

    bos_token_id = 1

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [4 + (ord(c) % 10) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


class InterruptingPool(EnginePool):
    """Answers every request with tokens 100, 101, ...; the first request of each sample's turn (a rid
    but its last part, the resume count, not seen before) stops after `cut` tokens, aborted, as a weight
    update ends it; the rest finish with version 1. Records every call: prompts, parameters, rids."""

    def __init__(self, cut: int = 3) -> None:
        super().__init__()
        self.cut, self.num_replicas = cut, 1
        self.calls: list[tuple[list[list[int]], list[dict[str, Any]], list[str]]] = []
        self.seen: set[str] = set()

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]:
        return (await self.generate_many([input_ids], [sampling_params], [rid]))[0]

    async def generate_many(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]],
                            rids: list[str]) -> list[dict[str, Any]]:
        self.calls.append(([list(i) for i in input_ids], [dict(p) for p in sampling_params], list(rids)))
        out = []
        for p, rid in zip(sampling_params, rids, strict=True):
            first = rid.rsplit("-", 1)[0] not in self.seen
            self.seen.add(rid.rsplit("-", 1)[0])
            n = min(self.cut, p["max_new_tokens"]) if first else p["max_new_tokens"]
            ids = list(range(100, 100 + n))
            out.append(build_result(rid=rid, text="", output_ids=ids, logprobs=[-0.5] * n, prompt_tokens=0,
                                    weight_version="0" if first else "1",
                                    finish=finish_reason("abort" if first else "length")))
        return out

    async def abort_all(self) -> None: ...

    async def _pause_all(self, mode: str) -> None: ...

    async def _resume_all(self) -> None: ...

    def stats(self) -> dict[str, Any]:
        return {"running": 0, "busy_s": 0.0, "prefill_s": 0.0}


def manager(pool: EnginePool, *, workflow: str = "single_turn", partial: str = "resume", group_size: int = 3,
            tools: ToolBox | None = None, max_new_tokens: int = 10, **rollout: Any) -> tuple[RolloutManager, RolloutBuffer]:
    ctl = StalenessController(ControllerConfig(), batch_groups=1, max_groups=1)
    buffer = RolloutBuffer()
    task = Task(train=[{"prompt": "ab", "answer": ""}], held_out=[{"prompt": "ab", "answer": ""}] * 2,
                reward_fn=lambda text, answer: 0.0)
    cfg = RolloutConfig(group_size=group_size, max_new_tokens=max_new_tokens, workflow=workflow, partial=partial,
                        **rollout)
    return RolloutManager(cfg, pool=pool, tokenizer=Tok(), task=task, buffer=buffer, controller=ctl,
                          tools=tools), buffer


async def one_group(m: RolloutManager, buffer: RolloutBuffer) -> list[Sample]:
    import asyncio

    producer = asyncio.create_task(m.run())
    try:
        [group] = await asyncio.wait_for(buffer.get_batch(1), 30)
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
    return group.samples


async def test_single_turn_resumes_an_interrupted_sample_from_its_tokens() -> None:
    pool = InterruptingPool(cut=3)
    m, buffer = manager(pool)
    samples = await one_group(m, buffer)
    # Two rounds, each the whole group in one call (one HTTP request where the server takes batches).
    assert [len(ids) for ids, _, _ in pool.calls] == [3, 3]
    (first, p1, _), (second, p2, rids) = pool.calls
    assert all(ids == [1, 4 + ord("a") % 10, 4 + ord("b") % 10] for ids in first)
    for s, ids, params, rid in zip(samples, second, p2, rids, strict=True):
        assert ids == first[0] + [100, 101, 102]  # prompt + the interrupted tokens: nothing regenerated
        assert params["max_new_tokens"] == 7 and rid == f"{s.group_id}-{s.index}-1"  # the budget left
        assert s.response_ids == [100, 101, 102] + list(range(100, 107)) and s.versions == [0] * 3 + [1] * 7
        assert s.num_resumes == 1 and s.status == "truncated" and s.finish_reason == "length"
        assert len(s.logprobs) == len(s.loss_mask) == 10 and not s.turns  # single-turn: no journal
    assert len({p["sampling_seed"] for p in p1}) == 3  # every sample draws its own tokens
    c = m.counters
    assert c.partial_resumed == 3 and c.tokens_generated == 30 and c.tokens_discarded == 0


async def test_single_turn_discard_restarts_an_interrupted_sample() -> None:
    pool = InterruptingPool(cut=3)
    m, buffer = manager(pool, partial="discard")
    samples = await one_group(m, buffer)
    (first, _, _), (second, p2, _) = pool.calls
    assert second == first and all(p["max_new_tokens"] == 10 for p in p2)  # from the prompt again
    assert all(s.response_ids == list(range(100, 110)) and s.versions == [1] * 10 for s in samples)
    assert m.counters.tokens_discarded == 9


async def test_a_multi_turn_sample_resumes_its_turn_and_never_reruns_its_tool() -> None:
    """`two_turns`: a 4-token model turn, one tool call, a long model turn, each model turn interrupted
    after 3 tokens. An interrupted turn goes on from its tokens in the same journal entry, within the
    sample's budget; the tool runs once."""
    pool = InterruptingPool(cut=3)
    tools = ToolBox(ToolsConfig(functions=[f"count={HERE / 'workflows_for_tests.py'}:count"]))
    m, buffer = manager(pool, workflow=f"{HERE / 'workflows_for_tests.py'}:two_turns", group_size=1, tools=tools,
                        max_new_tokens=40)
    [s] = await one_group(m, buffer)
    model, tool, last = s.turns
    assert (model.kind, model.start, model.end, model.finish) == ("model", 0, 4, "length")
    assert s.response_ids[:4] == [100, 101, 102, 100] and s.versions[:4] == [0, 0, 0, 1]  # 3 kept + 1 after
    assert tool.kind == "tool" and s.loss_mask[tool.start:tool.end] == [0] * (tool.end - tool.start)
    assert (last.start, last.end, last.finish) == (tool.end, 40, "length")  # the sample's whole budget
    assert s.response_ids[tool.end:] == [100, 101, 102] + list(range(100, 37 - tool.end + 100))
    rids = [r for _, _, rs in pool.calls for r in rs]
    g = s.group_id
    assert rids == [f"{g}-0-t1-0", f"{g}-0-t1-1", f"{g}-0-t3-1", f"{g}-0-t3-2"]  # -N: the sample's resumes so far
    (p0,), (p1,), (p2,), (p3,) = [ids for ids, _, _ in pool.calls]
    assert p1 == p0 + [100, 101, 102] and p3 == p2 + [100, 101, 102]  # resubmitted with the tokens so far
    assert [ps[0]["max_new_tokens"] for _, ps, _ in pool.calls] == [4, 1, 40 - tool.end, 37 - tool.end]
    calls = tools.tools["count"].__globals__["CALLS"]  # the tool module's log, as loaded from its file
    assert s.num_resumes == 2 and m.counters.partial_resumed == 2 and calls == [f"{g}-0"]


@pytest.mark.parametrize("workflow", ["single_turn", f"{HERE / 'workflows_for_tests.py'}:two_turns"])
async def test_held_out_evaluation_samples_as_training_does(workflow: str) -> None:
    """top_p and top_k of the rollout reach every request, training's and the evaluation's (which only
    sets its own temperature and seed), whatever the workflow."""
    pool = InterruptingPool(cut=100)
    tools = ToolBox(ToolsConfig(functions=[f"count={HERE / 'workflows_for_tests.py'}:count"]))
    m, buffer = manager(pool, workflow=workflow, group_size=2, top_p=0.9, top_k=5, temperature=0.7, tools=tools)
    await one_group(m, buffer)
    trained = [p for _, ps, _ in pool.calls for p in ps]
    pool.calls.clear()
    await m.evaluate(temperature=0.0, seed=7)
    held_out = [p for _, ps, _ in pool.calls for p in ps]
    assert trained and held_out
    assert all(p["top_p"] == 0.9 and p["top_k"] == 5 and p["temperature"] == 0.7 for p in trained)
    assert all(p["top_p"] == 0.9 and p["top_k"] == 5 and p["temperature"] == 0.0 for p in held_out)
