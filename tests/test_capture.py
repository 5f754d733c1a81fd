"""The capture endpoint with the real `openai`, `openai-agents` and `anthropic` packages: tool calls
round-trip through Chat Completions, Responses and Messages, streamed and not; every model turn is
the tokens the engine generated; the agent's tool results are masked; malformed requests get the
API's own error shape and harm nothing else; an SDK agent resumes from a checkpoint without running
its tool again, and through a weight update with no token lost.

A scripted pool (a mock engine that "decides" to call the tool, inside this unit test of the endpoint)
where the model must write a tool call; the real TorchEngine where generation itself is tested."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic
import msgspec
import openai
import pytest
from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool
from test_workflows import ScriptedPool, _until, manager_for, producing, update_weights_mid_turn
from transformers import AutoTokenizer

from streamrl.engine import TorchEngine
from streamrl.plugins import load_plugin
from streamrl.rollout import LocalPool
from streamrl.rollout.capture import load_parser
from streamrl.rollout.runner import Episode, encode_prompt
from streamrl.tasks import Task
from streamrl.tasks.agent_tools import INSTRUCTIONS, TOOL_SCHEMA, TOOLS
from streamrl.types import Sample

REPO = Path(__file__).parents[1]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call><|end|>'
ANSWER = "5535<|end|>"
OBSERVED = "<|user|><tool_response>5535</tool_response><|end|><|assistant|>"
CHAT = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "123*45="}]


@pytest.fixture(scope="module")
def tok(tools_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tools_model_dir)


def episode_for(tok: Any, pool: Any, sample: Sample | None = None) -> tuple[Any, Episode]:
    manager, _, _ = manager_for(pool, tok, workflow="multi_turn_tools", tools=["calculator"], max_new_tokens=200)
    # The record's prompt is not what the agent sends: its first call's rendering becomes the prompt.
    s = sample or Sample(group_id="g", prompt_ids=encode_prompt(tok, "123*45="))
    return manager, Episode(manager.ctx, s, {})


def check_episode(tok: Any, ep: Episode, manager: Any) -> tuple[list[int], list[int], list[int]]:
    """The sample an agent's call, tool result and answer make: the engine's tokens for each model turn,
    the template's rendering of the result masked, nothing re-tokenized."""
    s = ep.sample
    want_prompt = tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert s.prompt_ids == list(want_prompt)
    model = [t for t in s.turns if t.kind == "model"]
    assert [s.response_ids[t.start:t.end] for t in model] == [tok(CALL, add_special_tokens=False)["input_ids"],
                                                              tok(ANSWER, add_special_tokens=False)["input_ids"]]
    observed = [t for t in s.turns if t.kind == "tool" and t.end > t.start]
    assert [tok.decode(s.response_ids[t.start:t.end], skip_special_tokens=False) for t in observed] == [OBSERVED]
    for t in s.turns:
        assert set(s.loss_mask[t.start:t.end]) <= ({1} if t.kind == "model" else {0})
    assert manager.counters.prefix_mismatch == 0  # the call re-rendered exactly as generated
    return s.prompt_ids, s.response_ids, s.loss_mask


# ---- the parser -------------------------------------------------------------------------------------
def test_the_hermes_parser_reads_calls_and_refuses_what_it_cannot() -> None:
    parse = load_parser("hermes")
    assert parse("5535") == ("5535", [])
    text = 'ok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g", "arguments": "{}"}</tool_call>'
    assert parse(text) == ("ok", [("f", '{"a": 1}'), ("g", "{}")])
    for bad in ("<tool_call>{bad</tool_call>", '<tool_call>{"name": "f"}', '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'):
        with pytest.raises(ValueError):
            parse(bad)


