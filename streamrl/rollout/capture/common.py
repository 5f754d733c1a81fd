"""What the capture endpoint's routes share (server.py, chat.py, responses.py, messages.py): the answer
of one model turn, the assistant message it becomes, reading a request and writing a stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from .convo import Refused

CAPTURE: web.AppKey[Any] = web.AppKey("capture")  # the app's CaptureServer


@dataclass
class Answer:
    """One model turn as the APIs return it."""

    text: str  # the content: the answer without its tool calls (all of it when they could not be read)
    calls: list[tuple[str, str, str]]  # (call id, name, arguments as JSON text)
    finish: str  # stop | length | tool_calls
    prompt_tokens: int
    completion_tokens: int



def assistant_message(content: str, calls: list[tuple[str, str, str]]) -> dict[str, Any]:
    """An answer as an OpenAI chat message (what the session expects to be sent back)."""
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        m["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                           for cid, name, args in calls]
    return m


async def read_json(request: web.Request, cls: type) -> Any:
    if request.content_type != "application/json":
        raise Refused(415, "send JSON (Content-Type: application/json)")
    try:
        return msgspec.json.decode(await request.read(), type=cls)
    except msgspec.DecodeError as e:
        raise Refused(400, f"bad request: {e}") from None


async def send_events(request: web.Request, events: list[tuple[str | None, Any]]) -> web.StreamResponse:
    """Server-sent events: `(event name or None, data)`; data that is not a string is sent as JSON."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for name, data in events:
        body = data if isinstance(data, str) else msgspec.json.encode(data).decode()
        await resp.write(((f"event: {name}\n" if name else "") + f"data: {body}\n\n").encode())
    await resp.write_eof()
    return resp
