"""OpenAI-compatible routes of `streamrl serve`: /v1/models, /v1/completions, /v1/chat/completions.

Requests become the same `GenItem`s as /generate and run through the same `Streams`, so batching,
validation (400 on any problem), disconnect-aborts and weight versions behave identically. Unknown
request fields are ignored, as OpenAI-compatible servers do. Models without a chat template get the
prompt "role: content\\n" per message (see docs/http.md).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
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
from .streams import GenItem, Streams, feed


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # SGLang's extra sampling fields
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: str | None = None


class CompletionReq(_Common, kw_only=True):
    prompt: Any = None
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatReq(_Common, kw_only=True):
    messages: Any = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Any = None
    response_format: Any = None


def _sampling(req: _Common, max_tokens: int) -> dict[str, Any]:
    sp: dict[str, Any] = {
        "max_new_tokens": max_tokens, "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p, "top_k": req.top_k, "min_p": req.min_p,
        "min_new_tokens": req.min_tokens, "stop": req.stop, "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos, "skip_special_tokens": req.skip_special_tokens,
        "no_stop_trim": req.no_stop_trim,
    }
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        if getattr(req, name) is not None:
            sp[name] = getattr(req, name)
    if req.seed is not None:
        sp["sampling_seed"] = req.seed
    return sp


def _items(st: ServerState, req: _Common, prompts: list[list[int]], logprob: bool) -> list[GenItem]:
    if not isinstance(req.n, int) or req.n < 1:
        raise BadRequest(f"n must be >= 1, got {req.n}")
    st.check_items(len(prompts) * req.n)
    if req.logit_bias:
        raise BadRequest("logit_bias is not supported by streamrl serve")
    ctx = int(getattr(st.engine, "context_len", 1 << 30))
    base = req.rid or uuid.uuid4().hex
    items = []
    for p, ids in enumerate(prompts):
        max_tokens = req.max_tokens if req.max_tokens is not None else max(ctx - len(ids), 0)
        for k in range(req.n):
            rid = base if len(prompts) * req.n == 1 else f"{base}_{p * req.n + k}"
            items.append(GenItem(list(ids), _sampling(req, max_tokens), rid, logprob))
    return items


def _finish(result: dict[str, Any] | None) -> tuple[str | None, Any]:
    fr = (result or {}).get("meta_info", {}).get("finish_reason")
    return (fr["type"], fr.get("matched")) if fr else (None, None)


def _usage(items: list[GenItem], n: int, results: list[dict[str, Any]] | None = None) -> dict[str, int]:
    prompt = sum(len(it.input_ids) for it in items[::n])  # each prompt counts once, whatever n
    done = sum(len(r["output_ids"]) for r in results) if results is not None else sum(len(it.ids) for it in items)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


async def _respond(
    request: web.Request, st: ServerState, req: _Common, items: list[GenItem], obj: str,
    choice: Callable[[int, GenItem, dict[str, Any]], dict[str, Any]],
    delta: Callable[[int, GenItem, str, list[int], list[float], bool], dict[str, Any]],
) -> web.StreamResponse:
    """Run `items`; answer with one JSON body, or with SSE chunks built by `delta` (`[DONE]` last)."""
    streams = Streams(st, items, stream=bool(req.stream))
    await streams.start()
    head = {"id": items[0].rid, "object": obj, "created": int(time.time()), "model": req.model or st.model_name}
    try:
        if not req.stream:
            results = await streams.collect()
            return json_response({
                **head, "choices": [choice(i, it, r) for i, (it, r) in enumerate(zip(items, results, strict=True))],
                "usage": _usage(items, req.n, results), "metadata": {"weight_version": st.engine.weight_version},
            })
        resp = await start_sse(request)
        head["object"] = obj + ".chunk" if obj == "chat.completion" else obj
        sent_text = [""] * len(items)
        sent_tokens = [0] * len(items)
        try:
            async for i, chunks in streams.events():
                it = items[i]
                done = feed(it, chunks)
                text = st.decode(it.ids, bool(it.params.get("skip_special_tokens", True)))
                if not done and text.endswith("\ufffd"):
                    continue  # an incomplete multi-byte character: wait for the rest
                new_ids, new_lps = it.ids[sent_tokens[i]:], it.logprobs[sent_tokens[i]:]
                c = delta(i, it, text[len(sent_text[i]):], new_ids, new_lps, sent_tokens[i] == 0)
                fr, matched = _finish(done.result if done else None)
                c.update(finish_reason=fr, matched_stop=matched)
                sent_text[i], sent_tokens[i] = text, len(it.ids)
                await resp.write(sse({**head, "choices": [c]}))
            opts = req.stream_options or {}
            if opts.get("include_usage"):
                await resp.write(sse({**head, "choices": [], "usage": _usage(items, req.n)}))
        except ConnectionResetError:
            return resp
        except Exception as e:  # noqa: BLE001 - in-band once the headers are out
            await resp.write(sse({"error": {"message": str(e)}}))
        await resp.write(SSE_DONE)
        return resp
    finally:
        await streams.aclose()


# ---- completions ---------------------------------------------------------------------------------
def _prompts(st: ServerState, prompt: Any) -> list[list[int]]:
    def ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        return [st.tokenize(prompt)]
    if ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        st.check_items(len(prompt))
        return [st.tokenize(p) for p in prompt]
    if isinstance(prompt, list) and prompt and all(ids(p) for p in prompt):
        return prompt
    raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of such lists")


def _completion_logprobs(st: ServerState, ids: list[int], lps: list[float], top: int, offset: int) -> dict:
    tokens = [st.decode([t], False) for t in ids]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    # Alternatives are not computed by the engine: top_logprobs holds the sampled token only.
    return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps, strict=True)] if top > 0 else None}


async def completions(request: web.Request) -> web.StreamResponse:
    st = state_of(request)
    req = convert(await read_json(request), CompletionReq)
    if req.echo or req.suffix is not None or (req.best_of not in (None, req.n)):
        raise BadRequest("echo, suffix and best_of are not supported by streamrl serve")
    want = req.logprobs is not None
    items = _items(st, req, await st.off_loop(_prompts, st, req.prompt), want)

    def choice(i: int, it: GenItem, r: dict[str, Any]) -> dict[str, Any]:
        fr, matched = _finish(r)
        lp = [x[0] for x in r["meta_info"].get("output_token_logprobs", [])]
        logprobs = _completion_logprobs(st, r["output_ids"], lp, req.logprobs or 0, 0) if want else None
        return {"index": i, "text": r["text"], "logprobs": logprobs, "finish_reason": fr, "matched_stop": matched}

    def delta(i: int, it: GenItem, text: str, ids: list[int], lps: list[float], first: bool) -> dict[str, Any]:
        offset = len(st.decode(it.ids[: len(it.ids) - len(ids)], False)) if want else 0
        logprobs = _completion_logprobs(st, ids, lps, req.logprobs or 0, offset) if want else None
        return {"index": i, "text": text, "logprobs": logprobs}

    return await _respond(request, st, req, items, "text_completion", choice, delta)


# ---- chat ----------------------------------------------------------------------------------------
def _chat_prompt(st: ServerState, messages: Any) -> list[int]:
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    norm = []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise BadRequest("every message needs a string role")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest("only text content parts are supported")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise BadRequest("message content must be a string or a list of text parts")
        norm.append({"role": role, "content": content})
    tok = getattr(st.engine, "tokenizer", None)
    if tok is not None and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(norm, add_generation_prompt=True, tokenize=False)
        return st.tokenize(text, add_special_tokens=False)  # the template already has them
    return st.tokenize("".join(f"{m['role']}: {m['content']}\n" for m in norm))


def _chat_logprobs(st: ServerState, ids: list[int], lps: list[float], top: int) -> dict[str, Any]:
    content = []
    for t, lp in zip(ids, lps, strict=True):
        s = st.decode([t], False)
        entry = {"token": s, "logprob": lp, "bytes": list(s.encode())}
        content.append({**entry, "top_logprobs": [entry] if top > 0 else []})  # sampled token only
    return {"content": content}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st = state_of(request)
    req = convert(await read_json(request), ChatReq)
    if req.tools:
        raise BadRequest("tools are not supported by streamrl serve")
    if req.response_format not in (None, {"type": "text"}):
        raise BadRequest("response_format other than text is not supported by streamrl serve")
    if req.max_completion_tokens is not None:
        req.max_tokens = req.max_completion_tokens
    items = _items(st, req, [await st.off_loop(_chat_prompt, st, req.messages)], req.logprobs)
    top = req.top_logprobs or 0

    def choice(i: int, it: GenItem, r: dict[str, Any]) -> dict[str, Any]:
        fr, matched = _finish(r)
        lp = [x[0] for x in r["meta_info"].get("output_token_logprobs", [])]
        return {"index": i, "message": {"role": "assistant", "content": r["text"], "reasoning_content": None,
                                        "tool_calls": None},
                "logprobs": _chat_logprobs(st, r["output_ids"], lp, top) if req.logprobs else None,
                "finish_reason": fr, "matched_stop": matched}

    def delta(i: int, it: GenItem, text: str, ids: list[int], lps: list[float], first: bool) -> dict[str, Any]:
        d = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": i, "delta": d, "logprobs": _chat_logprobs(st, ids, lps, top) if req.logprobs else None}

    return await _respond(request, st, req, items, "chat.completion", choice, delta)


# ---- models --------------------------------------------------------------------------------------
def _card(st: ServerState, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "streamrl", "root": name,
            "max_model_len": getattr(st.engine, "context_len", None)}


async def models(request: web.Request) -> web.Response:
    st = state_of(request)
    return json_response({"object": "list", "data": [_card(st, st.model_name)]})


async def retrieve_model(request: web.Request) -> web.Response:
    st = state_of(request)
    name = request.match_info["model"]
    if name != st.model_name:
        return json_response({"error": {"message": f"The model '{name}' does not exist",
                                        "type": "invalid_request_error", "param": "model",
                                        "code": "model_not_found"}}, 404)
    return json_response(_card(st, name))


def add_openai_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
