"""Multi-turn workflows: tools, masked observations, turns across weight updates and checkpoints, chat
prompts. The real TorchEngine where generation matters; a scripted pool (a mock, inside this unit test
of the workflow's parsing) where the model would have to choose to call a tool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.buffer import RolloutBuffer, StalenessController
from streamrl.config import ControllerConfig, RolloutConfig, ToolsConfig, TrainerConfig
from streamrl.engine import TorchEngine, build_result
from streamrl.engine.protocol import finish_reason
from streamrl.rollout import EnginePool, LocalPool, RolloutManager, ToolBox
from streamrl.rollout.runner import Episode, encode_prompt
from streamrl.tasks import Task
from streamrl.trainer.logprobs import pack_samples, token_logprobs
from streamrl.trainer.losses import policy_loss
from streamrl.types import Group, Sample

HERE = Path(__file__).parent
SPEC = f"{HERE / 'workflows_for_tests.py'}"


def manager_for(pool: EnginePool, tokenizer: Any, *, workflow: str, tools: list[str], group_size: int = 4,
                timeout_s: float = 5.0, max_new_tokens: int = 60, max_groups: int | None = 1,
                version: int = 0, max_turns: int = 4) -> tuple[RolloutManager, RolloutBuffer, StalenessController]:
    ctl = StalenessController(ControllerConfig(), batch_groups=1, max_groups=max_groups)
    ctl.version = ctl.engine_version = version
    buffer = RolloutBuffer()
    task = Task(train=[{"prompt": "12+34=", "answer": "46"}], held_out=[], reward_fn=lambda text, answer: 0.0)
    manager = RolloutManager(RolloutConfig(group_size=group_size, max_new_tokens=max_new_tokens, workflow=workflow,
                                           max_turns=max_turns),
                             pool=pool, tokenizer=tokenizer, task=task, buffer=buffer, controller=ctl,
                             tools=ToolBox(ToolsConfig(functions=tools, timeout_s=timeout_s)))
    return manager, buffer, ctl


@contextlib.asynccontextmanager
async def producing(manager: RolloutManager) -> AsyncIterator[None]:
    """The manager's loop running for the block's life; then stopped and closed."""
    producer = asyncio.create_task(manager.run())
    try:
        yield
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await manager.aclose()


def calls(manager: RolloutManager) -> list[str]:
    """The `count` tool's log, read from the module the manager loaded it from."""
    return manager.ctx.tools.tools["count"].__globals__["CALLS"]  # type: ignore[union-attr]


# ---- the loss ignores tool tokens -----------------------------------------------------------------
def test_tool_output_tokens_get_zero_gradient(agent_model_dir: Path) -> None:
    """A real forward and backward through the model: d loss / d logp is 0 at every masked (tool)
    position and not at the model's own tokens, which still read the tool tokens as context."""
    model = AutoModelForCausalLM.from_pretrained(agent_model_dir, dtype=torch.float32)
    samples = []
    for i in range(2):
        s = Sample(group_id="g", index=i, prompt_ids=[1, 5, 6, 14], reward=float(i))
        s.append([7, 8, 9], [-1.0, -1.2, -0.9], 0)  # the model's call
        s.append([10, 11, 12, 13], [0.0] * 4, 0, trainable=False)  # the tool's answer
        s.append([4 + i, 5], [-0.7, -0.8], 0)  # the model's answer
        samples.append(s)
    batch = pack_samples(samples, pad_id=0)
    logp = token_logprobs(model, batch.input_ids, batch.attention_mask)
    logp.retain_grad()
    # On-policy (behaviour = the model's own logprobs): the ratio is 1, so no clip hides a gradient.
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([-1.0, 1.0]), batch.response_mask,
                          TrainerConfig(loss="grpo"))
    loss.backward()
    grad = logp.grad
    assert grad is not None
    for b in range(2):
        tool = slice(4 + 3, 4 + 7)
        assert torch.all(grad[b, tool] == 0)
        assert torch.all(grad[b, 4:7] != 0) and torch.all(grad[b, 11:13] != 0)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


# ---- multi_turn_tools: parsing, observations, errors ----------------------------------------------
class ScriptedPool(EnginePool):
    """Answers each request with the next text of a script (a mock model that decides to call tools)."""

    def __init__(self, tokenizer: Any, script: list[str]) -> None:
        super().__init__()
        self.tok, self.script, self.num_replicas = tokenizer, list(script), 1
        self.requests: list[list[int]] = []

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]:
        self.requests.append(list(input_ids))
        text = self.script.pop(0)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return build_result(rid=rid, text=text, output_ids=ids, logprobs=[-0.5] * len(ids),
                            finish=finish_reason("stop"), prompt_tokens=len(input_ids), weight_version="0")

    async def abort_all(self) -> None: ...

    async def _pause_all(self, mode: str) -> None: ...

    async def _resume_all(self) -> None: ...

    def stats(self) -> dict[str, Any]:
        return {"running": 0, "busy_s": 0.0, "prefill_s": 0.0}