# ---- Chat Completions with the openai SDK -----------------------------------------------------------
async def test_chat_tool_calls_round_trip_and_streaming_agrees(tok: Any) -> None:
    out = {}
    for stream in (False, True):
        manager, ep = episode_for(tok, ScriptedPool(tok, [CALL, ANSWER]))
        client = openai.AsyncOpenAI(base_url=await ep.openai_url(), api_key="streamrl", max_retries=0)
        try:
            msgs: list[dict[str, Any]] = list(CHAT)
            answers = []
            for _ in range(2):
                if stream:
                    content, calls, finish = "", {}, None
                    async for chunk in await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS,
                                                                            stream=True):
                        d = chunk.choices[0].delta
                        content += d.content or ""
                        for c in d.tool_calls or []:
                            calls[c.index] = {"id": c.id, "type": "function",
                                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                        finish = chunk.choices[0].finish_reason or finish
                    message = {"role": "assistant", "content": content or None} | (
                        {"tool_calls": list(calls.values())} if calls else {})
                else:
                    r = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
                    message, finish = r.choices[0].message.model_dump(exclude_none=True), r.choices[0].finish_reason
                answers.append((message.get("content"), [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                                        for c in message.get("tool_calls", [])], finish))
                msgs.append(message)
                if message.get("tool_calls"):
                    msgs.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "5535"})
        finally:
            await client.close()
            await manager.aclose()
        assert answers == [(None, [("calculator", {"expression": "123*45"})], "tool_calls"), ("5535", [], "stop")]
        out[stream] = check_episode(tok, ep, manager)
    assert out[False] == out[True]


# ---- openai-agents: an ordinary Agent with a function tool, run by the SDK's Runner ------------------
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_an_openai_agents_agent_calls_its_tool_through_the_endpoint(tok: Any, api: str) -> None:
    agent_for = load_plugin(f"{REPO / 'examples' / 'agents_sdk.py'}:calculator_agent", "agent")
    manager, ep = episode_for(tok, ScriptedPool(tok, [CALL, ANSWER]))
    client = openai.AsyncOpenAI(base_url=await ep.openai_url(), api_key="streamrl", max_retries=0)
    model_cls = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    try:
        result = await Runner.run(agent_for(model_cls(model="policy", openai_client=client), ep), "123*45=",
                                  max_turns=3)
    finally:
        await client.close()
        await manager.aclose()
    assert result.final_output == "5535"
    ran = [t for t in ep.sample.turns if t.kind == "tool" and t.tool]
    assert [(t.tool, t.call, t.result) for t in ran] == [("calculator", "123*45", "5535")]
    check_episode(tok, ep, manager)
    assert (manager.counters.tool_calls, manager.counters.tool_calls_parsed) == (1, 1)


# ---- the Responses API with previous_response_id ---------------------------------------------------
async def _respond(client: Any, stream: bool, **kw: Any) -> Any:
    kw |= {"model": "policy", "instructions": INSTRUCTIONS,
           "tools": [{"type": "function", "name": "calculator", "parameters": TOOL_SCHEMA}]}
    if not stream:
        return await client.responses.create(**kw)
    events = [e async for e in await client.responses.create(stream=True, **kw)]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    return events[-1].response


async def test_responses_continue_a_conversation_by_previous_response_id(tok: Any) -> None:
    out = {}
    for stream in (False, True):
        manager, ep = episode_for(tok, ScriptedPool(tok, [CALL, ANSWER]))
        client = openai.AsyncOpenAI(base_url=await ep.openai_url(), api_key="streamrl", max_retries=0)
        try:
            r1 = await _respond(client, stream, input="123*45=")
            [call] = r1.output
            assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "calculator",
                                                                           {"expression": "123*45"})
            r2 = await _respond(client, stream, previous_response_id=r1.id,
                              input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5535"}])
        finally:
            await client.close()
            await manager.aclose()
        assert r2.output_text == "5535" and r2.status == "completed"
        out[stream] = check_episode(tok, ep, manager)
    assert out[False] == out[True]


# ---- the anthropic SDK: tool_use blocks out, tool_result blocks in ---------------------------------
async def test_anthropic_tool_use_round_trips_and_streaming_agrees(tok: Any) -> None:
    tools = [{"name": "calculator", "description": "", "input_schema": TOOL_SCHEMA}]
    out = {}
    for stream in (False, True):
        manager, ep = episode_for(tok, ScriptedPool(tok, [CALL, ANSWER]))
        client = anthropic.AsyncAnthropic(base_url=await ep.anthropic_url(), api_key="streamrl", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "123*45="}]
        got = []
        try:
            for _ in range(2):
                kw = dict(model="policy", max_tokens=64, system=INSTRUCTIONS, tools=tools, messages=messages)
                if stream:
                    async with client.messages.stream(**kw) as s:
                        r = await s.get_final_message()
                else:
                    r = await client.messages.create(**kw)
                got.append((r.stop_reason, [b.model_dump(exclude_none=True, exclude={"id"}) for b in r.content]))
                messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
                uses = [b for b in r.content if b.type == "tool_use"]
                if uses:
                    messages.append({"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": uses[0].id, "content": "5535"}]})
        finally:
            await client.close()
            await manager.aclose()
        assert got == [("tool_use", [{"type": "tool_use", "name": "calculator", "input": {"expression": "123*45"}}]),
                       ("end_turn", [{"type": "text", "text": "5535"}])]
        out[stream] = check_episode(tok, ep, manager)
    assert out[False] == out[True]


