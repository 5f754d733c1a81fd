"""Distributed weight updates: SGLang's init / update / destroy weights-update-group routes, over gloo
(CPU tensors) or NCCL (tensors on the engine's GPU). The broadcast itself, both sides, is
`streamrl.weights.broadcast`; these routes only join the group and receive into the engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from ...weights import join_group, receive
from .common import BadRequest, ServerState, convert, json_response, read_json, state_of
from .control import apply_weights


class InitGroupReq(msgspec.Struct):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    timeout_s: float = 600.0  # streamrl extra: how long a rendezvous / broadcast may block


class UpdateDistributedReq(msgspec.Struct):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class DestroyGroupReq(msgspec.Struct):
    group_name: str = "weight_update_group"


def _device(st: ServerState) -> str:
    dev = str(getattr(st.engine, "device", "cpu"))
    return "cuda:0" if dev == "cuda" else dev


def _groups(st: ServerState) -> dict[str, Any]:
    return st.extra.setdefault("groups", {})


async def init_weights_update_group(request: web.Request) -> web.Response:
    st = state_of(request)
    req = convert(await read_json(request), InitGroupReq)
    device = _device(st)
    if req.backend not in ("gloo", "nccl"):
        msg, ok = f"backend {req.backend!r} is not supported: use gloo or nccl", False
    elif req.backend == "nccl" and not device.startswith("cuda"):
        msg, ok = "backend 'nccl' needs an engine on a CUDA device; use gloo for a CPU engine", False
    elif req.group_name in _groups(st):
        msg, ok = f"group {req.group_name!r} already exists", False
    else:
        try:
            pg = await asyncio.to_thread(
                join_group, req.master_address, req.master_port, req.rank_offset, req.world_size,
                group_name=req.group_name, backend=req.backend, device=device, timeout_s=req.timeout_s)
            _groups(st)[req.group_name] = (pg, device if req.backend == "nccl" else "cpu")
            msg, ok = "Succeeded to initialize custom process group.", True
        except Exception as e:  # noqa: BLE001 - reported as success=False, as SGLang does
            msg, ok = f"Failed to initialize custom process group: {e}", False
    return json_response({"success": ok, "message": msg}, 200 if ok else 400)


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    st = state_of(request)
    req = convert(await read_json(request), UpdateDistributedReq)
    if not len(req.names) == len(req.dtypes) == len(req.shapes):
        raise BadRequest("names, dtypes and shapes must have the same length")
    import torch

    bad = [d for d in req.dtypes if not isinstance(getattr(torch, d.removeprefix("torch."), None), torch.dtype)]
    if bad:
        raise BadRequest(f"unknown dtype {bad[0]!r}")
    group = _groups(st).get(req.group_name)
    if group is None:
        return json_response({"success": False, "message": f"no weight-update group {req.group_name!r}"}, 400)
    pg, device = group

    async def load(version: str) -> None:
        # generation goes on meanwhile
        tensors = await asyncio.to_thread(receive, pg, req.names, req.dtypes, req.shapes, device)
        await st.engine.update_weights_from_state_dict(tensors, version)

    ok, msg, _ = await apply_weights(st, load, req.weight_version, req.abort_all_requests)
    return json_response({"success": ok, "message": msg}, 200 if ok else 400)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    req = convert(await read_json(request), DestroyGroupReq)
    ok = _groups(state_of(request)).pop(req.group_name, None) is not None
    msg = "Succeeded to destroy custom process group." if ok else f"no weight-update group {req.group_name!r}"
    return json_response({"success": ok, "message": msg}, 200 if ok else 400)
