"""`streamrl serve` against a real server on 127.0.0.1: SGLang's native API (shapes, streaming, abort,
pause, weight updates, errors, auth), the OpenAI routes through the official `openai` client, and the
console entry point as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio
import torch
from aiohttp import web

from streamrl.engine import TorchEngine
from streamrl.engine.http import SGLangClient, SGLangHTTPError, build_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "sekrit"
GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT = [1, 5, 6, 14, 7, 17]  # "<bos>12+3="


@dataclass
class Server:
    engine: TorchEngine
    url: str
    key_url: str  # the same engine behind an app that requires KEY
    client: SGLangClient
    model_dir: Path


async def _start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def srv(engine_model_dir: Path):
    threads = torch.get_num_threads()
    # One thread: a tiny model gains nothing from two, and loses a lot when the cores are shared.
    engine = TorchEngine(str(engine_model_dir), device="cpu", max_running_requests=8, num_threads=1)
    async with engine:
        r1, url = await _start(build_app(engine, model_name="tiny"))
        r2, key_url = await _start(build_app(engine, api_key=KEY, model_name="tiny"))
        async with SGLangClient(url) as client:
            yield Server(engine, url, key_url, client, engine_model_dir)
        await r1.cleanup()
        await r2.cleanup()
    torch.set_num_threads(threads)


async def raw(url: str, method: str, path: str, body: bytes | str | None = None, headers=None):
    if body is not None and headers is None:
        headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s, s.request(method, url + path, data=body, headers=headers) as r:
        return r.status, await r.read()


async def until(cond, timeout: float = 5.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.01)


def strip(r: dict) -> dict:
    """A result without its per-request fields (id, latency)."""
    meta = {k: v for k, v in r["meta_info"].items() if k not in ("id", "e2e_latency")}
    return {**r, "meta_info": meta}


# ---- /generate -----------------------------------------------------------------------------------
async def test_generate_matches_engine_result(srv: Server) -> None:
    params = {"max_new_tokens": 8, **GREEDY}
    direct = await srv.engine.generate(PROMPT, params)
    r = await srv.client.generate(PROMPT, params, rid="req-a")
    assert r["meta_info"]["id"] == "req-a"
    assert strip(r) == strip(direct)
    assert set(r["meta_info"]) == set(direct["meta_info"])
    # Without return_logprob, SGLang leaves the logprobs out.
    r2 = await srv.client.generate(PROMPT, params, return_logprob=False)
    assert "output_token_logprobs" not in r2["meta_info"] and r2["output_ids"] == direct["output_ids"]
    # Text input is tokenized with the model's tokenizer; text in logprobs on request.
    r3 = await srv.client.generate("<bos>12+3=", params, return_text_in_logprobs=True)
    assert r3["output_ids"] == direct["output_ids"] and r3["meta_info"]["prompt_tokens"] == len(PROMPT)
    assert [x[2] for x in r3["meta_info"]["output_token_logprobs"]] == [
        srv.engine.tokenizer.decode([t]) for t in r3["output_ids"]
    ]
    # Fields sglang-router adds when it forwards a request are accepted.
    routed = await srv.client.generate(PROMPT, params, model=None, return_bytes=False, log_metrics=True)
    assert routed["output_ids"] == direct["output_ids"]
    # PUT works too, like SGLang.
    status, _ = await raw(srv.url, "PUT", "/generate", '{"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2}}')
    assert status == 200


async def test_batches_and_n(srv: Server) -> None:
    p = {"max_new_tokens": 4, **GREEDY}
    batch = await srv.client.generate([[1, 5], [1, 6, 7], PROMPT], p)
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [2, 3, len(PROMPT)]
    assert batch[2]["output_ids"] == (await srv.engine.generate(PROMPT, p))["output_ids"]
    texts = await srv.client.generate(["12", "3+4="], p, rid="tb")
    assert [t["meta_info"]["id"] for t in texts] == ["tb_0", "tb_1"]
    many = await srv.client.generate(PROMPT, {"max_new_tokens": 4, "n": 3})
    assert len(many) == 3 and len({m["meta_info"]["id"] for m in many}) == 3
    named = await srv.client.generate(PROMPT, {"max_new_tokens": 2, "n": 2}, rid="nn")
    assert [m["meta_info"]["id"] for m in named] == ["nn_0", "nn_1"]


async def test_stream_is_cumulative_and_ends_with_done(srv: Server) -> None:
    params = {"max_new_tokens": 10, **GREEDY}
    body = f'{{"input_ids": {PROMPT}, "sampling_params": {{"max_new_tokens": 10, "temperature": 0, "ignore_eos": true}}, "stream": true, "return_logprob": true}}'
    status, data = await raw(srv.url, "POST", "/generate", body)
    assert status == 200
    events = [e for e in data.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
        assert len(b["meta_info"]["output_token_logprobs"]) == len(b["output_ids"])
        assert a["meta_info"]["finish_reason"] is None
    assert strip(chunks[-1]) == strip(await srv.engine.generate(PROMPT, params))
    # The client yields the same chunks.
    got = [c async for c in srv.client.generate_stream(PROMPT, params)]
    assert strip(got[-1]) == strip(chunks[-1]) and got[-1]["meta_info"]["finish_reason"]["type"] == "length"


async def test_batched_stream_carries_index(srv: Server) -> None:
    got = [c async for c in srv.client.generate_stream([[1, 5], [1, 6]], {"max_new_tokens": 3, **GREEDY})]
    finals = {c["index"]: c for c in got if c["meta_info"]["finish_reason"]}
    assert set(finals) == {0, 1} and all(len(c["output_ids"]) == 3 for c in finals.values())


async def test_abort_mid_stream_returns_partial(srv: Server) -> None:
    params = {"max_new_tokens": 50, **GREEDY}
    stream = srv.client.generate_stream(PROMPT, params, rid="to-abort")
    first = await anext(stream)
    await srv.client.pause("in_place")  # freeze, so the abort lands mid-generation deterministically
    await srv.client.abort("to-abort")
    await srv.client.resume()
    rest = [c async for c in stream]
    last = rest[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(first["output_ids"]) <= len(last["output_ids"]) < 50
    assert len(last["meta_info"]["output_token_logprobs"]) == len(last["output_ids"])
    assert await srv.client.generate(PROMPT, {"max_new_tokens": 2})  # still serving


async def test_abort_all_and_unknown_rid(srv: Server) -> None:
    await srv.client.abort("no-such-rid")  # no-op, 200
    await srv.client.pause("in_place")
    tasks = [asyncio.create_task(srv.client.generate(PROMPT, {"max_new_tokens": 30, **GREEDY})) for _ in range(3)]
    await until(lambda: srv.engine.stats()["waiting"] + srv.engine.stats()["running"] == 3)
    await srv.client.abort_all()
    results = await asyncio.gather(*tasks)
    await srv.client.resume()
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)


async def test_pause_in_place_then_continue_loses_nothing(srv: Server) -> None:
    params = {"max_new_tokens": 20, **GREEDY}
    expected = await srv.engine.generate(PROMPT, params)
    stream = srv.client.generate_stream(PROMPT, params)
    await anext(stream)
    assert await srv.client.pause("in_place") == {"message": "Generation paused successfully.", "status": "ok"}
    n = srv.engine.stats()["generated_tokens"]
    await asyncio.sleep(0.1)
    assert srv.engine.stats()["generated_tokens"] == n  # frozen
    assert not await srv.client.flush_cache()  # SGLang refuses while requests are in flight
    assert (await srv.client.resume())["status"] == "ok"
    last = [c async for c in stream][-1]
    assert strip(last) == strip(expected)


async def test_pause_abort_blocks_new_requests_until_continue(srv: Server) -> None:
    stream = srv.client.generate_stream(PROMPT, {"max_new_tokens": 50, **GREEDY})
    await anext(stream)
    await srv.client.pause("abort")
    last = [c async for c in stream][-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    waiting = asyncio.create_task(srv.client.generate(PROMPT, {"max_new_tokens": 2}))
    await asyncio.sleep(0.15)
    assert not waiting.done()
    await srv.client.resume()
    assert (await waiting)["meta_info"]["finish_reason"]["type"] in ("length", "stop")


async def test_client_disconnect_aborts(srv: Server) -> None:
    def busy() -> int:
        s = srv.engine.stats()
        return s["running"] + s["waiting"]

    await until(lambda: busy() == 0)
    async with aiohttp.ClientSession() as s:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 50, **GREEDY}, "stream": True}
        async with s.post(srv.url + "/generate", json=body) as r:
            await r.content.readuntil(b"\n\n")
            await srv.client.pause("in_place")
        await until(lambda: busy() == 0)  # stream dropped while frozen: aborted
        task = asyncio.create_task(s.post(srv.url + "/generate", json={**body, "stream": False}))
        await until(lambda: busy() == 1)
        task.cancel()
        await until(lambda: busy() == 0)  # plain request dropped: aborted too
    await srv.client.resume()


# ---- control -------------------------------------------------------------------------------------
async def test_info_health_and_loads(srv: Server) -> None:
    for path in ("/model_info", "/get_model_info"):
        status, _ = await raw(srv.url, "GET", path)
        assert status == 200
    info = await srv.client.model_info()
    assert info == {"model_path": str(srv.model_dir), "tokenizer_path": str(srv.model_dir), "is_generation": True,
                    "preferred_sampling_params": None, "weight_version": srv.engine.weight_version}
    si = await srv.client.server_info()
    assert si["version"] and si["internal_states"][0]["weight_version"] == srv.engine.weight_version
    assert si["context_length"] == srv.engine.context_len and si["served_model_name"] == "tiny"
    assert (await raw(srv.url, "GET", "/get_server_info"))[0] == 200
    assert await srv.client.health()
    assert (await raw(srv.url, "GET", "/health_generate")) == (200, b"")
    loads = await srv.client.loads()
    assert loads["loads"][0]["num_running_reqs"] == 0 and loads["dp_rank_count"] == 1
    assert await srv.client.flush_cache() and (await raw(srv.url, "GET", "/flush_cache"))[0] == 200


async def test_release_and_resume_memory(srv: Server) -> None:
    status, body = await raw(srv.url, "POST", "/release_memory_occupation", "{}")
    assert (status, body) == (200, b"null")
    await srv.client.resume_memory()
    assert (await srv.client.generate(PROMPT, {"max_new_tokens": 2}))["output_ids"]


async def test_weight_updates(srv: Server, tiny_model_dir_b: Path) -> None:
    params = {"max_new_tokens": 8, **GREEDY}
    before = await srv.client.generate(PROMPT, params)
    r = await srv.client.update_weights_from_disk(str(tiny_model_dir_b), "7")
    assert r == {"success": True, "message": "Succeeded to update model weights. Weight version updated to 7.",
                 "num_paused_requests": 0}
    assert (await srv.client.model_info())["weight_version"] == "7"
    after = await srv.client.generate(PROMPT, params)
    assert after["meta_info"]["weight_version"] == "7" and after["output_ids"] != before["output_ids"]
    # No version given: SGLang keeps the current one.
    assert (await srv.client.update_weights_from_disk(str(srv.model_dir)))["success"]
    assert (await srv.client.model_info())["weight_version"] == "7"
    assert (await srv.client.generate(PROMPT, params))["output_ids"] == before["output_ids"]
    with pytest.raises(SGLangHTTPError) as e:
        await srv.client.update_weights_from_disk("/nonexistent/dir", "8")
    assert e.value.status == 400 and e.value.body["success"] is False
    r = await srv.client.update_weight_version("default")
    assert r == {"success": True, "message": "Weight version updated to default", "new_version": "default"}
    assert srv.engine.weight_version == "default"


async def test_update_weights_from_distributed_over_gloo(srv: Server, tiny_model_dir_b: Path) -> None:
    from safetensors.torch import load_file

    params = {"max_new_tokens": 8, **GREEDY}
    before = await srv.client.generate(PROMPT, params)
    await srv.client.update_weights_from_disk(str(tiny_model_dir_b), "disk-b")
    want = await srv.client.generate(PROMPT, params)
    await srv.client.update_weights_from_disk(str(srv.model_dir), "default")
    with pytest.raises(SGLangHTTPError) as e:  # SGLang's default backend: not available here
        await srv.client.init_weights_update_group("127.0.0.1", 1, 1, 2, backend="nccl")
    assert e.value.body["success"] is False
    from streamrl.weights import BroadcastSync

    sync = BroadcastSync([srv.client])  # the trainer: rank 0, the server rank 1
    await sync.connect()
    await sync.load(load_file(tiny_model_dir_b / "model.safetensors"), 41)
    got = await srv.client.generate(PROMPT, params)
    assert got["meta_info"]["weight_version"] == "41" and got["output_ids"] == want["output_ids"]
    assert got["output_ids"] != before["output_ids"]
    assert (await srv.client.destroy_weights_update_group())["success"]
    await sync.aclose()
    await srv.client.update_weights_from_disk(str(srv.model_dir), "default")


# ---- errors and auth -----------------------------------------------------------------------------
BAD = [
    ("POST", "/generate", "{"),
    ("POST", "/generate", "[1, 2]"),
    ("POST", "/generate", '{"input_ids": [1, 5], "bogus": 1}'),
    ("POST", "/generate", '{"sampling_params": {}}'),
    ("POST", "/generate", '{"input_ids": [1], "text": "1"}'),
    ("POST", "/generate", '{"input_ids": "abc"}'),
    ("POST", "/generate", '{"input_ids": []}'),
    ("POST", "/generate", '{"input_ids": [1, 99999]}'),
    ("POST", "/generate", '{"input_ids": [1, 5], "sampling_params": {"temperature": "hot"}}'),
    ("POST", "/generate", '{"input_ids": [1, 5], "sampling_params": {"top_q": 1}}'),
    ("POST", "/generate", '{"input_ids": [1, 5], "sampling_params": {"top_p": 0}}'),
    ("POST", "/generate", '{"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 1000}}'),
    ("POST", "/generate", '{"input_ids": [1, 5], "stream": "yes"}'),
    ("POST", "/generate", '{"input_ids": [1, 5], "stream": true, "sampling_params": {"top_p": 5}}'),
    ("POST", "/generate", '{"input_ids": [[1, 5], [1, 99999]]}'),
    ("POST", "/abort_request", '{"rid": 5}'),
    ("POST", "/pause_generation", '{"mode": "nope"}'),
    ("POST", "/update_weights_from_disk", "{}"),
    ("POST", "/update_weight_version", '{"new_version": 3}'),
    ("POST", "/v1/completions", '{"prompt": 5}'),
    ("POST", "/v1/completions", '{"prompt": "1+1=", "max_tokens": 1000}'),
    ("POST", "/v1/chat/completions", '{"messages": "hi"}'),
    ("POST", "/v1/chat/completions", '{"messages": [{"role": "user", "content": 7}]}'),
]


async def test_malformed_requests_get_400_and_server_keeps_serving(srv: Server) -> None:
    for method, path, body in BAD:
        status, data = await raw(srv.url, method, path, body, {"Content-Type": "application/json"})
        assert status == 400, (path, body, status, data)
        err = json.loads(data)["error"]
        assert isinstance(err["message"], str) and err["message"], (path, body)
    status, data = await raw(srv.url, "POST", "/generate", '{"input_ids": [1, 5], "bogus": 1}')
    assert b"unknown field `bogus`" in data
    assert srv.engine.stats()["running"] == 0 and srv.engine.stats()["waiting"] == 0
    assert await srv.client.health()
    assert (await srv.client.generate(PROMPT, {"max_new_tokens": 3}))["meta_info"]["completion_tokens"] >= 1
    assert (await raw(srv.url, "GET", "/nope"))[0] == 404


async def test_api_key(srv: Server) -> None:
    body = '{"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 1}}'
    assert (await raw(srv.key_url, "POST", "/generate", body))[0] == 401
    status, data = await raw(srv.key_url, "POST", "/generate", body, {"Authorization": "Bearer wrong"})
    assert status == 401 and b"Unauthorized" in data
    assert (await raw(srv.key_url, "GET", "/model_info"))[0] == 401
    assert (await raw(srv.key_url, "GET", "/health"))[0] == 200
    async with SGLangClient(srv.key_url, api_key=KEY) as c:
        assert (await c.generate([1, 5], {"max_new_tokens": 1}))["meta_info"]["completion_tokens"] == 1
        assert (await c.model_info())["is_generation"]
    async with SGLangClient(srv.key_url, api_key="wrong") as c:
        with pytest.raises(SGLangHTTPError) as e:
            await c.model_info()
        assert e.value.status == 401


# ---- OpenAI --------------------------------------------------------------------------------------
async def test_openai_client(srv: Server) -> None:
    oa = openai.AsyncOpenAI(base_url=srv.key_url + "/v1", api_key=KEY, max_retries=0)
    try:
        models = await oa.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        c = await oa.completions.create(model="tiny", prompt="12+3=", max_tokens=5, temperature=0, logprobs=1,
                                        extra_body={"ignore_eos": True})
        direct = await srv.engine.generate(srv.engine.tokenizer("12+3=")["input_ids"], {"max_new_tokens": 5, **GREEDY})
        assert c.choices[0].text == direct["text"] and c.choices[0].finish_reason == "length"
        assert c.usage.completion_tokens == 5 and len(c.choices[0].logprobs.token_logprobs) == 5
        c2 = await oa.completions.create(model="tiny", prompt=[[1, 5, 6], [1, 7]], max_tokens=3, n=2)
        assert [ch.index for ch in c2.choices] == [0, 1, 2, 3] and c2.usage.prompt_tokens == 5
        text = ""
        async for ev in await oa.completions.create(model="tiny", prompt="12+3=", max_tokens=5, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True}):
            text += ev.choices[0].text
        assert text == direct["text"]
        chat = await oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+1="}],
                                                max_tokens=4, logprobs=True)
        assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
        assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
        parts = []
        async for ev in await oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+1="}],
                                                         max_tokens=4, temperature=0, stream=True,
                                                         stream_options={"include_usage": True}):
            parts.append(ev)
        assert parts[0].choices[0].delta.role == "assistant" and parts[-1].usage is not None
        with pytest.raises(openai.BadRequestError):
            await oa.completions.create(model="tiny", prompt="1", max_tokens=1000)
    finally:
        await oa.close()


async def test_through_sglang_router(srv: Server) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", srv.url, "--host", "127.0.0.1",
           "--port", str(port), "--policy", "round_robin"]
    devnull = asyncio.subprocess.DEVNULL
    # Own process group: the router runs as a grandchild ("sglang::router") of this process.
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=devnull, stderr=devnull, start_new_session=True)
    try:
        params = {"max_new_tokens": 6, **GREEDY}
        async with SGLangClient(f"http://127.0.0.1:{port}") as c:
            t0 = time.monotonic()
            while True:  # until the router is up and has registered the worker
                try:
                    r = await c.generate(PROMPT, params, rid="via-router")
                    break
                except (SGLangHTTPError, aiohttp.ClientError):
                    assert time.monotonic() - t0 < 20, "router did not come up"
                    await asyncio.sleep(0.2)
            assert strip(r) == strip(await srv.engine.generate(PROMPT, params))
            last = [ch async for ch in c.generate_stream(PROMPT, params)][-1]
            assert last["output_ids"] == r["output_ids"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        await proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


# ---- the console entry point ---------------------------------------------------------------------
async def test_subprocess_server(engine_model_dir: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "streamrl.engine.http.server", "--model", str(engine_model_dir), "--port", "0",
           "--device", "cpu", "--max-running-requests", "4"]
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=pipe, stderr=pipe, env=env)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        if not line.startswith("streamrl serve: listening on http://127.0.0.1:"):
            pytest.fail(f"no listening line: {line!r}\n{(await proc.stderr.read()).decode()}")
        url = line.split(" on ")[1].strip()
        async with SGLangClient(url) as c:
            assert await c.health()
            r = await c.generate(PROMPT, {"max_new_tokens": 3, **GREEDY})
            assert (await c.request("GET", "/v1/models"))["data"][0]["id"] == str(engine_model_dir)
        assert r["meta_info"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        assert "stopped" in (await proc.stdout.read()).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
