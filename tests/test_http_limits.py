"""`streamrl serve` against hostile input: every parameter range-checked at the door, one request never
affecting another, bounded bodies, prompts and fan-out, JSON-only posts, no browser-driven control
calls, literal weight paths, slow clients timed out, safe bind defaults; and a storm of thousands of
malformed requests against the real console-script server while valid ones keep succeeding."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import torch
from aiohttp import web
from helpers import STREAMRL
from http_storm import PROMPT, ROUTES, Serve, rss_mb, storm

from streamrl.engine import TorchEngine
from streamrl.engine.http import SGLangClient, build_app
from streamrl.engine.http.common import Limits

aio = pytest.mark.asyncio(loop_scope="module")

LIMITS = Limits(max_body_bytes=1 << 20, max_text_chars=20_000, max_items=64, read_timeout_s=0.5)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def srv(engine_model_dir: Path):
    threads = torch.get_num_threads()
    engine = TorchEngine(str(engine_model_dir), device="cpu", max_running_requests=16, num_threads=1)
    async with engine:
        runner = web.AppRunner(build_app(engine, limits=LIMITS), handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        yield engine, url
        await runner.cleanup()
    torch.set_num_threads(threads)


async def post(url: str, path: str, body: object, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    hdrs = {"Content-Type": "application/json"} if headers is None else headers
    async with aiohttp.ClientSession() as s, s.post(url + path, data=data, headers=hdrs) as r:
        raw = await r.read()
        return r.status, (json.loads(raw) if raw.startswith(b"{") or raw.startswith(b"[") else {"raw": raw})


def gen(sp: dict, ids: list[int] = PROMPT) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, **sp}}


OUT_OF_RANGE = [
    ({"top_k": 18446744073709551615}, "top_k"),
    ({"top_k": -(2**70)}, "top_k"),
    ({"max_new_tokens": 2**63}, "max_new_tokens"),
    ({"min_new_tokens": 2**64}, "min_new_tokens"),
    ({"sampling_seed": 2**64}, "sampling_seed"),
    ({"sampling_seed": -(2**63) - 1}, "sampling_seed"),
    ({"temperature": 1e999}, "out of range"),  # msgspec refuses a JSON number that overflows a float
    ({"top_p": -1e999}, "out of range"),
    ({"stop": ["x"] * 65}, "stop"),
    ({"stop": "y" * 1025}, "stop"),
    ({"stop_token_ids": [1] * 65}, "stop_token_ids"),
    ({"max_new_tokens": 10**6}, "context"),
]


@pytest.mark.parametrize(("sp", "word"), OUT_OF_RANGE)
@aio
async def test_out_of_range_parameter_is_400_and_batch_mates_finish(srv, sp: dict, word: str) -> None:
    """The bad request among six concurrent valid ones: it alone gets a 400 naming the field; the
    others, prefilled in the same engine steps, finish normally."""
    engine, url = srv
    valid = [post(url, "/generate", gen({"temperature": 1.0, "sampling_seed": i, "ignore_eos": True}))
             for i in range(6)]
    bad = json.dumps(gen(sp)).replace("Infinity", "1e999")  # what JSON can say: an overflowing number
    results = await asyncio.gather(post(url, "/generate", bad), *valid)
    status, body = results[0]
    assert status == 400 and word in body["error"]["message"], body
    for st, r in results[1:]:
        assert st == 200 and r["meta_info"]["finish_reason"]["type"] == "length", r
    # The same through both OpenAI routes.
    oa = {"model": "m", "max_tokens": 4, **{("seed" if k == "sampling_seed" else k): v for k, v in sp.items()
                                              if k in ("top_k", "sampling_seed", "temperature", "top_p")}}
    if len(oa) > 2:
        st, body = await post(url, "/v1/completions", json.dumps({**oa, "prompt": PROMPT}).replace("Infinity", "1e999"))
        assert st == 400 and body["error"]["message"]
        chat = {**oa, "messages": [{"role": "user", "content": "1+2="}]}
        st, body = await post(url, "/v1/chat/completions", json.dumps(chat).replace("Infinity", "1e999"))
        assert st == 400 and body["error"]["message"]


@aio
async def test_large_in_range_values_work(srv) -> None:
    """In range is served: top_k beyond the vocabulary is the whole vocabulary, any 64-bit seed is a
    seed (and the same seed the same tokens)."""
    _, url = srv
    a = await post(url, "/generate", gen({"top_k": 2**40, "sampling_seed": 2**64 - 1, "temperature": 1.0}))
    b = await post(url, "/generate", gen({"top_k": -1, "sampling_seed": 2**64 - 1, "temperature": 1.0}))
    assert a[0] == b[0] == 200 and a[1]["output_ids"] == b[1]["output_ids"]


@aio
async def test_a_failing_step_aborts_only_its_culprit(srv, monkeypatch) -> None:
    """An engine step that raises (a fault no validation foresaw) is re-run request by request: only
    the request that fails alone is aborted, with the error; its batch-mates finish with tokens."""
    engine, url = srv
    real = engine._execute

    def execute(plan):  # noqa: ANN001, ANN202 - fails any step that holds the poisoned request
        if any(r.rid == "poison" for r in plan.requests):
            raise RuntimeError("boom")
        return real(plan)

    monkeypatch.setattr(engine, "_execute", execute)
    mates = [post(url, "/generate", {**gen({"ignore_eos": True}), "rid": f"mate{i}"}) for i in range(5)]
    bad, *ok = await asyncio.gather(post(url, "/generate", {**gen({}), "rid": "poison"}), *mates)
    assert bad[0] == 200 and bad[1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "boom" in bad[1]["meta_info"]["finish_reason"]["message"]
    for st, r in ok:
        assert st == 200 and r["meta_info"]["finish_reason"]["type"] == "length" and len(r["output_ids"]) == 6


@aio
async def test_bodies_prompts_and_fan_out_are_bounded(srv) -> None:
    _, url = srv
    st, body = await post(url, "/generate", {"input_ids": [1] * 400_000})  # > 1 MiB of JSON
    assert st == 413 and "limit" in json.dumps(body)
    st, body = await post(url, "/generate", {"text": "7" * 20_001})
    assert st == 413 and "20000" in body["error"]["message"]
    t0 = time.monotonic()
    st, body = await post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"n": 1_000_000_000}})
    assert st == 413 and time.monotonic() - t0 < 1.0, body  # refused before anything is expanded
    st, _ = await post(url, "/generate", {"input_ids": [PROMPT] * 65})
    assert st == 413
    st, _ = await post(url, "/generate", {"input_ids": [PROMPT] * 8, "sampling_params": {"n": 8, "max_new_tokens": 1}})
    assert st == 200  # 64 = the limit
    st, body = await post(url, "/v1/completions", {"model": "m", "prompt": "1+2=", "n": 65})
    assert st == 413
    st, body = await post(url, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user",
                                                                                     "content": "9" * 30_000}]})
    assert st == 413


@aio
async def test_long_prompt_is_tokenized_off_the_event_loop(engine_model_dir: Path) -> None:
    """A prompt at a generous limit takes the tokenizer a while; /health keeps answering meanwhile."""
    engine = TorchEngine(str(engine_model_dir), device="cpu", max_running_requests=4, num_threads=1)
    async with engine:
        app = build_app(engine, limits=Limits(max_text_chars=3_000_000, max_body_bytes=8 << 20))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            big = asyncio.ensure_future(post(url, "/generate", {"text": "12+3=" * 500_000}))
            worst = 0.0
            async with SGLangClient(url) as c:
                while not big.done():
                    t0 = time.monotonic()
                    assert await c.health()
                    worst = max(worst, time.monotonic() - t0)
                    await asyncio.sleep(0.02)
            st, body = await big
            assert st == 400 and "context" in body["error"]["message"]  # tokenized, then refused as too long
            assert worst < 0.5, worst
        finally:
            await runner.cleanup()


@pytest.mark.parametrize("path", ROUTES)
@aio
async def test_posts_must_be_json_and_not_from_a_web_page(srv, path: str) -> None:
    engine, url = srv
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        st, body = await post(url, path, '{"new_version": "hacked"}', {"Content-Type": ctype})
        assert st == 415 and "application/json" in body["error"]["message"], (path, ctype, st)
    st, body = await post(url, path, "{}", {"Content-Type": "application/json", "Origin": "http://evil.example"})
    assert st == 403 and "Origin" in body["error"]["message"]
    assert engine.weight_version != "hacked" and not engine.is_paused


@aio
async def test_json_without_content_type_and_empty_control_posts_work(srv) -> None:
    """What Python clients send: `requests.post(url, data=json.dumps(...))` has no Content-Type."""
    engine, url = srv
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(gen({})).encode()
    writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(data), data))
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200") and b"output_ids" in answer
    async with aiohttp.ClientSession() as s, s.post(url + "/flush_cache") as r:
        assert r.status == 200


@aio
async def test_memory_release_is_post_only(srv) -> None:
    engine, url = srv
    async with aiohttp.ClientSession() as s:
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            async with s.get(url + path) as r:
                assert r.status == 405
    assert engine.state.name == "SERVING"


@aio
async def test_weight_paths_are_literal(srv, tmp_path: Path, tiny_model_dir_b: Path) -> None:
    """`dir/*` or a glob matching model folders loads nothing: the path must be the folder itself."""
    engine, url = srv
    (tmp_path / "a").mkdir()
    import shutil

    shutil.copy(next(tiny_model_dir_b.glob("*.safetensors")), tmp_path / "a" / "model.safetensors")
    before = engine.weight_version
    for pattern in (f"{tmp_path}/*", f"{tmp_path}/a/*", f"{tmp_path}/[a]", f"{tmp_path}/?"):
        st, body = await post(url, "/update_weights_from_disk", {"model_path": pattern, "weight_version": "glob"})
        assert st == 400 and body["success"] is False, (pattern, body)
    assert engine.weight_version == before


@aio
async def test_a_body_that_never_arrives_is_timed_out(srv) -> None:
    """Headers that promise 100 bytes, then 10 and silence: a 408 after the read timeout, and the
    server serves others meanwhile."""
    _, url = srv
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"input_id")
    await writer.drain()
    t0 = time.monotonic()
    st, _ = await post(url, "/generate", gen({}))
    assert st == 200
    head = await asyncio.wait_for(reader.read(200), 10)
    assert b" 408 " in head.split(b"\r\n")[0] and time.monotonic() - t0 < 5
    writer.close()


def test_non_loopback_bind_needs_a_key(tmp_path: Path, engine_model_dir: Path) -> None:
    p = subprocess.run([*STREAMRL, "serve", "--model", str(engine_model_dir), "--host", "0.0.0.0", "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--api-key" in p.stderr and "0.0.0.0" in p.stderr
    assert len(p.stderr.strip().splitlines()) <= 3  # usage + one error line, no traceback
    for extra in (["--api-key", "k"], ["--allow-no-api-key"]):
        with Serve(engine_model_dir, tmp_path / "serve.log", "--host", "0.0.0.0", *extra) as (url, _proc):
            assert url.startswith("http://0.0.0.0:")


def test_storm_of_hostile_requests(tmp_path: Path, engine_model_dir: Path) -> None:
    """Thousands of malformed and hostile requests at every endpoint of the real server, valid ones
    mixed in (bench/http_storm.py, smaller): no 5xx, every valid request succeeds, /health answers
    within 1 s throughout, memory stays bounded, and the log holds no traceback."""
    log = tmp_path / "serve.log"
    with Serve(engine_model_dir, log, "--max-running-requests", "16") as (url, proc):
        rss0 = rss_mb(proc.pid)
        stats = asyncio.run(storm(url, proc.pid, n_hostile=2000, n_valid=100))
        assert proc.poll() is None, "the server died"
    assert stats["hostile"] == 2000 and stats["4xx"] > 1500, stats  # refused, not silently taken
    assert stats["5xx"] == 0, stats
    assert stats["valid_ok"] == stats["valid"] == 100, stats
    assert stats["health_worst_s"] < 1.0, stats
    assert stats["rss_max_mb"] - rss0 < 600, (rss0, stats)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
