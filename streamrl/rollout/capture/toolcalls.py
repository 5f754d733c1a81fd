"""Tool-call parsers (`rollout.tool_parser`): a model's answer text -> its content and tool calls.

A parser is a function `parse(text) -> (content, [(name, arguments_json), ...])` that raises
`ValueError` when the text holds a tool call it cannot read; the capture endpoint then returns the
whole text as content and counts it (`tool_parse_errors`), never a 500. Name a built-in or your own
as `module:function` / `file.py:function`.

Built in: `hermes`, the form of Hermes and Qwen chat templates (and of `streamrl init-model
--tools`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, after the
answer's text. The arguments come back as `json.dumps` writes them, which is how these templates write
them again when the agent sends the call back: a model that writes them that way re-renders token for
token (docs/agentic.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from ...plugins import load_plugin

Parsed = tuple[str, list[tuple[str, str]]]
ToolParser = Callable[[str], Parsed]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.DOTALL)


def hermes(text: str) -> Parsed:
    if _OPEN not in text:
        return text, []
    content = text[:text.index(_OPEN)].strip()
    blocks = _BLOCK.findall(text)
    if len(blocks) != text.count(_OPEN):
        raise ValueError("a <tool_call> without its </tool_call>")
    calls = []
    for raw in blocks:
        try:
            call = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"a tool call that is not JSON: {e}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError('a tool call without "name"')
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise ValueError("tool call arguments that are not JSON") from None
        if not isinstance(args, dict):
            raise ValueError("tool call arguments that are not an object")
        calls.append((call["name"], json.dumps(args, ensure_ascii=False)))
    return content, calls


PARSERS: dict[str, ToolParser] = {"hermes": hermes}


def load_parser(spec: str) -> ToolParser:
    """PluginError when `spec` names no parser."""
    return load_plugin(spec, "tool-call parser", PARSERS)
