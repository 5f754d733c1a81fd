"""`streamrl serve`: SGLang's native HTTP API (and an OpenAI subset) in front of any streamrl Engine.

Request and response shapes, status codes and error bodies are SGLang's (see docs/http.md for the
few differences), so rollout code, `sglang-router` and SGLang clients cannot tell it from SGLang.

Data path: a route parses and validates the JSON body (400 `{"error": {"message"}}` on any problem),
turns it into one `GenItem` per engine request (batches and `n > 1` expand here), and `Streams` runs
them through `engine.generate_stream` concurrently. Non-streaming routes collect the final results;
streaming routes turn engine chunks into SSE events. Closing a `Streams` (client gone, handler
cancelled) aborts every unfinished request, so a disconnect frees the engine slot as SGLang does.

Modules: this one builds the app (routes, auth and error middleware) and runs it (`serve`, `main`);
`common` holds the JSON / SSE helpers and per-app state, `streams` the `GenItem` / `Streams` request
runner, `generate` the /generate route, `control` the control-plane and info routes, `weight_sync`
the gloo weight-update-group routes, `openai_api` the /v1 routes.

Run: `python -m streamrl.engine.http.server --model DIR --port 30000`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import logging
import sys
from typing import Any

import msgspec
from aiohttp import web

from ..args import EngineArgs
from ..protocol import EngineError
from .common import STATE, BadRequest, Limits, ServerState, error_response, is_json, json_response
from .control import (
    abort_request,
    continue_generation,
    flush_cache,
    get_load,
    health,
    health_generate,
    loads,
    model_info,
    pause_generation,
    release_memory,
    resume_memory,
    server_info,
    update_weight_version,
    update_weights_from_disk,
    weight_version,
)
from .generate import generate
from .lora import add_routes as add_lora_routes
from .weight_sync import (
    destroy_weights_update_group,
    init_weights_update_group,
    update_weights_from_distributed,
)

log = logging.getLogger("streamrl.http")


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if key and not request.path.startswith("/health"):
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {key}".encode()):  # constant time: no key by timing
            return json_response({"error": "Unauthorized"}, 401)
    if request.method not in ("GET", "HEAD", "OPTIONS"):
        if "Origin" in request.headers:  # only browsers send it: a page the user opened must not drive the engine
            return error_response("requests from web pages (with an Origin header) are refused", 403)
        # A body with a Content-Type must say JSON: a web page cannot send that cross-origin without a
        # preflight (never granted here), while forms and text/plain can. No Content-Type is read as
        # JSON, as Python clients send it.
        if request.body_exists and "Content-Type" in request.headers and not is_json(request.content_type):
            return error_response(f"send JSON (Content-Type: application/json), not {request.content_type!r}", 415)
    return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return json_response({"detail": e.reason}, e.status)
    except BadRequest as e:
        return error_response(str(e), e.status)
    except (EngineError, ValueError) as e:
        return error_response(str(e))
    except ConnectionResetError:
        raise
    except Exception as e:  # noqa: BLE001 - never a 500: the server keeps serving
        log.exception("error handling %s %s", request.method, request.path)
        return error_response(f"{type(e).__name__}: {e}")


def build_app(engine: Any, *, api_key: str | None = None, model_name: str | None = None,
              limits: Limits | None = None) -> web.Application:
    """An aiohttp app serving `engine` with SGLang's API. Run it with `handler_cancellation=True`
    (as `serve` does) so that a client disconnecting from a non-streaming request aborts it too."""
    from .openai_api import add_openai_routes

    path = str(getattr(engine, "model_path", "") or "")
    limits = limits or Limits()
    app = web.Application(middlewares=[_auth, _errors], client_max_size=limits.max_body_bytes)
    app[STATE] = st = ServerState(engine=engine, api_key=api_key, model_name=model_name or path, model_path=path,
                                  settings={"tokenizer_path": path}, limits=limits)

    async def stop_prep(_: web.Application) -> None:
        st.prep.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_prep)
    r = app.router
    for p in ("/generate",):
        r.add_post(p, generate)
        r.add_put(p, generate)
    r.add_post("/abort_request", abort_request)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/update_weight_version", update_weight_version)
    add_lora_routes(r)
    r.add_post("/init_weights_update_group", init_weights_update_group)
    r.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    r.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    r.add_post("/release_memory_occupation", release_memory)  # POST only: no <img src> frees the KV cache
    r.add_post("/resume_memory_occupation", resume_memory)
    r.add_get("/flush_cache", flush_cache, allow_head=False)  # refused while requests run, so harmless
    r.add_post("/flush_cache", flush_cache)
    for p, h in (("/health", health), ("/health_generate", health_generate), ("/model_info", model_info),
                 ("/get_model_info", model_info), ("/server_info", server_info), ("/get_server_info", server_info),
                 ("/get_weight_version", weight_version), ("/v1/loads", loads), ("/get_load", get_load)):
        r.add_get(p, h)
    add_openai_routes(app)
    return app


async def serve(
    engine: Any, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None, *,
    model_name: str | None = None, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None,
    limits: Limits | None = None,
) -> None:
    """Serve until `stop` is set (or the task is cancelled). Prints the listening line once bound."""
    app = build_app(engine, api_key=api_key, model_name=model_name, limits=limits)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
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
        with contextlib.suppress(Exception):
            await engine.abort_all()  # streams end now instead of holding up the shutdown
        await runner.cleanup()


def main(argv: list[str] | None = None, prog: str = "python -m streamrl.engine.http.server") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face model folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (all but /health*)")
    p.add_argument("--served-model-name", default=None)
    EngineArgs.add_flags(p)  # every engine setting, as `engines.*` gives it to a launched server
    p.add_argument("--allow-no-api-key", action="store_true",
                   help="serve a non-loopback --host without --api-key (anyone who reaches it can drive the engine)")
    d = Limits()
    p.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20, help="largest request body")
    p.add_argument("--max-text-chars", type=int, default=d.max_text_chars, help="longest text prompt")
    p.add_argument("--max-batch-size", type=int, default=d.max_items,
                   help="most generations in one request (batch entries x n)")
    p.add_argument("--read-timeout-s", type=float, default=d.read_timeout_s,
                   help="seconds a request's body may take to arrive")
    args = p.parse_args(argv)
    if not (_is_loopback(args.host) or args.api_key or args.allow_no_api_key):
        print(f"{prog}: error: --host {args.host} is reachable from other machines: give --api-key KEY "
              "(or --allow-no-api-key to serve it open)", file=sys.stderr)
        return 2
    limits = Limits(max_body_bytes=int(args.max_body_mb * 2**20), max_text_chars=args.max_text_chars,
                    max_items=args.max_batch_size, read_timeout_s=args.read_timeout_s)
    try:
        engine_args = EngineArgs.from_flags(args)
    except msgspec.ValidationError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2

    stop = asyncio.Event()

    async def run() -> None:
        from ..torch_engine import TorchEngine

        engine = TorchEngine(args.model, engine_args)
        async with engine:
            await serve(engine, args.host, args.port, args.api_key, model_name=args.served_model_name, stop=stop,
                        limits=limits)
        print("streamrl serve: stopped", flush=True)

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ...procs import run_stoppable

    try:
        # A signal while serving stops it gracefully; while the engine still loads, at once.
        run_stoppable(run(), on_stop=stop.set)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


if __name__ == "__main__":
    # Run the canonical module's main, not this `__main__` copy, so the app is built from one copy of
    # this module (the routes and the STATE key are shared with openai_api through `common`).
    from streamrl.engine.http.server import main as _main

    sys.exit(_main())
