"""The control-plane and info routes of `streamrl serve`: abort, pause, weight updates from disk, memory,
cache, health, model / server info and load."""

from __future__ import annotations

import asyncio
import datetime
import importlib.metadata
import uuid
from typing import Any

import msgspec
from aiohttp import web

from .common import BadRequest, ServerState, convert, json_response, read_json, state_of

HEALTH_CHECK_TIMEOUT = 20.0
try:
    VERSION = importlib.metadata.version("streamrl")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source checkout without install
    VERSION = "0.0.0"


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
        st.extra.pop("lora", None)  # full weights: no adapter is active any more (http/lora.py)
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
    req = convert(await read_json(request), MemoryReq)
    # SGLang's tags: kv_cache, weights (none given: both). The KV cache is always freed.
    await state_of(request).engine.release_memory(weights=req.tags is None or "weights" in req.tags)
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
        # Every engine setting the server runs with (streamrl's engines; SGLang lists its server args).
        **({"engine_args": msgspec.structs.asdict(eng.args)} if isinstance(getattr(eng, "args", None), msgspec.Struct)
           else {}),
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
