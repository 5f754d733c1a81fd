"""`streamrl serve`: SGLang's native HTTP API (and an OpenAI subset) in front of any streamrl Engine.

Request and response shapes, status codes and error bodies are SGLang's (see docs/http.md for the
few differences), so rollout code, `sglang-router` and SGLang clients cannot tell it from SGLang.

Data path: a route parses and validates the JSON body (400 `{"error": {"message"}}` on any problem),
turns it into one `GenItem` per engine request (batches and `n > 1` expand here), and `Streams` runs
them through `engine.generate_stream` concurrently. Non-streaming routes collect the final results;
streaming routes turn engine chunks into SSE events. Closing a `Streams` (client gone, handler
cancelled) aborts every unfinished request, so a disconnect frees the engine slot as SGLang does.

Run: `python -m streamrl.engine.http.server --model DIR --port 30000`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import logging
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from ..protocol import EngineError, GenerateChunk

log = logging.getLogger("streamrl.http")
HEALTH_CHECK_TIMEOUT = 20.0
try:
    VERSION = importlib.metadata.version("streamrl")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source checkout without install
    VERSION = "0.0.0"


# ---- plumbing ------------------------------------------------------------------------------------
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

    def tokenize(self, text: str) -> list[int]:
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            raise BadRequest("this engine has no tokenizer: send input_ids instead of text")
        return list(tok(text)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        tok = getattr(self.engine, "tokenizer", None)
        return tok.decode(ids, skip_special_tokens=skip_special_tokens) if tok is not None and ids else ""

    def in_flight(self) -> int:
        s = self.engine.stats()
        return int(s.get("running", 0)) + int(s.get("waiting", 0))


STATE = web.AppKey("streamrl_state", ServerState)


def state_of(request: web.Request) -> ServerState:
    return request.app[STATE]


# ---- running requests ----------------------------------------------------------------------------
@dataclass
class GenItem:
    """One engine request of an HTTP call (a batch or `n > 1` makes several)."""

    input_ids: list[int]
    params: dict[str, Any]
    rid: str
    return_logprob: bool = False
    text_in_logprobs: bool = False
    ids: list[int] = field(default_factory=list)  # output so far (streaming)
    logprobs: list[float] = field(default_factory=list)
    version: str = ""


class Streams:
    """Runs GenItems through `engine.generate_stream` concurrently and merges their chunks.

    `start()` validates: every request is checked and submitted synchronously on its pump's first
    step, so after one loop turn each has either been accepted or raised (→ BadRequest, nothing keeps
    running). `events()` yields `(index, chunks)` with every chunk already delivered for that request
    coalesced, so a request's last token and its finish arrive as one event. `aclose()` aborts every
    unfinished request.
    """

    def __init__(self, st: ServerState, items: list[GenItem]) -> None:
        self.st, self.items = st, items
        self._queue: asyncio.Queue[tuple[int, GenerateChunk | Exception]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._open = len(items)

    async def start(self) -> None:
        self.st.inflight.update(it.rid for it in self.items)
        self._tasks = [asyncio.create_task(self._pump(i, it)) for i, it in enumerate(self.items)]
        await asyncio.sleep(0)  # each pump validates + submits (or fails) on its first step
        errors = [x for _, x in self._queue._queue if isinstance(x, Exception)]  # type: ignore[attr-defined]
        if errors:
            await self.aclose()
            raise BadRequest(str(errors[0]))

    async def _pump(self, i: int, it: GenItem) -> None:
        try:
            async for chunk in self.st.engine.generate_stream(it.input_ids, it.params, it.rid):
                self._queue.put_nowait((i, chunk))
        except Exception as e:  # noqa: BLE001 - reported to the HTTP caller
            self._queue.put_nowait((i, e))
        finally:
            self.st.inflight.discard(it.rid)

    async def events(self) -> AsyncIterator[tuple[int, list[GenerateChunk]]]:
        while self._open:
            got = [await self._queue.get()]
            while not self._queue.empty():
                got.append(self._queue.get_nowait())
            grouped: dict[int, list[GenerateChunk]] = {}
            for i, x in got:
                if isinstance(x, Exception):
                    raise x
                grouped.setdefault(i, []).append(x)
                self._open -= x.finished
            for i, chunks in grouped.items():
                yield i, chunks

    async def aclose(self) -> None:
        pending = [t for t in self._tasks if not t.done()]
        for t in pending:
            t.cancel()  # the engine's stream aborts its request when closed early
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for it in self.items:
            self.st.inflight.discard(it.rid)

    async def collect(self) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = [{} for _ in self.items]
        async for i, chunks in self.events():
            if chunks[-1].finished:
                results[i] = chunks[-1].result or {}
        return results


def shape_result(st: ServerState, it: GenItem, result: dict[str, Any]) -> dict[str, Any]:
    """The engine's SGLang-shaped result, with logprobs only when asked for (as SGLang does)."""
    meta = dict(result["meta_info"])
    lps = meta.pop("output_token_logprobs", [])
    if it.return_logprob:
        if it.text_in_logprobs:
            lps = [[lp, t, st.decode([t], False)] for lp, t, _ in lps]
        meta["output_token_logprobs"] = lps
    return {**result, "meta_info": meta}