# ---- malformed requests: the API's own error, nothing recorded, the server keeps serving -------------
async def test_malformed_requests_get_the_apis_error_and_harm_no_other_episode(tok: Any) -> None:
    manager, ep = episode_for(tok, ScriptedPool(tok, [CALL, ANSWER, "<tool_call>{bad</tool_call><|end|>"]))
    other = Episode(manager.ctx, Sample(group_id="h", prompt_ids=encode_prompt(tok, "1")), {})
    oa = openai.AsyncOpenAI(base_url=await ep.openai_url(), api_key="x", max_retries=0)
    an = anthropic.AsyncAnthropic(base_url=await ep.anthropic_url(), api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as e:
            await oa.chat.completions.create(model="policy", messages=CHAT, tools=[{"type": "function",
                                                                                    "function": {"name": "no spaces"}}])
        assert "function.name" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            await oa.responses.create(model="policy", input="1", previous_response_id="resp_nope")
        assert e.value.code == "previous_response_not_found"
        with pytest.raises(anthropic.BadRequestError) as e:
            await an.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "1"}],
                                     tools=[{"name": "calculator"}])  # no input_schema
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert ep.sample.response_ids == [] and ep.sample.turns == []  # nothing refused was recorded
        # a good call; then one that rewrites the question it answered
        r = await oa.chat.completions.create(model="policy", messages=CHAT, tools=TOOLS)
        call = r.choices[0].message.model_dump(exclude_none=True)
        tool = {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "5535"}
        with pytest.raises(openai.BadRequestError) as e:
            await oa.chat.completions.create(model="policy", messages=[CHAT[0], {"role": "user", "content": "9*9="},
                                                                         call, tool], tools=TOOLS)
        assert "rewrites a turn" in e.value.body["message"]
        # another episode on the same server is unharmed, and this one goes on
        oo = openai.AsyncOpenAI(base_url=await other.openai_url(), api_key="x", max_retries=0)
        r2 = await oo.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1"}])
        assert r2.choices[0].message.content == "5535"
        await oo.close()
        # an answer whose tool-call text cannot be read comes back as text, counted
        r3 = await oa.chat.completions.create(model="policy", messages=[*CHAT, call, tool], tools=TOOLS)
        assert r3.choices[0].message.content == "<tool_call>{bad</tool_call>" and not r3.choices[0].message.tool_calls
        assert manager.counters.tool_parse_errors == 1
    finally:
        await oa.close()
        await an.close()
        await manager.aclose()


# ---- a checkpoint mid-episode, and a weight update mid-call -----------------------------------------
class _Held(ScriptedPool):
    """The script's answers, but the request numbered `hold` waits until released."""

    def __init__(self, tok: Any, script: list[str], hold: int | None) -> None:
        super().__init__(tok, script)
        self.hold, self.release = hold, asyncio.Event()

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]:
        if len(self.requests) == self.hold:
            self.requests.append(list(input_ids))
            await self.release.wait()
            self.requests.pop()
        return await super().generate(input_ids, sampling_params, rid)


