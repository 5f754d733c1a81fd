"""Shared plumbing of `streamrl serve`: JSON / SSE helpers, the 400 error type, and the per-app state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web


class BadRequest(Exception):
    """Answered with HTTP 400 and SGLang's error body `{"error": {"message": ...}}`."""


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


def error_response(message: str, status: int = 400) -> web.Response:
    return json_response({"error": {"message": message}}, status)


async def read_json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise BadRequest(f"invalid JSON body: {e}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the JSON body must be an object, got {type(obj).__name__}")
    return obj


def convert(obj: Any, typ: type) -> Any:
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as e:
        raise BadRequest(str(e).replace("Object contains unknown field", "unknown field")) from None


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def start_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


@dataclass
class ServerState:
    engine: Any
    api_key: str | None
    model_name: str
    model_path: str
    settings: dict[str, Any] = field(default_factory=dict)
    inflight: set[str] = field(default_factory=set)  # rids of requests submitted over HTTP
    extra: dict[str, Any] = field(default_factory=dict)  # per-feature state (weight-sync groups)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            raise BadRequest("this engine has no tokenizer: send input_ids instead of text")
        return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        tok = getattr(self.engine, "tokenizer", None)
        return tok.decode(ids, skip_special_tokens=skip_special_tokens) if tok is not None and ids else ""

    def in_flight(self) -> int:
        s = self.engine.stats()
        return int(s.get("running", 0)) + int(s.get("waiting", 0))


STATE = web.AppKey("streamrl_state", ServerState)


def state_of(request: web.Request) -> ServerState:
    return request.app[STATE]