def partial_result(st: ServerState, it: GenItem) -> dict[str, Any]:
    """A cumulative, unfinished streaming chunk (SGLang's default non-incremental streaming)."""
    meta: dict[str, Any] = {
        "id": it.rid, "finish_reason": None, "prompt_tokens": len(it.input_ids),
        "completion_tokens": len(it.ids), "cached_tokens": 0, "weight_version": it.version,
    }
    if it.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, t, st.decode([t], False) if it.text_in_logprobs else None]
            for lp, t in zip(it.logprobs, it.ids, strict=True)
        ]
    text = st.decode(it.ids, bool(it.params.get("skip_special_tokens", True)))
    return {"text": text, "output_ids": list(it.ids), "meta_info": meta}


def feed(it: GenItem, chunks: list[GenerateChunk]) -> GenerateChunk | None:
    """Accumulate streamed tokens into `it`; return the finishing chunk if there is one."""
    for c in chunks:
        it.ids += c.token_ids
        it.logprobs += c.logprobs
        it.version = c.weight_version
        if c.finished:
            return c
    return None


# ---- /generate -----------------------------------------------------------------------------------
class GenerateReq(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang's GenerateReqInput. Fields streamrl cannot honour must keep their defaults."""

    text: Any = None
    input_ids: Any = None
    input_embeds: Any = None
    sampling_params: Any = None
    rid: Any = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: Any = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    return_hidden_states: bool | list[bool] = False
    return_entropy: bool = False
    modalities: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    session_params: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    data_parallel_rank: int | None = None
    priority: int | None = None
    extra_key: Any = None
    no_logs: bool = False
    custom_labels: Any = None
    conversation_id: Any = None
    background: bool = False


_UNSUPPORTED = ("input_embeds", "token_ids_logprob", "image_data", "video_data", "audio_data",
                "session_params", "lora_path", "lora_id", "custom_logit_processor")


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


def generate_items(st: ServerState, req: GenerateReq) -> tuple[list[GenItem], bool]:
    """Expand a /generate request into engine requests. Returns (items, single_response)."""
    if sum(x is not None for x in (req.text, req.input_ids, req.input_embeds)) != 1:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    for name in _UNSUPPORTED:
        if getattr(req, name) is not None:
            raise BadRequest(f"{name} is not supported by streamrl serve")
    for name in ("top_logprobs_num", "return_hidden_states"):
        v = getattr(req, name)
        if any(v if isinstance(v, list) else [v]):
            raise BadRequest(f"{name} is not supported by streamrl serve")
    if req.return_entropy:
        raise BadRequest("return_entropy is not supported by streamrl serve")
    starts = req.logprob_start_len if isinstance(req.logprob_start_len, list) else [req.logprob_start_len]
    if any(s != -1 for s in starts):
        raise BadRequest("input (prompt) logprobs are not supported: leave logprob_start_len at -1")
    if req.text is not None:
        if isinstance(req.text, str):
            prompts, single = [st.tokenize(req.text)], True
        elif isinstance(req.text, list) and req.text and all(isinstance(t, str) for t in req.text):
            prompts, single = [st.tokenize(t) for t in req.text], False
        else:
            raise BadRequest("text must be a string or a non-empty list of strings")
    elif _is_ids(req.input_ids):
        prompts, single = [req.input_ids], True
    elif isinstance(req.input_ids, list) and req.input_ids and all(_is_ids(x) for x in req.input_ids):
        prompts, single = req.input_ids, False
    else:
        raise BadRequest("input_ids must be a list of token ids or a non-empty list of such lists")
    b = len(prompts)
    sps = req.sampling_params
    if sps is None or isinstance(sps, dict):
        sps = [sps or {}] * b
    elif not (isinstance(sps, list) and not single and all(isinstance(s, dict) for s in sps)):
        raise BadRequest("sampling_params must be an object (or, for a batch, a list of objects)")
    sps = _per_item(sps, b, "sampling_params")
    ns = {s.get("n", 1) for s in sps}
    n = ns.pop() if len(ns) == 1 else None
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        raise BadRequest("sampling_params.n must be an integer >= 1, the same for the whole batch")
    if req.rid is None:
        rids: list[str | None] = [None] * b
    elif isinstance(req.rid, str):
        rids = [req.rid] if single else [f"{req.rid}_{i}" for i in range(b)]
    elif isinstance(req.rid, list) and all(isinstance(r, str) for r in req.rid):
        rids = _per_item(req.rid, b, "rid")
    else:
        raise BadRequest("The rid should be a string or a list of strings.")
    logprob = _per_item(req.return_logprob, b, "return_logprob")
    items = []
    for i in range(b):
        params = {k: v for k, v in sps[i].items() if k != "n"}
        for k in range(n):
            base = rids[i]
            rid = (base if n == 1 else f"{base}_{k}") if base is not None else uuid.uuid4().hex
            items.append(GenItem(list(prompts[i]), params, rid, bool(logprob[i]), req.return_text_in_logprobs))
    return items, single and n == 1


async def generate(request: web.Request) -> web.StreamResponse:
    st = state_of(request)
    req = convert(await read_json(request), GenerateReq)
    items, single = generate_items(st, req)
    streams = Streams(st, items)
    await streams.start()
    try:
        if not req.stream:
            results = [shape_result(st, it, r) for it, r in zip(items, await streams.collect(), strict=True)]
            return json_response(results[0] if single else results)
        resp = await start_sse(request)
        try:
            async for i, chunks in streams.events():
                it = items[i]
                done = feed(it, chunks)
                out = shape_result(st, it, done.result or {}) if done else partial_result(st, it)
                if not single:
                    out["index"] = i
                await resp.write(sse(out))
        except ConnectionResetError:
            return resp  # client went away: `finally` aborts what is left
        except Exception as e:  # noqa: BLE001 - after the headers, errors travel in-band (as SGLang)
            await resp.write(sse({"error": {"message": str(e)}}))
        with contextlib.suppress(ConnectionResetError):
            await resp.write(SSE_DONE)
        return resp
    finally:
        await streams.aclose()


# ---- control plane -------------------------------------------------------------------------------
class AbortReq(msgspec.Struct):
    rid: str = ""
    abort_all: bool = False


class PauseReq(msgspec.Struct):
    mode: str = "abort"


class UpdateFromDiskReq(msgspec.Struct):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False


class UpdateVersionReq(msgspec.Struct):
    new_version: str
    abort_all_requests: bool = True


class MemoryReq(msgspec.Struct):
    tags: list[str] | None = None


async def abort_request(request: web.Request) -> web.Response:
    st = state_of(request)
    req = convert(await read_json(request), AbortReq)
    if req.abort_all:
        await st.engine.abort_all()
    elif req.rid:  # exact rid, plus the `rid_<i>` requests a batch / n > 1 expanded it into
        for rid in {req.rid} | {r for r in st.inflight if r.startswith(req.rid)}:
            await st.engine.abort(rid)
    return web.Response(status=200)


async def pause_generation(request: web.Request) -> web.Response:
    req = convert(await read_json(request), PauseReq)
    await state_of(request).engine.pause(req.mode)
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    await read_json(request)
    await state_of(request).engine.resume()
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


def is_paused(engine: Any) -> bool:
    return bool(getattr(engine, "is_paused", engine.stats().get("paused", False)))


async def apply_weights(st: ServerState, load: Any, version: str | None, abort_all: bool) -> tuple[bool, str, int]:
    """Shared by the weight-update routes. Keeps the version unless one is given (SGLang)."""
    if abort_all:
        await st.engine.abort_all()
    paused = st.in_flight() if is_paused(st.engine) else 0
    try:
        await load(version if version is not None else st.engine.weight_version)
    except Exception as e:  # noqa: BLE001 - reported as success=False, as SGLang does
        return False, f"Failed to update weights: {e}", 0
    msg = "Succeeded to update model weights."
    if version is not None:
        msg += f" Weight version updated to {version}."
    return True, msg, paused


async def update_weights_from_disk(request: web.Request) -> web.Response:
    st = state_of(request)
    req = convert(await read_json(request), UpdateFromDiskReq)
    if req.load_format not in (None, "auto", "safetensors"):
        raise BadRequest(f"load_format {req.load_format!r} is not supported (safetensors only)")
    ok, msg, paused = await apply_weights(
        st, lambda v: st.engine.update_weights_from_disk(req.model_path, v), req.weight_version,
        req.abort_all_requests,
    )
    if ok:
        st.model_path = req.model_path
    return json_response({"success": ok, "message": msg, "num_paused_requests": paused}, 200 if ok else 400)


async def update_weight_version(request: web.Request) -> web.Response:
    st = state_of(request)
    req = convert(await read_json(request), UpdateVersionReq)
    if req.abort_all_requests:
        await st.engine.abort_all()
    await st.engine.update_weights_from_state_dict({}, req.new_version)  # no tensors: just the version
    return json_response(
        {"success": True, "message": f"Weight version updated to {req.new_version}", "new_version": req.new_version}
    )


async def release_memory(request: web.Request) -> web.Response:
    convert(await read_json(request), MemoryReq)
    await state_of(request).engine.release_memory()
    return json_response(None)


async def resume_memory(request: web.Request) -> web.Response:
    convert(await read_json(request), MemoryReq)
    await state_of(request).engine.resume_memory()
    return json_response(None)


async def flush_cache(request: web.Request) -> web.Response:
    ok = await state_of(request).engine.flush_cache()
    text = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n")
    return web.Response(text=text, status=200 if ok else 400)


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if await state_of(request).engine.health() else 503)


