"""The capture endpoint: OpenAI- and Anthropic-compatible routes in front of the engines that record
every token, so an agent written against the `openai`, `openai-agents` or `anthropic` SDK is trained
as it is, pointed at its episode's base URL:

    url = await episode.openai_url()       # http://127.0.0.1:PORT/s/SESSION/v1
    client = openai.AsyncOpenAI(base_url=url, api_key="streamrl")
    url = await episode.anthropic_url()    # http://127.0.0.1:PORT/s/SESSION (the SDK adds /v1/messages)

Routes under `/s/{session}/v1`: `chat/completions` (with `tools`; chat.py), `completions`, `responses`
(responses.py), `messages` (Anthropic's; messages.py), `models`. Each session is one episode (one
sample) and takes one call at a time. Every call becomes chat messages and tools (convo.py), its new
tokens are appended masked, and the model's answer is one `episode.generate()` turn: trainable tokens
with behaviour logprobs and versions, resumed across weight updates like any turn. The answer's text
is split into content and tool calls by `rollout.tool_parser` (toolcalls.py).

Sampling follows the run (`rollout.*`, the manager's seeds): a request's `temperature`, `top_p` and
`seed` are ignored, because the trainer scores the tokens under the rollout's distribution;
`max_tokens` (and its other names) and `stop` are honoured. `stream: true` sends the same answer as
the API's stream of events once the turn is generated. Tools the agent runs itself are its own
business: run them through `episode.run_tool` to have them journaled (never run twice when a
checkpointed episode resumes).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .chat import chat_completions, completions
from .common import CAPTURE, Answer, assistant_message
from .convo import Refused, check_continues, new_tokens
from .messages import create as create_message
from .responses import create as create_response
from .toolcalls import ToolParser, load_parser

if TYPE_CHECKING:
    from ..runner import Episode


@dataclass
class Session:
    episode: Episode
    seen: list[dict[str, Any]] = field(default_factory=list)  # the conversation as last answered
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # Responses API: id -> conversation
    busy: bool = False


class CaptureServer:
    """Started on first use (`Episode.openai_url`, through runner.CaptureHost); one aiohttp app on 127.0.0.1."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self._parsers: dict[str, ToolParser] = {}

    async def start(self) -> str:
        app = web.Application(middlewares=[_errors], client_max_size=4 << 20)
        app[CAPTURE] = self
        app.router.add_post("/s/{sid}/v1/chat/completions", chat_completions)
        app.router.add_post("/s/{sid}/v1/completions", completions)
        app.router.add_post("/s/{sid}/v1/responses", create_response)
        app.router.add_post("/s/{sid}/v1/messages", create_message)
        app.router.add_get("/s/{sid}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def open(self, episode: Episode) -> str:
        """A new session's root (`.../s/SID`): OpenAI clients take it with `/v1`, Anthropic's as is."""
        sid = uuid.uuid4().hex
        self.sessions[sid] = Session(episode)
        return f"{self.url}/s/{sid}"

    def close_session(self, url: str) -> None:
        parts = url.rstrip("/").split("/")
        self.sessions.pop(parts[parts.index("s") + 1], None)

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def session(self, request: web.Request) -> Session:
        s = self.sessions.get(request.match_info["sid"])
        if s is None:
            raise Refused(404, "no such session (it ended, or was never opened)")
        return s

    async def _models(self, request: web.Request) -> web.Response:
        self.session(request)
        return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "streamrl"}]})

    # ---- one model turn, whatever the API ------------------------------------------------------------
    async def answer(self, s: Session, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
                     max_tokens: int | None, stop: str | list[str] | None, parse_tools: bool = True,
                     sampling: dict[str, Any] | None = None) -> Answer:
        """The turn `messages` ask for: checked, their new tokens appended, one model turn generated,
        its text split into content and tool calls. The session remembers the conversation answered."""
        if s.busy:
            raise Refused(409, "this episode is answering another call (one call at a time per session)")
        s.busy = True
        try:
            ep = s.episode
            check_continues(s.seen, messages)
            new = new_tokens(ep, messages, tools)
            if new:
                ep.observe_ids(new)
            turn = await ep.generate(max_new_tokens=max_tokens, stop=[stop] if isinstance(stop, str) else stop,
                                     **(sampling or {}))
        finally:
            s.busy = False
        ids = ep.sample.response_ids[turn.start:turn.end]
        if turn.finish == "stop" and ids and ids[-1] in ep.tokenizer.all_special_ids:
            ids = ids[:-1]  # the end-of-turn token: the template writes it again when it renders the answer
        text = ep.tokenizer.decode(ids, skip_special_tokens=False)
        content, calls = text, []
        if tools and parse_tools:
            parser = self._parser(ep.cfg.tool_parser)
            try:
                content, parsed = parser(text)
                calls = [(f"call_{uuid.uuid4().hex[:24]}", name, args) for name, args in parsed]
            except ValueError:
                ep.ctx.runner.counters.tool_parse_errors += 1
        ep.ctx.runner.counters.tool_calls_parsed += len(calls)
        s.seen = [*messages, assistant_message(content, calls)]
        finish = "tool_calls" if calls else ("length" if turn.finish == "length" else "stop")
        prompt = len(ep.sample.prompt_ids) + turn.start
        return Answer(content, calls, finish, prompt, turn.end - turn.start)

    def _parser(self, spec: str) -> ToolParser:
        if spec not in self._parsers:
            self._parsers[spec] = load_parser(spec)
        return self._parsers[spec]


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    409: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error"}


def error_response(request: web.Request, status: int, message: str, *, param: str | None = None,
                   code: str | None = None) -> web.Response:
    """The API's own error shape: Anthropic's on `/messages`, OpenAI's elsewhere."""
    if request.path.endswith("/v1/messages"):
        kind = _ANTHROPIC_TYPES.get(status, "api_error")
        return web.json_response({"type": "error", "error": {"type": kind, "message": message}}, status=status)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code or status}},
                             status=status)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """A refused request records nothing and the server keeps serving."""
    try:
        return await handler(request)
    except Refused as e:
        return error_response(request, e.status, str(e), param=e.param, code=e.code)
    except web.HTTPException as e:  # aiohttp's own (no such route, wrong method)
        if e.status < 400:
            raise
        return error_response(request, e.status, e.reason)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the episode's engines failed: the agent sees why
        return error_response(request, 502, f"{type(e).__name__}: {e}")
