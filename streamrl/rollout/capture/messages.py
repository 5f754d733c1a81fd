"""Anthropic's Messages API (`POST /v1/messages`): `system`, content blocks (`text`, `tool_use`,
`tool_result`), `tools` with `input_schema`, `stream: true` (the API's events, once the turn is
generated), and Anthropic's error shape.

Blocks become chat messages (convo.py): an assistant's `tool_use` blocks are its tool calls (the
input as JSON text), a user's `tool_result` blocks are `role: tool` messages, before the user's text.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec
from aiohttp import web

from .common import CAPTURE, Answer, read_json, send_events
from .convo import Refused, check_tools, text_of


class _Create(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int
    messages: Any
    system: Any = None
    tools: Any = None
    tool_choice: Any = None
    stop_sequences: list[str] | None = None
    stream: bool = False


def blocks_to_messages(messages: Any, system: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise Refused(400, "messages: a non-empty list")
    out: list[dict[str, Any]] = [{"role": "system", "content": text_of(system)}] if system else []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise Refused(400, f"messages.{i}.role: user or assistant")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise Refused(400, f"messages.{i}.content: a string or a list of content blocks")
        text, calls, results = "", [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text += str(b.get("text", ""))
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise Refused(400, f"messages.{i}.content.{j}: a tool_use block has a name and an input object")
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
            elif kind == "tool_result" and m["role"] == "user":
                c = b.get("content", "")
                results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                                "content": c if isinstance(c, str) else text_of(c)})
            elif kind not in ("thinking", "redacted_thinking"):
                raise Refused(400, f"messages.{i}.content.{j}: blocks of type {kind!r} are not supported here")
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {}))
        else:
            out += results
            if text or not results:
                out.append({"role": "user", "content": text})
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools in (None, []):
        return None
    if not isinstance(tools, list):
        raise Refused(400, "tools: a list")
    chat = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("input_schema"), dict):
            raise Refused(400, f"tools.{i}: a tool has a name and an input_schema object")
        chat.append({"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                      "parameters": t["input_schema"]}})
    return check_tools(chat)


async def create(request: web.Request) -> web.StreamResponse:
    server = request.app[CAPTURE]
    s = server.session(request)
    req = await read_json(request, _Create)
    if req.max_tokens < 1:
        raise Refused(400, "max_tokens: at least 1")
    messages = blocks_to_messages(req.messages, req.system)
    tools = _tools(req.tools)
    choice = req.tool_choice.get("type") if isinstance(req.tool_choice, dict) else None
    a = await server.answer(s, messages, tools, max_tokens=req.max_tokens, stop=req.stop_sequences,
                            parse_tools=choice != "none")
    body = _message(req, a)
    return await send_events(request, _events(body)) if req.stream else web.json_response(body)


def _message(req: _Create, a: Answer) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": a.text}] if a.text or not a.calls else []
    content += [{"type": "tool_use", "id": "toolu_" + cid.removeprefix("call_"), "name": name, "input": json.loads(args)}
                for cid, name, args in a.calls]
    stop = {"tool_calls": "tool_use", "length": "max_tokens"}.get(a.finish, "end_turn")
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": req.model,
            "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": a.prompt_tokens, "output_tokens": a.completion_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def _events(body: dict[str, Any]) -> list[tuple[str | None, Any]]:
    start = body | {"content": [], "stop_reason": None, "usage": body["usage"] | {"output_tokens": 0}}
    out: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for k, block in enumerate(body["content"]):
        if block["type"] == "text":
            out += [{"type": "content_block_start", "index": k, "content_block": {"type": "text", "text": ""}},
                    {"type": "content_block_delta", "index": k, "delta": {"type": "text_delta", "text": block["text"]}}]
        else:
            out += [{"type": "content_block_start", "index": k, "content_block": block | {"input": {}}},
                    {"type": "content_block_delta", "index": k,
                     "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}]
        out.append({"type": "content_block_stop", "index": k})
    out += [{"type": "message_delta", "delta": {"stop_reason": body["stop_reason"], "stop_sequence": None},
             "usage": {"output_tokens": body["usage"]["output_tokens"]}},
            {"type": "message_stop"}]
    return [(e["type"], e) for e in out]
