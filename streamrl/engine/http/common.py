"""Shared plumbing of `streamrl serve`: JSON / SSE helpers, the 4xx error type, the request limits and
the per-app state."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from aiohttp import web

T = TypeVar("T")


class BadRequest(Exception):
    """Answered with HTTP `status` (400 unless said) and SGLang's error body `{"error": {"message": ...}}`."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (docs/http.md, "Limits and security")."""

    max_body_bytes: int = 16 << 20
    max_text_chars: int = 1 << 20  # per prompt, after a chat template: tokenizing is the costly part
    max_items: int = 1024  # engine requests per HTTP request: batch entries times n
    read_timeout_s: float = 30.0  # for the whole body of a request, once its headers arrived


def is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


def error_response(message: str, status: int = 400) -> web.Response:
    return json_response({"error": {"message": message}}, status)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object (its Content-Type was checked by the server's middleware); a body
    that does not arrive within the read timeout is a 408."""
    limits = state_of(request).limits
    if (request.content_length or 0) > limits.max_body_bytes:
        raise BadRequest(f"the body is larger than the server's limit of {limits.max_body_bytes} bytes", 413)
    try:
        raw = await asyncio.wait_for(request.read(), limits.read_timeout_s)
    except TimeoutError:
        raise BadRequest(f"the body did not arrive within {limits.read_timeout_s:g} s", 408) from None
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(f"the body is larger than the server's limit of {limits.max_body_bytes} bytes", 413) from None
    if not raw.strip():
        return {}
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise BadRequest(f"invalid JSON body: {e}") from None
    except RecursionError:
        raise BadRequest("invalid JSON body: nested too deeply") from None
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
    limits: Limits = field(default_factory=Limits)
    # Request preparation (tokenizing, chat templates) runs here, off the event loop, one at a time: a
    # long prompt never stalls /health or other requests, and the tokenizer is never used concurrently.
    prep: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="prep"))

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            raise BadRequest("this engine has no tokenizer: send input_ids instead of text")
        if len(text) > self.limits.max_text_chars:
            raise BadRequest(f"a prompt of {len(text)} characters is over the server's limit of "
                             f"{self.limits.max_text_chars}", 413)
        return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def check_items(self, n: int) -> None:
        if n > self.limits.max_items:
            raise BadRequest(f"{n} generations in one request (batch x n) are over the server's limit of "
                             f"{self.limits.max_items}", 413)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        tok = getattr(self.engine, "tokenizer", None)
        return tok.decode(ids, skip_special_tokens=skip_special_tokens) if tok is not None and ids else ""

    def in_flight(self) -> int:
        s = self.engine.stats()
        return int(s.get("running", 0)) + int(s.get("waiting", 0))


STATE = web.AppKey("streamrl_state", ServerState)


def state_of(request: web.Request) -> ServerState:
    return request.app[STATE]