async def test_multi_turn_tools_runs_each_call_and_masks_its_observation(agent_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(agent_model_dir)
    script = ["12*3=<tool>calculator: 12*3</tool>", "36<tool>calculator: 1:2</tool>", "<tool>nope: 1</tool>",
              "<tool>slow: 1</tool>", "<tool>broken: 1</tool>", "36"]
    pool = ScriptedPool(tok, script)
    manager, buffer, _ = manager_for(pool, tok, workflow="multi_turn_tools", group_size=1, timeout_s=0.2,
                                     tools=["calculator", f"slow={SPEC}:slow", f"broken={SPEC}:broken"],
                                     max_new_tokens=400, max_turns=8)
    producer = asyncio.create_task(manager.run())
    try:
        [group] = await asyncio.wait_for(buffer.get_batch(1), 30)
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
    [s] = group.samples
    kinds = [(t.kind, t.tool, t.error is not None) for t in s.turns]
    assert kinds == [("model", None, False), ("tool", "calculator", False), ("model", None, False),
                     ("tool", "calculator", True), ("model", None, False), ("tool", "nope", True),
                     ("model", None, False), ("tool", "slow", True), ("model", None, False),
                     ("tool", "broken", True), ("model", None, False)]
    text = tok.decode(s.response_ids, skip_special_tokens=False)
    # (The tiny vocabulary has no capitals, dots or quotes: the observations read without them.)
    assert "<result>36</result>" in text and "error: timed out after" in s.response_text
    assert "the tools backend is down</result>36" in s.response_text
    for t in s.turns:  # model tokens are trained on, tool tokens never
        assert set(s.loss_mask[t.start:t.end]) <= ({1} if t.kind == "model" else {0})
    # Each model turn was asked with everything before it: prompt, earlier turns, observations.
    assert pool.requests[1] == s.prompt_ids + s.response_ids[:s.turns[2].start]
    c = manager.counters
    assert (c.tool_calls, c.tool_errors) == (5, 4) and c.tool_s > 0.2
    assert s.status == "completed" and s.finish_reason == "stop"


def test_a_bad_workflow_or_tool_is_a_config_error(tmp_path: Path) -> None:
    from streamrl.config import ConfigError, config_from_dict
    from streamrl.rollout import preflight

    def check(**sections: Any) -> str:
        with pytest.raises(ConfigError) as info:
            preflight(config_from_dict({"run_dir": str(tmp_path), **sections}, check_paths=False))
        return str(info.value)

    assert check(rollout={"workflow": f"{SPEC}:nothing"}).startswith("config error: rollout.workflow: workflow")
    assert check(rollout={"workflow": "multi_turn_tools"}, tools={"functions": [f"x={SPEC}:nothing"]}).startswith(
        "config error: tools.functions: tool")
    with pytest.raises(ConfigError, match=r"tools.functions\[0\]: expected 'calculator' or 'name=module:function'"):
        config_from_dict({"tools": {"functions": ["abacus"]}}, check_paths=False)


# ---- turns across weight updates and checkpoints (the real engine) --------------------------------
async def _until(cond: Any, timeout: float = 60) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


async def update_weights_mid_turn(pool: LocalPool, engine: TorchEngine, running: int, version: int = 1) -> None:
    """A weight update with `pause_mode: abort` while `running` requests are in the engine: they come back
    as partials, are sent again and wait in the paused engine, which then gets the new version."""
    await pool.pause("abort")
    await _until(lambda: engine.stats()["waiting"] == running)
    await pool.weight_sync.load({}, version)
    await pool.resume()


async def test_an_interrupted_turn_resumes_with_the_new_weights_and_no_tool_runs_twice(
    agent_model_dir: Path,
) -> None:
    engine = TorchEngine(str(agent_model_dir), device="cpu", max_running_requests=8, weight_version="0")
    pool = LocalPool([engine])
    tok = AutoTokenizer.from_pretrained(agent_model_dir)
    manager, buffer, _ = manager_for(pool, tok, workflow=f"{SPEC}:two_turns", tools=[f"count={SPEC}:count"])
    calls(manager).clear()
    await pool.start()
    producer = asyncio.create_task(manager.run())
    try:
        # Every sample in its second model turn, a few tokens into it.
        await _until(lambda: len(calls(manager)) == 4 and engine.stats()["running"] == 4)
        await update_weights_mid_turn(pool, engine, running=4)
        [group] = await asyncio.wait_for(buffer.get_batch(1), 60)
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await pool.aclose()
    assert sorted(calls(manager)) == sorted(f"{group.group_id}-{i}" for i in range(4))  # each tool once
    for s in group.samples:
        first, tool, second = s.turns
        assert (first.kind, tool.kind, second.kind) == ("model", "tool", "model")
        assert first.end - first.start == 4 and second.end - second.start == 40  # nothing discarded
        v = s.versions[second.start:second.end]
        k = v.index(1)
        assert k > 0 and v == [0] * k + [1] * (40 - k)  # the turn went on at the new version
        assert s.num_resumes == 1 and s.status == "truncated"
    assert manager.counters.tokens_discarded == 0 and manager.counters.tool_calls == 4


async def test_a_checkpoint_mid_trajectory_replays_its_turns_without_calling_the_tool_again(
    agent_model_dir: Path,
) -> None:
    tok = AutoTokenizer.from_pretrained(agent_model_dir)

    def make(version: str) -> tuple[TorchEngine, LocalPool, RolloutManager, RolloutBuffer, StalenessController]:
        engine = TorchEngine(str(agent_model_dir), device="cpu", max_running_requests=8, weight_version=version)
        pool = LocalPool([engine])
        manager, buffer, ctl = manager_for(pool, tok, workflow=f"{SPEC}:two_turns", tools=[f"count={SPEC}:count"],
                                           version=int(version))
        return engine, pool, manager, buffer, ctl

    engine, pool, manager, _, _ = make("0")
    calls(manager).clear()
    await pool.start()
    producer = asyncio.create_task(manager.run())
    try:
        await _until(lambda: len(calls(manager)) == 4 and engine.stats()["running"] == 4)
        await pool.pause("abort")
        await _until(lambda: engine.stats()["waiting"] == 4)
        async with manager.tool_gate.shut():
            blob, counters = manager.snapshot()
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await pool.aclose()
    assert counters["partials"] == 4 and len(calls(manager)) == 4

    engine, pool, manager, buffer, ctl = make("1")  # as a resumed run: its own copy of the tool's module
    [restored] = manager.restore(blob, prompts_drawn=counters["prompts_drawn"], next_seed=counters["next_seed"])
    before = {s.index: (list(s.response_ids), [t.kind for t in s.turns]) for s in restored.samples}
    ctl.restore(version=1, trained_groups=0, queued=[], generating=[restored])
    await pool.start()
    producer = asyncio.create_task(manager.run())
    try:
        [group] = await asyncio.wait_for(buffer.get_batch(1), 60)
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await pool.aclose()
    assert calls(manager) == [] and manager.counters.tool_calls == 0  # replayed, never called again
    for s in group.samples:
        ids, kinds = before[s.index]
        assert kinds == ["model", "tool", "model"] and [t.kind for t in s.turns] == kinds
        assert s.response_ids[:len(ids)] == ids and s.turns[2].end - s.turns[2].start == 40
        assert set(s.versions[len(ids):]) == {1}


# ---- the OpenAI-compatible capture endpoint -------------------------------------------------------
async def test_an_openai_sdk_agent_records_the_same_tokens_as_a_native_workflow(agent_model_dir: Path) -> None:
    """The same two-turn chat written against the `openai` SDK (through the episode's capture
    endpoint) and against the episode itself, same seeds: token-identical trajectories, the same
    masks and behaviour logprobs; the SDK's calls are the sample's turns."""
    tok = AutoTokenizer.from_pretrained(agent_model_dir)
    chat = [{"role": "user", "content": "12+34="}]
    out, mismatches = {}, {}
    for name in ("chat_via_openai", "chat_native"):
        pool = LocalPool([TorchEngine(str(agent_model_dir), device="cpu", max_running_requests=8, weight_version="0")])
        manager, buffer, _ = manager_for(pool, tok, workflow=f"{SPEC}:{name}", tools=["calculator"], group_size=8)
        manager.task = Task(train=[{"prompt": chat, "answer": ""}], held_out=[], reward_fn=lambda t, a: 0.0)
        manager.prompts = manager.task.train
        await pool.start()
        producer = asyncio.create_task(manager.run())
        try:
            [out[name]] = await asyncio.wait_for(buffer.get_batch(1), 60)
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
            await manager.aclose()
            await pool.aclose()
        assert manager.counters.failed == 0
        mismatches[name] = manager.counters.prefix_mismatch
    # the second call's history renders unlike the session exactly where a first answer ended with
    # <eos> (the template closes answers with <|end|>); an answer cut at max_tokens is no mismatch
    first_ends = [(s.turns[0].finish, tok.convert_ids_to_tokens(s.response_ids[s.turns[0].end - 1]))
                  for s in out["chat_native"].samples]
    assert mismatches == {"chat_via_openai": sum(end == "<eos>" for _, end in first_ends), "chat_native": 0}
    assert {"length", "stop"} <= {finish for finish, _ in first_ends}  # both cases were exercised
    for a, b in zip(out["chat_via_openai"].samples, out["chat_native"].samples, strict=True):
        assert a.prompt_ids == b.prompt_ids == encode_prompt(tok, chat)
        assert a.response_ids == b.response_ids and a.loss_mask == b.loss_mask
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)  # batched differently: float rounding
        assert [t.kind for t in a.turns] == ["model", "tool", "model"]
        user = tok.decode(a.response_ids[a.turns[1].start:a.turns[1].end], skip_special_tokens=False)
        assert user.endswith("<|user|>1+1=<|end|><|assistant|>")


