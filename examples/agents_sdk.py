"""Agents written with the OpenAI Agents SDK and the Anthropic SDK, trained as they are
(configs/agents_sdk.yaml; docs/agentic.md, "Train the agent you already have").

Each workflow builds an ordinary agent, points its client at the episode's base URL, and runs it.
The capture endpoint records every model call as the episode's tokens; the tool runs through
`episode.run_tool`, so a checkpointed episode that resumes gets the result back instead of running the
tool again (without it the agent works the same, and the tool runs again on resume).

    rollout.workflow: examples/agents_sdk.py:solve             # openai-agents, Chat Completions
    rollout.workflow: examples/agents_sdk.py:solve_responses   # openai-agents, the Responses API
    rollout.workflow: examples/agents_sdk.py:solve_anthropic   # the anthropic SDK's tool loop
"""

from __future__ import annotations

import contextlib
from typing import Any

from agents import (
    Agent,
    AgentsException,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from streamrl.rollout.tools import calculator as calculate
from streamrl.tasks.agent_tools import INSTRUCTIONS, TOOL_DESCRIPTION, TOOL_SCHEMA

set_tracing_disabled(True)  # the SDK would otherwise send its traces to OpenAI's servers


def calculator_agent(model: Any, episode: Any) -> Agent:
    @function_tool(description_override=TOOL_DESCRIPTION)
    async def calculator(expression: str) -> str:
        return await episode.run_tool("calculator", expression, calculate)

    return Agent(name="calculator", instructions=INSTRUCTIONS, tools=[calculator], model=model)


_clients: dict[str, Any] = {}


def client_for(kind: str, url: str) -> Any:
    """One SDK client per run, pointed at each episode with `with_options(base_url=...)`: a new client
    builds its own SSL context and connection pool, tens of milliseconds that would be paid per episode."""
    if kind not in _clients:
        if kind == "openai":
            _clients[kind] = AsyncOpenAI(base_url=url, api_key="streamrl", max_retries=0)
        else:
            import anthropic

            _clients[kind] = anthropic.AsyncAnthropic(base_url=url, api_key="streamrl", max_retries=0)
    return _clients[kind].with_options(base_url=url)


async def _run(record: dict[str, Any], episode: Any, responses: bool) -> None:
    client = client_for("openai", await episode.openai_url())
    model_cls = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    # Too many turns, a call of a tool it does not have: the episode ends there (the reward says how well).
    with contextlib.suppress(AgentsException):
        await Runner.run(calculator_agent(model_cls(model="policy", openai_client=client), episode),
                         record["prompt"], max_turns=3)


async def solve(record: dict[str, Any], episode: Any) -> None:
    await _run(record, episode, responses=False)


async def solve_responses(record: dict[str, Any], episode: Any) -> None:
    await _run(record, episode, responses=True)


async def solve_anthropic(record: dict[str, Any], episode: Any) -> None:
    """The anthropic SDK's own tool loop: tool_use blocks in, tool_result blocks back."""
    client = client_for("anthropic", await episode.anthropic_url())
    tools = [{"name": "calculator", "description": TOOL_DESCRIPTION, "input_schema": TOOL_SCHEMA}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": record["prompt"]}]
    for _ in range(3):
        r = await client.messages.create(model="policy", max_tokens=64, system=INSTRUCTIONS, tools=tools,
                                         messages=messages)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        if r.stop_reason != "tool_use":
            return
        results = []
        for b in r.content:
            if b.type == "tool_use":
                try:
                    out, error = await episode.run_tool(b.name, str(b.input.get("expression", "")), calculate), False
                except Exception as e:  # noqa: BLE001 - the model reads the error, as in any tool loop
                    out, error = f"error: {e}", True
                results.append({"type": "tool_result", "tool_use_id": b.id, "content": out, "is_error": error})
        messages.append({"role": "user", "content": results})
