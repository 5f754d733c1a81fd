"""An OpenAI-compatible endpoint in front of the engines that records every token: for workflows
written against the `openai` SDK.

    url = await episode.openai_url()          # http://127.0.0.1:PORT/s/SESSION/v1
    client = openai.AsyncOpenAI(base_url=url, api_key="streamrl")
    r = await client.chat.completions.create(model="policy", messages=messages)

Each session is one episode (one sample). A conversation is extended, never re-tokenized: the
history (everything up to the last assistant message) stands for the session's tokens as generated,
and only what the chat template renders after it (the agent's new user or tool messages and the
assistant header) is appended, masked. The history is rendered too, to check it against the session
(a mismatch is counted, `prefix_mismatch`). The model's answer is one `episode.generate()` turn:
trainable tokens with behaviour logprobs and versions, resumed across weight updates like any turn;
its text keeps special tokens but the end-of-turn token, which the template writes itself.

Sampling follows the run (`rollout.*`, the manager's seeds): a request's `temperature`, `top_p` and
`seed` are ignored, because the trainer scores the tokens under the rollout's distribution;
`max_tokens` (or `max_completion_tokens`) and `stop` are honoured. Non-streaming only.
Tools the agent runs itself are its own business: call them through `episode.call_tool` to have
them journaled (never run twice on a resumed checkpoint).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

if TYPE_CHECKING:
    from .runner import Episode


class _Chat(msgspec.Struct, kw_only=True):
    messages: list[dict[str, Any]]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False


class _Completion(msgspec.Struct, kw_only=True):
    prompt: str | list[int]
    model: str | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stream: bool = False


class CaptureServer:
    """Started on first use (`Episode.openai_url`, through runner.CaptureHost); one aiohttp app on 127.0.0.1."""

    def __init__(self) -> None:
        self.sessions: dict[str, Episode] = {}
        self.url: str | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application(middlewares=[_errors], client_max_size=4 << 20)
        app.router.add_post("/s/{sid}/v1/chat/completions", self._chat)
        app.router.add_post("/s/{sid}/v1/completions", self._completion)
        app.router.add_get("/s/{sid}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def open(self, episode: Episode) -> str:
        sid = uuid.uuid4().hex
        self.sessions[sid] = episode
        return f"{self.url}/s/{sid}/v1"

    def close_session(self, base_url: str) -> None:
        self.sessions.pop(base_url.rstrip("/").split("/")[-2], None)

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- routes -------------------------------------------------------------------------------------
    def _episode(self, request: web.Request) -> Episode:
        ep = self.sessions.get(request.match_info["sid"])
        if ep is None:
            raise _Refused(404, "no such session (it ended, or was never opened)")
        return ep

    async def _read(self, request: web.Request, cls: type) -> Any:
        if request.content_type != "application/json":
            raise _Refused(415, "send JSON (Content-Type: application/json)")
        try:
            req = msgspec.json.decode(await request.read(), type=cls)
        except msgspec.DecodeError as e:
            raise _Refused(400, f"bad request: {e}") from None
        if req.stream:
            raise _Refused(400, "stream is not supported by the capture endpoint")
        return req

    async def _models(self, request: web.Request) -> web.Response:
        self._episode(request)
        return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "streamrl"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        ep = self._episode(request)
        req = await self._read(request, _Chat)
        new = self._new_tokens(ep, req.messages)
        text, turn = await self._turn(ep, new, req.max_completion_tokens or req.max_tokens, req.stop)
        return web.json_response({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": req.model or "policy",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "length" if turn.finish == "length" else "stop"}],
            "usage": _usage(ep, turn)})

    @staticmethod
    def _new_tokens(ep: Episode, messages: list[dict[str, Any]]) -> list[int]:
        """The tokens these messages add to the session: what the template renders after the history
        (everything up to the last assistant message), whose tokens are the session's own, as generated.
        The history is rendered too, only to check it: where it renders longer than the session (an
        answer cut at max_tokens, which the template closes) the rest is appended masked; where it
        renders otherwise (text that re-tokenizes differently, another end-of-turn token) the mismatch
        is counted and the generated tokens stand."""
        try:
            full = ep.encode(messages)
            last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
            history = ep.sample.prompt_ids if last is None else _render(ep, messages[:last + 1])
        except Exception as e:  # noqa: BLE001 - a template that cannot render these messages
            raise _Refused(400, f"the chat template cannot render these messages: {e}") from None
        if last is None and ep.sample.response_ids:
            raise _Refused(400, "a session's later calls carry its earlier answers (assistant messages)")
        if last is None and full[:len(history)] != history:
            raise _Refused(400, "the first call's messages must begin with the session's prompt")
        if full[:len(history)] != history:
            raise _Refused(400, "the chat template renders this history differently with more messages after it")
        so_far = ep.sample.prompt_ids + ep.sample.response_ids
        if history[:len(so_far)] == so_far:
            # What the template writes after the tokens generated (the end-of-turn token of an answer
            # cut at max_tokens) comes from the environment: appended masked, like the new messages.
            return history[len(so_far):] + full[len(history):]
        ep.ctx.runner.counters.prefix_mismatch += 1
        return full[len(history):]

    async def _completion(self, request: web.Request) -> web.Response:
        """The whole text so far as `prompt` (or its token ids): the same prefix rule as chat."""
        ep = self._episode(request)
        req = await self._read(request, _Completion)
        so_far = ep.sample.prompt_ids + ep.sample.response_ids
        if isinstance(req.prompt, list):
            rendered = list(req.prompt)
        else:  # as decoded with its special tokens; a leading <bos> may be left out
            rendered = ep.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
            bos = ep.tokenizer.bos_token_id
            if rendered[:len(so_far)] != so_far and bos is not None and so_far[:1] == [bos]:
                rendered = [bos, *rendered]
        if rendered[:len(so_far)] != so_far:
            raise _Refused(400, "the prompt does not extend the session's tokens (send its text back verbatim)")
        text, turn = await self._turn(ep, rendered[len(so_far):], req.max_tokens, req.stop)
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model or "policy",
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": "length" if turn.finish == "length" else "stop"}],
            "usage": _usage(ep, turn)})

    async def _turn(self, ep: Episode, new: list[int], max_tokens: int | None,
                    stop: str | list[str] | None) -> tuple[str, Any]:
        if new:
            ep.observe_ids(new)
        turn = await ep.generate(max_new_tokens=max_tokens, stop=[stop] if isinstance(stop, str) else stop)
        ids = ep.sample.response_ids[turn.start:turn.end]
        if turn.finish == "stop" and ids and ids[-1] in ep.tokenizer.all_special_ids:
            ids = ids[:-1]  # the end-of-turn token: the template writes it again when it renders the answer
        return ep.tokenizer.decode(ids, skip_special_tokens=False), turn


def _render(ep: Episode, messages: list[dict[str, Any]]) -> list[int]:
    out = ep.tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _usage(ep: Episode, turn: Any) -> dict[str, int]:
    prompt = len(ep.sample.prompt_ids) + turn.start
    return {"prompt_tokens": prompt, "completion_tokens": turn.end - turn.start,
            "total_tokens": prompt + turn.end - turn.start}


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json_error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """OpenAI's error shape; a refused request records nothing and the server keeps serving."""
    try:
        return await handler(request)
    except _Refused as e:
        return _json_error(e.status, str(e))
    except web.HTTPException as e:  # aiohttp's own (no such route, wrong method)
        if e.status < 400:
            raise
        return _json_error(e.status, e.reason)
    except Exception as e:  # noqa: BLE001 - the episode's engines failed: the agent sees why
        return _json_error(502, f"{type(e).__name__}: {e}", "server_error")