async def _agent_run(ep: Episode, runs: list[str]) -> Any:
    def calculator_fn(expression: str) -> str:
        runs.append(expression)
        return "5535"

    @function_tool
    async def calculator(expression: str) -> str:
        return await ep.run_tool("calculator", expression, calculator_fn)

    client = openai.AsyncOpenAI(base_url=await ep.openai_url(), api_key="x", max_retries=0)
    try:
        agent = Agent(name="c", instructions=INSTRUCTIONS, tools=[calculator],
                      model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
        return await Runner.run(agent, "123*45=", max_turns=3)
    finally:
        await client.close()


async def test_an_sdk_agent_resumed_from_a_checkpoint_does_not_run_its_tool_again(tok: Any) -> None:
    runs: list[str] = []
    pool = _Held(tok, [CALL, ANSWER], hold=1)
    manager, ep = episode_for(tok, pool)
    task = asyncio.create_task(_agent_run(ep, runs))
    await _until(lambda: len(pool.requests) == 2)  # the tool ran, its result sent, the answer in flight
    snapshot = msgspec.msgpack.decode(msgspec.msgpack.encode(ep.sample), type=Sample)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await manager.aclose()
    assert runs == ["123*45"] and [t.kind for t in snapshot.turns] == ["model", "tool", "tool", "model"]

    pool = _Held(tok, [ANSWER], hold=None)  # only the unfinished turn is generated again
    manager, ep = episode_for(tok, pool, snapshot)
    result = await _agent_run(ep, runs)
    await manager.aclose()
    assert result.final_output == "5535" and runs == ["123*45"] and manager.counters.tool_calls == 0
    assert len(pool.requests) == 1
    check_episode(tok, ep, manager)


async def test_an_sdk_call_interrupted_by_a_weight_update_loses_no_token(tools_model_dir: Path, tok: Any) -> None:
    engine = TorchEngine(str(tools_model_dir), device="cpu", max_running_requests=8, weight_version="0")
    pool = LocalPool([engine])
    manager, ep = episode_for(tok, pool)
    await pool.start()
    client = openai.AsyncOpenAI(base_url=await ep.openai_url(), api_key="x", max_retries=0)
    try:
        call = asyncio.create_task(client.chat.completions.create(
            model="policy", messages=CHAT, max_tokens=40, extra_body={"ignore_eos": True}))
        await _until(lambda: ep.sample.num_tokens >= 0 and engine.stats()["running"] == 1)
        await update_weights_mid_turn(pool, engine, running=1)
        r = await asyncio.wait_for(call, 60)
    finally:
        await client.close()
        await manager.aclose()
        await pool.aclose()
    s = ep.sample
    [turn] = s.turns
    assert turn.end - turn.start == 40 == r.usage.completion_tokens
    v = s.versions[turn.start:turn.end]
    assert 0 in v and v[-1] == 1 and v == sorted(v)  # went on at the new version
    assert manager.counters.tokens_discarded == 0 and s.num_resumes == 1


async def test_a_run_checkpointed_mid_episode_resumes_the_sdk_agent_without_its_tool(tok: Any) -> None:
    """The run's own snapshot / restore (as a checkpoint takes it) with the examples' openai-agents
    workflow: the agent starts again, its first call and its tool are replayed from the journal, and
    only the unfinished answer is generated."""
    from streamrl.tasks.agent_tools import reward

    def make(script: list[str], hold: int | None) -> tuple[Any, Any, Any, Any]:
        pool = _Held(tok, script, hold)
        manager, buffer, ctl = manager_for(pool, tok, workflow=f"{REPO / 'examples' / 'agents_sdk.py'}:solve",
                                           tools=["calculator"], group_size=1, max_new_tokens=96)
        manager.task = Task(train=[{"prompt": "123*45=", "answer": "5535"}], held_out=[], reward_fn=reward)
        manager.prompts = manager.task.train
        return pool, manager, buffer, ctl

    pool, manager, _, _ = make([CALL, ANSWER], hold=1)
    async with producing(manager):
        await _until(lambda: len(pool.requests) == 2)  # the tool ran, the answer is being generated
        async with manager.tool_gate.shut():
            blob, counters = manager.snapshot()
    assert manager.counters.tool_calls == 1

    pool, manager, buffer, ctl = make([ANSWER], hold=None)
    [restored] = manager.restore(blob, prompts_drawn=counters["prompts_drawn"], next_seed=counters["next_seed"])
    ctl.restore(version=0, trained_groups=0, queued=[], generating=[restored])
    async with producing(manager):
        try:
            [group] = await asyncio.wait_for(buffer.get_batch(1), 60)
        except TimeoutError:
            raise AssertionError(f"the resumed group did not finish: {manager.counters}") from None
    assert manager.counters.tool_calls == 0 and len(pool.requests) == 1  # replayed, not run; one answer generated
    [s] = group.samples
    assert [t.kind for t in s.turns] == ["model", "tool", "tool", "model"] and s.reward == 1.0
    assert tok.decode(s.response_ids, skip_special_tokens=False) == CALL + OBSERVED + ANSWER