async def health_generate(request: web.Request) -> web.Response:
    """One greedy token through the engine (SGLang's check). While paused nothing can run, so the
    engine's own liveness answers instead."""
    eng = state_of(request).engine
    if not await eng.health():
        return web.Response(status=503)
    if is_paused(eng):
        return web.Response(status=200)
    rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
    try:
        await asyncio.wait_for(eng.generate([0], {"max_new_tokens": 1, "temperature": 0.0}, rid), HEALTH_CHECK_TIMEOUT)
    except Exception:  # noqa: BLE001 - any failure is "unhealthy"
        await eng.abort(rid)
        return web.Response(status=503)
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    st = state_of(request)
    return json_response({
        "model_path": st.model_path, "tokenizer_path": st.settings.get("tokenizer_path", st.model_path),
        "is_generation": True, "preferred_sampling_params": None, "weight_version": st.engine.weight_version,
    })


async def weight_version(request: web.Request) -> web.Response:
    return json_response({"weight_version": state_of(request).engine.weight_version})


async def server_info(request: web.Request) -> web.Response:
    st = state_of(request)
    eng = st.engine
    sched = getattr(eng, "scheduler", None)
    return json_response({
        "model_path": st.model_path, "tokenizer_path": st.settings.get("tokenizer_path", st.model_path),
        "served_model_name": st.model_name, "engine": type(eng).__name__,
        "device": str(getattr(eng, "device", "")), "dtype": str(getattr(eng, "dtype", "")).replace("torch.", ""),
        "context_length": getattr(eng, "context_len", None), "vocab_size": getattr(eng, "vocab_size", None),
        "max_running_requests": getattr(sched, "max_running", None),
        "max_total_num_tokens": getattr(sched, "max_total_tokens", None),
        "tp_size": 1, "dp_size": 1, "weight_version": eng.weight_version, "api_key_required": bool(st.api_key),
        **st.settings, "internal_states": [eng.stats()], "version": VERSION,
    })