async def test_the_capture_endpoint_refuses_what_it_cannot_record(agent_model_dir: Path) -> None:
    import aiohttp

    tok = AutoTokenizer.from_pretrained(agent_model_dir)
    pool = LocalPool([TorchEngine(str(agent_model_dir), device="cpu", max_running_requests=8)])
    manager, _, _ = manager_for(pool, tok, workflow=f"{SPEC}:chat_native", tools=["calculator"])
    s = Sample(group_id="g", prompt_ids=encode_prompt(tok, [{"role": "user", "content": "1+2="}]))
    ep = Episode(manager.ctx, s, {})
    url = await ep.openai_url()
    try:
        async with aiohttp.ClientSession() as http:
            async def post(path: str, body: Any, ctype: str = "application/json") -> tuple[int, str]:
                data = body if isinstance(body, str) else __import__("json").dumps(body)
                async with http.post(url + path, data=data, headers={"Content-Type": ctype}) as r:
                    return r.status, (await r.json())["error"]["message"]

            assert (await post("/chat/completions", "{}", "text/plain"))[0] == 415
            assert (await post("/chat/completions", {"messages": "x"}))[0] == 400
            code, msg = await post("/chat/completions", {"messages": [], "stream": True})
            assert code == 400 and "messages" in msg
            async with http.post(url.replace(url.split("/")[-2], "nope") + "/chat/completions", json={}) as r:
                assert r.status == 404
            assert s.response_ids == []  # nothing refused was recorded
            # ... and the session still serves: a good call is one model turn
            user = [{"role": "user", "content": "1+2="}]
            async with http.post(url + "/chat/completions", json={"messages": user, "max_tokens": 3}) as r:
                assert r.status == 200, await r.text()
                body = await r.json()
            assert [t.kind for t in s.turns] == ["model"] and body["usage"]["completion_tokens"] == len(s.response_ids)
            code, msg = await post("/chat/completions", {"messages": user + [{"role": "user", "content": "2="}]})
            assert code == 400 and "rewrites a turn" in msg  # it leaves out the answer it had
            # the completions route: the session's text sent back verbatim, extended
            so_far = tok.decode(s.prompt_ids + s.response_ids, skip_special_tokens=False)
            code, msg = await post("/completions", {"prompt": "9" + so_far})
            assert code == 400 and "does not extend" in msg
            async with http.post(url + "/completions", json={"prompt": so_far + "7", "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
            assert [t.kind for t in s.turns] == ["model", "tool", "model"]
            assert tok.decode(s.response_ids[s.turns[1].start:s.turns[1].end]) == "7"
            async with http.get(url + "/models") as r:
                assert (await r.json())["data"][0]["id"] == "policy"
    finally:
        await manager.aclose()


# ---- chat prompts ---------------------------------------------------------------------------------
def test_a_chat_record_renders_as_apply_chat_template(agent_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(agent_model_dir)
    chat = [{"role": "system", "content": "1"}, {"role": "user", "content": "12+34="}]
    want = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert encode_prompt(tok, chat) == want
    assert tok.decode(want, skip_special_tokens=False) == "<|system|>1<|end|><|user|>12+34=<|end|><|assistant|>"
    assert isinstance(Group(group_id="g", samples=[]).samples, list)
