"""OpenAI's Chat Completions (`tools`, `tool_choice`, `stream`) and Completions routes."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from .common import CAPTURE, Answer, read_json, send_events
from .convo import Refused, check_messages, check_tools


class _Chat(msgspec.Struct, kw_only=True):
    messages: Any
    model: str | None = None
    tools: Any = None
    tool_choice: Any = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False  # vLLM's extra parameter (`extra_body`): a turn of exactly max_tokens


class _Completion(msgspec.Struct, kw_only=True):
    prompt: str | list[int]
    model: str | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stream: bool = False


def _server(request: web.Request) -> Any:
    return request.app[CAPTURE]


async def chat_completions(request: web.Request) -> web.StreamResponse:
    server = _server(request)
    s = server.session(request)
    req = await read_json(request, _Chat)
    messages = check_messages(req.messages)
    tools = check_tools(req.tools)
    if req.tool_choice not in (None, "auto", "none", "required") and not isinstance(req.tool_choice, dict):
        raise Refused(400, "tool_choice is auto, none, required or {type: function, function: {name}}", "tool_choice")
    a = await server.answer(s, messages, tools, max_tokens=req.max_completion_tokens or req.max_tokens,
                            stop=req.stop, parse_tools=req.tool_choice != "none",
                            sampling={"ignore_eos": True} if req.ignore_eos else None)
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.model or "policy"
    calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": args}} for i, n, args in a.calls]
    if not req.stream:
        message: dict[str, Any] = {"role": "assistant", "content": a.text or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return web.json_response({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": a.finish, "logprobs": None}],
            "usage": usage(a)})
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    chunk = lambda delta, finish=None: head | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # noqa: E731
    events: list[tuple[str | None, Any]] = [(None, chunk({"role": "assistant", "content": ""}))]
    if a.text:
        events.append((None, chunk({"content": a.text})))
    events += [(None, chunk({"tool_calls": [{"index": k} | c]})) for k, c in enumerate(calls)]
    events.append((None, chunk({}, a.finish)))
    if (req.stream_options or {}).get("include_usage"):
        events.append((None, head | {"choices": [], "usage": usage(a)}))
    return await send_events(request, [*events, (None, "[DONE]")])


async def completions(request: web.Request) -> web.StreamResponse:
    """The whole text so far as `prompt` (or its token ids), extended: the episode's tokens sent back."""
    server = _server(request)
    s = server.session(request)
    req = await read_json(request, _Completion)
    if req.stream:
        raise Refused(400, "stream is not supported on /completions (it is on /chat/completions)", "stream")
    ep = s.episode
    if s.busy:
        raise Refused(409, "this episode is answering another call (one call at a time per session)")
    so_far = ep.sample.prompt_ids + ep.sample.response_ids
    if isinstance(req.prompt, list):
        rendered = list(req.prompt)
    else:  # as decoded with its special tokens; a leading <bos> may be left out
        rendered = ep.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
        bos = ep.tokenizer.bos_token_id
        if rendered[:len(so_far)] != so_far and bos is not None and so_far[:1] == [bos]:
            rendered = [bos, *rendered]
    if rendered[:len(so_far)] != so_far:
        raise Refused(400, "the prompt does not extend the session's tokens (send its text back verbatim)", "prompt")
    s.busy = True
    try:
        if rendered[len(so_far):]:
            ep.observe_ids(rendered[len(so_far):])
        turn = await ep.generate(max_new_tokens=req.max_tokens, stop=[req.stop] if isinstance(req.stop, str) else req.stop)
    finally:
        s.busy = False
    ids = ep.sample.response_ids[turn.start:turn.end]
    if turn.finish == "stop" and ids and ids[-1] in ep.tokenizer.all_special_ids:
        ids = ids[:-1]
    a = Answer(ep.tokenizer.decode(ids, skip_special_tokens=False), [], turn.finish,
               len(ep.sample.prompt_ids) + turn.start, turn.end - turn.start)
    return web.json_response({
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": req.model or "policy",
        "choices": [{"index": 0, "text": a.text, "logprobs": None, "finish_reason": a.finish}],
        "usage": usage(a)})


def usage(a: Answer) -> dict[str, int]:
    return {"prompt_tokens": a.prompt_tokens, "completion_tokens": a.completion_tokens,
            "total_tokens": a.prompt_tokens + a.completion_tokens}
