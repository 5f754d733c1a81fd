"""OpenAI's Responses API (`POST /v1/responses`): input items, function tools, `previous_response_id`
within an episode, `stream: true` (the API's events, once the turn is generated).

Input items become chat messages (convo.py): messages of any role, `function_call` items as the
assistant's tool calls, `function_call_output` items as `role: tool` messages; `reasoning` items are
skipped. `instructions` come first as a system message and, as in OpenAI's API, are not carried over
by `previous_response_id`, which continues the conversation the session stored under that id.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from .common import CAPTURE, Answer, assistant_message, read_json, send_events
from .convo import Refused, check_tools, text_of


class _Create(msgspec.Struct, kw_only=True):
    input: Any
    model: str | None = None
    instructions: str | None = None
    tools: Any = None
    tool_choice: Any = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False


def items_to_messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise Refused(400, "input is a string or a list of items", "input")
    out: list[dict[str, Any]] = []
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            raise Refused(400, f"input[{i}] is not an item", "input")
        kind = it.get("type", "message")
        if kind == "message" and it.get("role") in ("user", "system", "developer", "assistant"):
            role = "system" if it["role"] == "developer" else it["role"]
            out.append({"role": role, "content": text_of(it.get("content"))})
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("arguments"), str):
                raise Refused(400, f"input[{i}]: a function_call has name and arguments (a JSON string)", "input")
            call = {"id": it.get("call_id"), "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = it.get("output")
            out.append({"role": "tool", "tool_call_id": it.get("call_id"),
                        "content": output if isinstance(output, str) else text_of(output)})
        elif kind != "reasoning":
            raise Refused(400, f"input[{i}]: items of type {kind!r} are not supported here", "input")
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools in (None, []):
        return None
    if not isinstance(tools, list):
        raise Refused(400, "tools must be a list", "tools")
    chat = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise Refused(400, f"tools[{i}]: only function tools are supported here", "tools")
        chat.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}})
    return check_tools(chat)


async def create(request: web.Request) -> web.StreamResponse:
    server = request.app[CAPTURE]
    s = server.session(request)
    req = await read_json(request, _Create)
    tools = _tools(req.tools)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        if req.previous_response_id not in s.responses:
            raise Refused(400, f"Previous response with id '{req.previous_response_id}' not found.",
                          "previous_response_id", "previous_response_not_found")
        history = s.responses[req.previous_response_id]
    conversation = history + items_to_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if not conversation:
        raise Refused(400, "input is empty", "input")
    a = await server.answer(s, system + conversation, tools, max_tokens=req.max_output_tokens, stop=None,
                            parse_tools=req.tool_choice != "none")
    rid = f"resp_{uuid.uuid4().hex}"
    s.responses[rid] = [*conversation, assistant_message(a.text, a.calls)]
    body = _response(rid, req, a, tools)
    if not req.stream:
        return web.json_response(body)
    return await send_events(request, _events(body))


def _response(rid: str, req: _Create, a: Answer, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if a.text or not a.calls:
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": a.text, "annotations": []}]})
    output += [{"type": "function_call", "id": f"fc_{cid.removeprefix('call_')}", "call_id": cid, "name": name,
                "arguments": args, "status": "completed"} for cid, name, args in a.calls]
    cut = a.finish == "length"
    return {
        "id": rid, "object": "response", "created_at": int(time.time()), "model": req.model or "policy",
        "status": "incomplete" if cut else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": req.instructions, "output": output, "parallel_tool_calls": bool(req.parallel_tool_calls),
        "previous_response_id": req.previous_response_id, "tool_choice": req.tool_choice or "auto",
        "tools": [{"type": "function", **t["function"]} for t in tools or []], "metadata": {},
        "temperature": None, "top_p": None, "max_output_tokens": req.max_output_tokens, "text": {"format": {"type": "text"}},
        "usage": {"input_tokens": a.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": a.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": a.prompt_tokens + a.completion_tokens}}


def _events(body: dict[str, Any]) -> list[tuple[str | None, Any]]:
    """The Responses stream of a finished answer: created, each item added / its deltas / done, completed."""
    out: list[dict[str, Any]] = [
        {"type": "response.created", "response": body | {"status": "in_progress", "output": []}},
        {"type": "response.in_progress", "response": body | {"status": "in_progress", "output": []}}]
    for k, item in enumerate(body["output"]):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            part = {"type": "output_text", "text": "", "annotations": []}
            where = {"item_id": item["id"], "output_index": k, "content_index": 0}
            out += [{"type": "response.output_item.added", "output_index": k,
                     "item": item | {"status": "in_progress", "content": []}},
                    {"type": "response.content_part.added", **where, "part": part},
                    {"type": "response.output_text.delta", **where, "delta": text, "logprobs": []},
                    {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
                    {"type": "response.content_part.done", **where, "part": part | {"text": text}}]
        else:
            out += [{"type": "response.output_item.added", "output_index": k,
                     "item": item | {"status": "in_progress", "arguments": ""}},
                    {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": k,
                     "delta": item["arguments"]},
                    {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": k,
                     "name": item["name"], "arguments": item["arguments"]}]
        out.append({"type": "response.output_item.done", "output_index": k, "item": item})
    out.append({"type": "response.completed" if body["status"] == "completed" else "response.incomplete",
                "response": body})
    return [(e["type"], e | {"sequence_number": n}) for n, e in enumerate(out)]
