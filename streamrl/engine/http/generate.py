"""SGLang's /generate: request parsing, batch and `n > 1` expansion, JSON and SSE responses."""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import msgspec
from aiohttp import web

from .common import (
    SSE_DONE,
    BadRequest,
    ServerState,
    convert,
    json_response,
    read_json,
    sse,
    start_sse,
    state_of,
)
from .lora import check_request as check_lora
from .streams import GenItem, Streams, feed


class GenerateReq(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The part of SGLang's GenerateReqInput that streamrl honours (see `_IGNORED`, `_UNSUPPORTED`)."""

    text: Any = None
    input_ids: Any = None
    sampling_params: Any = None
    rid: Any = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    return_text_in_logprobs: bool = False
    stream: bool = False


# SGLang fields accepted and ignored (scheduling / logging hints that change no output) ...
# (`model` is sent as null by sglang-router 0.3.2.)
_IGNORED = ("model", "log_metrics", "priority", "data_parallel_rank", "routed_dp_rank", "no_logs", "custom_labels",
            "conversation_id", "extra_key", "bootstrap_host", "bootstrap_port", "bootstrap_room",
            "bootstrap_pair_key", "modalities", "received_time", "external_trace_header")
# ... and fields whose features streamrl lacks: accepted only at their "off" value (null / false / 0).
_UNSUPPORTED = ("input_embeds", "token_ids_logprob", "image_data", "video_data", "audio_data", "session_params",
                "lora_id", "custom_logit_processor", "top_logprobs_num", "return_hidden_states",
                "return_entropy", "return_bytes", "return_routed_experts", "background")


def parse_generate(body: dict[str, Any], st: ServerState | None = None) -> GenerateReq:
    if st is not None:  # `lora_path`: the adapter the request is for, which must be the one merged in
        check_lora(st, body.pop("lora_path", None))
    for name in _IGNORED:
        body.pop(name, None)
    for name in _UNSUPPORTED:
        v = body.pop(name, None)
        if any(v if isinstance(v, list) else [v]):
            raise BadRequest(f"{name} is not supported by streamrl serve")
    return convert(body, GenerateReq)


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
    if (req.text is None) == (req.input_ids is None):
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    starts = req.logprob_start_len if isinstance(req.logprob_start_len, list) else [req.logprob_start_len]
    if any(s != -1 for s in starts):
        raise BadRequest("input (prompt) logprobs are not supported: leave logprob_start_len at -1")
    texts: list[str] | None = None
    if req.text is not None:
        if isinstance(req.text, str):
            texts, single = [req.text], True
        elif isinstance(req.text, list) and req.text and all(isinstance(t, str) for t in req.text):
            texts, single = req.text, False
        else:
            raise BadRequest("text must be a string or a non-empty list of strings")
        b = len(texts)
    elif _is_ids(req.input_ids):
        prompts, single, b = [req.input_ids], True, 1
    elif isinstance(req.input_ids, list) and req.input_ids and all(_is_ids(x) for x in req.input_ids):
        prompts, single, b = req.input_ids, False, len(req.input_ids)
    else:
        raise BadRequest("input_ids must be a list of token ids or a non-empty list of such lists")
    sps = req.sampling_params
    if sps is None or isinstance(sps, dict):
        sps = [sps or {}] * b
    elif not (isinstance(sps, list) and not single and all(isinstance(s, dict) for s in sps)):
        raise BadRequest("sampling_params must be an object (or, for a batch, a list of objects)")
    sps = _per_item(sps, b, "sampling_params")
    n = sps[0].get("n", 1)
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1) or any(s.get("n", 1) != n for s in sps):
        raise BadRequest("sampling_params.n must be an integer >= 1, the same for the whole batch")
    st.check_items(b * n)  # before any prompt is tokenized or expanded
    if texts is not None:
        prompts = [st.tokenize(t) for t in texts]
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


async def generate(request: web.Request) -> web.StreamResponse:
    st = state_of(request)
    req = parse_generate(await read_json(request), st)
    items, single = await st.off_loop(generate_items, st, req)
    streams = Streams(st, items, stream=bool(req.stream))
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
