"""Workflows: how one sample of a record is generated (`rollout.workflow`).

A workflow is an async function `workflow(record, episode) -> None` that builds the sample through its
`Episode` (rollout/runner.py): model turns, tool turns, environment text. It must take the same turns
given the same results, so that a sample continued from a checkpoint replays instead of repeating them.

- `single_turn` (the default): prompt -> one completion (`episode.respond()`; a group's samples reach
  the engines as one request).
- `multi_turn_tools`: the model writes `call_open NAME: ARGS call_close` (tools.*); generation stops
  there, the tool runs, its observation is appended between `result_open` and `result_close`, masked
  out of the loss, and the model goes on, until it answers without a call or reaches
  `rollout.max_turns` model turns or the token budget.
- `"module:function"` / `"path/file.py:function"`: your own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..plugins import load_plugin
from .runner import Episode

Workflow = Callable[[dict[str, Any], Any], Awaitable[None]]  # (record, episode), or (record, episodes)
W = TypeVar("W", bound=Callable[..., Any])


def group_workflow(fn: W) -> W:
    """Mark `fn(record, episodes)` as a workflow of a whole group."""
    fn.group = True  # type: ignore[attr-defined]
    return fn


def is_group_workflow(fn: Workflow) -> bool:
    return bool(getattr(fn, "group", False))


@group_workflow
async def single_turn(record: dict[str, Any], episodes: list[Episode]) -> None:
    await Episode.respond_all(episodes)


async def multi_turn_tools(record: dict[str, Any], episode: Episode) -> None:
    tools = episode.tools
    assert tools is not None  # the manager builds them for this workflow
    opener, closer = tools.cfg.call_open, tools.cfg.call_close
    # A closing tag that is one token stops the engine by id: no text decoding at every step.
    close_ids = episode.tokenizer(closer, add_special_tokens=False)["input_ids"]
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


WORKFLOWS: dict[str, Workflow] = {"single_turn": single_turn, "multi_turn_tools": multi_turn_tools}


def load_workflow(spec: str) -> Workflow:
    """The workflow `rollout.workflow` names (PluginError when it cannot be loaded)."""
    return load_plugin(spec, "workflow", WORKFLOWS)