def _load(st: ServerState) -> dict[str, Any]:
    s = st.engine.stats()
    return {"dp_rank": 0, "num_running_reqs": s.get("running", 0), "num_waiting_reqs": s.get("waiting", 0),
            "gen_throughput": s.get("tokens_per_s", 0.0)}


async def loads(request: web.Request) -> web.Response:
    load = _load(state_of(request))
    return json_response({
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(), "version": VERSION, "dp_rank_count": 1,
        "loads": [load],
        "aggregate": {"total_running_reqs": load["num_running_reqs"], "total_waiting_reqs": load["num_waiting_reqs"],
                      "total_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                      "avg_gen_throughput": load["gen_throughput"]},
    })


async def get_load(request: web.Request) -> web.Response:
    load = _load(state_of(request))
    return json_response([{"dp_rank": 0, "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                           "num_waiting_reqs": load["num_waiting_reqs"]}])


# ---- the app -------------------------------------------------------------------------------------
@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if key and not request.path.startswith("/health") and request.headers.get("Authorization") != f"Bearer {key}":
        return json_response({"error": "Unauthorized"}, 401)
    return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return json_response({"detail": e.reason}, e.status)
    except (BadRequest, EngineError, ValueError, TypeError, KeyError) as e:
        return error_response(str(e))
    except ConnectionResetError:
        raise
    except Exception as e:  # noqa: BLE001 - never a 500: the server keeps serving
        log.exception("error handling %s %s", request.method, request.path)
        return error_response(f"{type(e).__name__}: {e}")


def build_app(engine: Any, *, api_key: str | None = None, model_name: str | None = None) -> web.Application:
    """An aiohttp app serving `engine` with SGLang's API. Run it with `handler_cancellation=True`
    (as `serve` does) so that a client disconnecting from a non-streaming request aborts it too."""
    from .openai_api import add_openai_routes

    path = str(getattr(engine, "model_path", "") or "")
    app = web.Application(middlewares=[_auth, _errors], client_max_size=256 * 1024**2)
    app[STATE] = ServerState(engine=engine, api_key=api_key, model_name=model_name or path, model_path=path)
    r = app.router
    for p in ("/generate",):
        r.add_post(p, generate)
        r.add_put(p, generate)
    r.add_post("/abort_request", abort_request)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/update_weight_version", update_weight_version)
    for p, h in (("/release_memory_occupation", release_memory), ("/resume_memory_occupation", resume_memory),
                 ("/flush_cache", flush_cache)):
        r.add_get(p, h, allow_head=False)
        r.add_post(p, h)
    for p, h in (("/health", health), ("/health_generate", health_generate), ("/model_info", model_info),
                 ("/get_model_info", model_info), ("/server_info", server_info), ("/get_server_info", server_info),
                 ("/get_weight_version", weight_version), ("/v1/loads", loads), ("/get_load", get_load)):
        r.add_get(p, h)
    add_openai_routes(app)
    return app


async def serve(
    engine: Any, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None, *,
    model_name: str | None = None, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None,
) -> None:
    """Serve until `stop` is set (or the task is cancelled). Prints the listening line once bound."""
    app = build_app(engine, api_key=api_key, model_name=model_name)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        app[STATE].settings.update(host=host, port=bound)
        print(f"streamrl serve: listening on http://{host}:{bound}", flush=True)
        if ready is not None:
            ready.set()
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m streamrl.engine.http.server", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face model folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (all but /health*)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--weight-version", default="default")
    args = p.parse_args(argv)

    async def run() -> None:
        from ..torch_engine import TorchEngine

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        engine = TorchEngine(args.model, device=args.device, dtype=args.dtype, weight_version=args.weight_version,
                             max_running_requests=args.max_running_requests)
        async with engine:
            await serve(engine, args.host, args.port, args.api_key, model_name=args.served_model_name, stop=stop)
        print("streamrl serve: stopped", flush=True)

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
