"""Workflows: how one sample of a record is generated (`rollout.workflow`).

A workflow is an async function `workflow(record, episode) -> None` that builds the sample through its
`Episode` (rollout/episode.py): model turns, tool turns, environment text. It must take the same turns
given the same results, so that a sample continued from a checkpoint replays instead of repeating them.

- `single_turn` (the default): prompt -> one completion. The manager runs it itself, a group's samples
  as one engine request, without an episode.
- `multi_turn_tools`: the model writes `call_open NAME: ARGS call_close` (tools.*); generation stops
  there, the tool runs, its observation is appended between `result_open` and `result_close`, masked
  out of the loss, and the model goes on, until it answers without a call or reaches
  `rollout.max_turns` model turns or the token budget.
- `"module:function"` / `"path/file.py:function"`: your own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .episode import Episode

Workflow = Callable[[dict[str, Any], Episode], Awaitable[None]]


async def multi_turn_tools(record: dict[str, Any], episode: Episode) -> None:
    tools = episode.manager.tools
    assert tools is not None  # the manager builds them for this workflow
    opener, closer = tools.cfg.call_open, tools.cfg.call_close
    # A closing tag that is one token stops the engine by id: no text decoding at every step.
    close_ids = episode.manager.tokenizer(closer, add_special_tokens=False)["input_ids"]
    stop = {"stop_token_ids": close_ids} if len(close_ids) == 1 else {"stop": [closer]}
    for _ in range(episode.cfg.max_turns):
        turn = await episode.generate(**stop)
        text = episode.text(turn)
        if turn.finish != "stop" or not text.endswith(closer) or opener not in text:
            return  # an answer (or the budget ran out): the sample is done
        call = text[text.rindex(opener) + len(opener):-len(closer)]
        name, sep, args = call.partition(":")
        if not sep and len(tools.tools) == 1:  # one tool: its name may be left out
            name, args = next(iter(tools.tools)), call
        await episode.call_tool(name.strip(), args.strip())


def load_workflow(spec: str) -> Workflow | None:
    """The workflow `rollout.workflow` names; None for `single_turn` (the manager's own path)."""
    if spec == "single_turn":
        return None
    if spec == "multi_turn_tools":
        return multi_turn_tools
    from ..tasks.datasets import load_callable  # the same `module:function` lookup as rewards

    return load_callable(spec, "workflow")
