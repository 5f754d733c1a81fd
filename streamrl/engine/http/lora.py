"""LoRA adapter routes of `streamrl serve`, under SGLang's names (`/load_lora_adapter`,
`/unload_lora_adapter`) and vLLM's (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`), with both
servers' request bodies (`lora_name`, `lora_path`): a trainer pushes adapters to `streamrl serve`
exactly as it pushes them to SGLang or vLLM.

The engine merges the adapter into its weights (TorchEngine.load_lora_adapter), so one adapter is
active at a time: loading another replaces it, as any weight update does (requests in flight go on
with the new weights, and their tokens carry the new weight version). A request naming an adapter
(`lora_path` in /generate) must name one loaded and not unloaded since; it gets the active one.
Unloading the active adapter puts the base weights back.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from ...weights.lora import Adapter, load_adapter
from .common import BadRequest, ServerState, convert, json_response, read_json, state_of
from .control import apply_weights


class LoraReq(msgspec.Struct):
    lora_name: str
    lora_path: str | None = None
    pinned: bool = False  # SGLang's: an adapter kept in GPU memory; one merged adapter is always "pinned"
    load_inplace: bool = False  # vLLM's: replace an adapter of the same name


def _state(st: ServerState) -> dict[str, Any]:
    return st.extra.setdefault("lora", {"active": None, "loaded": []})


def check_request(st: ServerState, lora_path: Any) -> None:
    """A /generate request's `lora_path` (one name, or one per item of a batch) names a loaded adapter."""
    loaded = _state(st)["loaded"]
    for name in lora_path if isinstance(lora_path, list) else [lora_path]:
        if name is not None and name not in loaded:
            raise BadRequest(f"LoRA adapter {name!r} is not loaded", 404)


async def load_lora_adapter(request: web.Request) -> web.Response:
    st = state_of(request)
    req = convert(await read_json(request), LoraReq)
    if not req.lora_name:
        raise BadRequest("lora_name must not be empty")
    if not req.lora_path:
        raise BadRequest("lora_path is required: a folder in peft's format")
    try:
        adapter = await asyncio.to_thread(load_adapter, req.lora_path)
    except (ValueError, OSError) as e:
        raise BadRequest(f"cannot load LoRA adapter {req.lora_name!r}: {e}") from None
    lora = _state(st)
    if req.lora_name in lora["loaded"] and not req.load_inplace:
        raise BadRequest(f"LoRA adapter {req.lora_name!r} is already loaded (load_inplace: true replaces it)")
    ok, msg, _ = await apply_weights(st, lambda v: st.engine.load_lora_adapter(adapter, v), None, False)
    if not ok:
        return json_response({"success": False, "error_message": msg}, 400)
    lora["active"] = req.lora_name
    lora["loaded"] = [n for n in lora["loaded"] if n != req.lora_name] + [req.lora_name]
    return json_response({"success": True, "error_message": "", "loaded_adapters": {
        n: req.lora_path if n == req.lora_name else None for n in lora["loaded"]}})


async def unload_lora_adapter(request: web.Request) -> web.Response:
    st = state_of(request)
    req = convert(await read_json(request), LoraReq)
    lora = _state(st)
    if req.lora_name not in lora["loaded"]:
        raise BadRequest(f"LoRA adapter {req.lora_name!r} is not loaded", 404)
    if req.lora_name == lora["active"]:  # the base weights back: an adapter that adapts nothing
        ok, msg, _ = await apply_weights(
            st, lambda v: st.engine.load_lora_adapter(Adapter(tensors={}, rank=1, alpha=1.0), v), None, False)
        if not ok:
            return json_response({"success": False, "error_message": msg}, 400)
        lora["active"] = None
    lora["loaded"].remove(req.lora_name)
    return json_response({"success": True, "error_message": "", "loaded_adapters": {n: None for n in lora["loaded"]}})


def add_routes(r: web.UrlDispatcher) -> None:
    for prefix in ("", "/v1"):
        r.add_post(f"{prefix}/load_lora_adapter", load_lora_adapter)
        r.add_post(f"{prefix}/unload_lora_adapter", unload_lora_adapter)
