"""SGLangEngine / SGLangServer: the Engine contract of tests/test_engine.py against real SGLang, plus the
parts that need no SGLang (import without sglang, stream chunk conversion, request checks, launcher).

The real-SGLang tests need `sglang` (a CUDA build) and a GPU; elsewhere they skip with that reason. Every
one of them depends on the `sgl` fixture, which does the `pytest.importorskip("sglang", ...)` and the
CUDA check (a module-level importorskip would also skip the tests below that run anywhere). The tests
against `FakeSGLang` check this adapter's plumbing against fakes shaped after SGLang's source; they say
nothing about real SGLang behaviour.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from test_engine import running

from streamrl.engine import Engine, EngineError, SamplingParams
from streamrl.engine.sglang_engine import (
    SGLangEngine,
    bump_version,
    cumulative_to_delta,
    sglang_sampling_params,
    validate_request,
)
from streamrl.engine.sglang_launcher import SGLangLaunchError, SGLangServer, build_command

SKIP_REASON = "real SGLang needs a GPU build; not installable on the CPU CI machines"
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 14, 15], [1, 20, 4, 4, 4, 8]]


def sgl_chunk(ids: list[int], lps: list[float] | None = None, *, finish: dict | None = None,
              version: str = "default", rid: str = "r", text: str | None = None) -> dict[str, Any]:
    """A chunk shaped like SGLang's cumulative stream output (tokenizer_manager._handle_batch_output)."""
    lps = [-0.1 * (i + 1) for i in range(len(ids))] if lps is None else lps
    return {
        "text": text,
        "output_ids": list(ids),
        "meta_info": {
            "id": rid, "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": len(ids),
            "cached_tokens": 0, "weight_version": version,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
        },
    }


# ==== no SGLang needed ====================================================================================
def test_constructing_without_sglang_raises_engine_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` now fails, installed or not
    with pytest.raises(EngineError, match="sglang"):
        SGLangEngine("some/model")


def test_cumulative_chunks_become_deltas() -> None:
    stream = [
        sgl_chunk([7], [-0.5]),
        sgl_chunk([7, 8, 9], [-0.5, -0.25, -1.0]),
        sgl_chunk([7, 8, 9], [-0.5, -0.25, -1.0]),  # SGLang can repeat a chunk with nothing new
        sgl_chunk([7, 8, 9, 2], [-0.5, -0.25, -1.0, -0.01], finish={"type": "stop", "matched": 2},
                  version="3", text="789"),
    ]
    seen, chunks = 0, []
    for out in stream:
        c = cumulative_to_delta(seen, out)
        seen += len(c.token_ids)
        chunks.append(c)
    assert [c.token_ids for c in chunks] == [[7], [8, 9], [], [2]]
    assert [c.logprobs for c in chunks] == [[-0.5], [-0.25, -1.0], [], [-0.01]]
    assert [c.finished for c in chunks] == [False, False, False, True]
    assert all(c.rid == "r" for c in chunks) and chunks[-1].weight_version == "3"
    assert chunks[-1].result is stream[-1] and chunks[0].result is None  # the final dict, unchanged
    assert cumulative_to_delta(0, sgl_chunk([4]), rid="mine").rid == "mine"


def test_cumulative_to_delta_rejects_malformed_chunks() -> None:
    with pytest.raises(EngineError, match="not cumulative"):
        cumulative_to_delta(3, sgl_chunk([1, 2]))
    no_lp = sgl_chunk([1, 2])
    del no_lp["meta_info"]["output_token_logprobs"]
    with pytest.raises(EngineError, match="output_token_logprobs"):
        cumulative_to_delta(0, no_lp)
    short = sgl_chunk([1, 2])
    short["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(EngineError, match="1 output_token_logprobs for 2"):
        cumulative_to_delta(0, short)
    swapped = sgl_chunk([1, 2])
    swapped["meta_info"]["output_token_logprobs"][1][1] = 5
    with pytest.raises(EngineError, match="differ"):
        cumulative_to_delta(0, swapped)


def test_sampling_params_sent_to_sglang_are_the_non_defaults() -> None:
    sp = SamplingParams.from_dict({"max_new_tokens": 8, "temperature": 0.7, "stop_token_ids": [2], "top_k": -1})
    assert sglang_sampling_params(sp) == {"max_new_tokens": 8, "temperature": 0.7, "stop_token_ids": [2]}
    assert sglang_sampling_params(SamplingParams()) == {}
    assert bump_version("default") == "1" and bump_version("7") == "8"


BAD_REQUESTS = [
    ([], {}, "non-empty"),
    ([1, 999], {}, "outside the vocabulary"),
    ([1, -1], {}, "outside the vocabulary"),
    ([1, True], {}, "outside the vocabulary"),
    ([1] * 60, {"max_new_tokens": 10}, "exceeds the context"),
    ([1] * 64, {"max_new_tokens": 1}, "context is 64"),
    ([1, 5], {"temperature": -1}, "temperature"),
    ([1, 5], {"top_p": 0}, "top_p"),
    ([1, 5], {"top_k": 0}, "top_k"),
    ([1, 5], {"min_p": 2}, "min_p"),
    ([1, 5], {"max_new_tokens": -1}, "max_new_tokens"),
    ([1, 5], {"stop_token_ids": [500]}, "stop_token_ids"),
    ([1, 5], {"frequency_penalty": 3}, "frequency_penalty"),
    ([1, 5], {"repetition_penalty": 0}, "repetition_penalty"),
    ([1, 5], {"n": 2}, "n > 1"),
]


@pytest.mark.parametrize(("ids", "params", "msg"), BAD_REQUESTS)
def test_request_checks_match_torch_engine_messages(ids: list, params: dict, msg: str) -> None:
    with pytest.raises(EngineError, match=msg):
        validate_request(ids, SamplingParams.from_dict(params), vocab_size=23, context_len=64)


def test_penalties_within_sglang_ranges_are_accepted() -> None:
    sp = SamplingParams.from_dict(
        {"max_new_tokens": 8, "frequency_penalty": 0.5, "presence_penalty": -1, "repetition_penalty": 1.2}
    )
    validate_request([1, 5], sp, vocab_size=23, context_len=64)


# ---- the adapter against a fake shaped after SGLang's source ------------------------------------------
class _Req:
    """Stands in for an io_struct dataclass: keeps its keyword arguments."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _fake_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    io = types.ModuleType("sglang.srt.managers.io_struct")
    for name in ("PauseGenerationReqInput", "ContinueGenerationReqInput", "UpdateWeightFromDiskReqInput",
                 "UpdateWeightsFromTensorReqInput", "ReleaseMemoryOccupationReqInput",
                 "ResumeMemoryOccupationReqInput"):
        setattr(io, name, type(name, (_Req,), {}))
    utils = types.ModuleType("sglang.srt.utils")
    utils.MultiprocessingSerializer = types.SimpleNamespace(serialize=lambda named: ("blob", tuple(n for n, _ in named)))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io)
    monkeypatch.setitem(sys.modules, "sglang.srt.utils", utils)


class FakeTokenizerManager:
    def __init__(self) -> None:
        self.server_args = types.SimpleNamespace(weight_version="default", tp_size=2)
        self.model_config = types.SimpleNamespace(vocab_size=23)
        self.context_len = 64
        self.tokenizer = None
        self.calls: list[tuple] = []
        self.update_ok = True

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.calls.append(("abort_request", rid, abort_all))

    async def pause_generation(self, obj: Any) -> None:
        self.calls.append(("pause_generation", type(obj).__name__, obj.mode))

    async def continue_generation(self, obj: Any) -> None:
        self.calls.append(("continue_generation", type(obj).__name__))

    async def update_weights_from_disk(self, obj: Any, request: Any) -> tuple[bool, str, int]:
        self.calls.append(("update_weights_from_disk", type(obj).__name__, obj.model_path, obj.weight_version))
        if self.update_ok:
            self.server_args.weight_version = obj.weight_version
        return self.update_ok, "ok" if self.update_ok else "no such folder", 0

    async def update_weights_from_tensor(self, obj: Any, request: Any) -> tuple[bool, str]:
        self.calls.append(("update_weights_from_tensor", type(obj).__name__, obj.serialized_named_tensors,
                           obj.weight_version))
        self.server_args.weight_version = obj.weight_version
        return True, "ok"


class FakeSGLang:
    """async_generate as sglang.Engine's: a dict, or an async iterator of cumulative chunks."""

    def __init__(self) -> None:
        self.tokenizer_manager = FakeTokenizerManager()
        self.requests: list[dict] = []
        self.shut_down = False

    async def async_generate(self, *, input_ids: list[int], sampling_params: dict, return_logprob: bool,
                             stream: bool, rid: str) -> Any:
        self.requests.append(dict(input_ids=input_ids, sampling_params=sampling_params,
                                  return_logprob=return_logprob, stream=stream, rid=rid))
        if sampling_params.get("max_new_tokens") == 13:
            raise ValueError("The input is longer than SGLang likes")
        n = sampling_params.get("max_new_tokens", 128)
        toks = [(input_ids[-1] + i) % 23 for i in range(1, n + 1)]
        version = self.tokenizer_manager.server_args.weight_version
        chunks = [sgl_chunk(toks[:k], rid=rid, version=version) for k in range(1, n + 1)]
        chunks[-1]["meta_info"]["finish_reason"] = {"type": "length", "length": n}
        if not stream:
            return chunks[-1]

        async def gen():
            for c in chunks:
                await asyncio.sleep(0)
                yield c

        return gen()

    def shutdown(self) -> None:
        self.shut_down = True


async def test_adapter_plumbing_against_fake_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_modules(monkeypatch)
    fake = FakeSGLang()
    tm = fake.tokenizer_manager
    async with SGLangEngine(engine=fake) as eng:
        assert isinstance(eng, Engine) and eng.vocab_size == 23 and eng.context_len == 64
        r = await eng.generate([1, 5], {"max_new_tokens": 3, "temperature": 0}, rid="a")
        assert r["output_ids"] == [6, 7, 8] and r["meta_info"]["finish_reason"]["type"] == "length"
        assert fake.requests[-1] == dict(input_ids=[1, 5], sampling_params={"max_new_tokens": 3, "temperature": 0},
                                         return_logprob=True, stream=False, rid="a")
        chunks = [c async for c in eng.generate_stream([1, 5], {"max_new_tokens": 4}, rid="s")]
        assert [c.token_ids for c in chunks] == [[6], [7], [8], [9]] and chunks[-1].finished
        assert chunks[-1].result["output_ids"] == [6, 7, 8, 9] and fake.requests[-1]["stream"]
        # Closing a stream early aborts its request, as SGLang does on client disconnect.
        stream = eng.generate_stream([1, 5], {"max_new_tokens": 20}, rid="early")
        await stream.__anext__()
        assert eng.stats()["running"] == 1 and await eng.abort("early")
        await stream.aclose()
        assert tm.calls.count(("abort_request", "early", False)) == 2 and eng.stats()["running"] == 0
        assert not await eng.abort("unknown")
        # Requests are checked before they reach SGLang; SGLang's own ValueErrors become EngineError.
        n = len(fake.requests)
        with pytest.raises(EngineError, match="outside the vocabulary"):
            await eng.generate([1, 99])
        with pytest.raises(EngineError, match="sampling_params"):
            await eng.generate([1, 5], {"bogus": 1})
        assert len(fake.requests) == n
        with pytest.raises(EngineError, match="longer than SGLang likes"):
            await eng.generate([1, 5], {"max_new_tokens": 13})
        with pytest.raises(EngineError, match="longer than SGLang likes"):
            _ = [c async for c in eng.generate_stream([1, 5], {"max_new_tokens": 13})]
        # Control calls: SGLang's request structs, versions kept as strings.
        await eng.pause("in_place")
        assert eng.is_paused and eng.stats()["paused"]
        await eng.resume()
        await eng.update_weights_from_disk("/ckpt/a")
        assert eng.weight_version == "1"
        await eng.update_weights_from_state_dict({"w": torch.zeros(2)}, weight_version="9")
        assert eng.weight_version == "9"
        assert (await eng.generate([1, 5], {"max_new_tokens": 1}))["meta_info"]["weight_version"] == "9"
        tm.update_ok = False
        with pytest.raises(EngineError, match="no such folder"):
            await eng.update_weights_from_disk("/nope", weight_version="10")
        assert eng.weight_version == "9"
        with pytest.raises(EngineError, match="pause mode"):
            await eng.pause("sideways")  # type: ignore[arg-type]
    assert fake.shut_down
    assert ("pause_generation", "PauseGenerationReqInput", "in_place") in tm.calls
    assert ("continue_generation", "ContinueGenerationReqInput") in tm.calls
    assert ("update_weights_from_disk", "UpdateWeightFromDiskReqInput", "/ckpt/a", "1") in tm.calls
    assert ("update_weights_from_tensor", "UpdateWeightsFromTensorReqInput",
            [("blob", ("w",)), ("blob", ("w",))], "9") in tm.calls  # one payload per TP rank


def test_adapter_refuses_incremental_stream_chunks() -> None:
    fake = FakeSGLang()
    fake.tokenizer_manager.server_args.incremental_streaming_output = True
    with pytest.raises(EngineError, match="cumulative"):
        SGLangEngine(engine=fake)


# ---- launcher -------------------------------------------------------------------------------------------
def test_launcher_command_line() -> None:
    cmd = build_command("/m/qwen", 30123, ["--tp-size", "2", "--mem-fraction-static=0.5"], python="/py")
    assert cmd == ["/py", "-m", "sglang.launch_server", "--model-path", "/m/qwen", "--host", "127.0.0.1",
                   "--port", "30123", "--tp-size", "2", "--mem-fraction-static=0.5"]
    with pytest.raises(ValueError, match="--port"):
        build_command("/m", 1, ["--port", "2"])
    with pytest.raises(ValueError, match="--host"):
        build_command("/m", 1, ["--host=0.0.0.0"])
    s = SGLangServer("/m/qwen", 30124, ["--dtype", "bfloat16"])
    assert s.url == "http://127.0.0.1:30124" and s.cmd[0] == sys.executable and s.cmd[-2:] == ["--dtype", "bfloat16"]
    free = SGLangServer("/m/qwen")
    assert free.port > 0 and free.url.endswith(f":{free.port}")


def _script(path: Path, body: str) -> str:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return str(path)


@pytest.mark.skipif(HAVE_SGLANG, reason="checks the message for a missing sglang")
async def test_launcher_without_sglang_says_so() -> None:
    with pytest.raises(SGLangLaunchError, match="sglang is not installed"):
        await SGLangServer("/m", 30125).start(timeout=5)


async def test_launcher_reports_an_early_exit_with_the_log(tmp_path: Path) -> None:
    py = _script(tmp_path / "py", "import sys\nprint('no module named sglang (stand-in)', file=sys.stderr)\nsys.exit(3)\n")
    server = SGLangServer("/m", None, python=py, log_path=tmp_path / "log")
    with pytest.raises(SGLangLaunchError, match=r"(?s)status 3 .*no module named sglang \(stand-in\)"):
        await server.start(timeout=30, poll_s=0.05)


FAKE_SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
hits = {"n": 0}
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        hits["n"] += 1
        ok = self.path == "/health_generate" and hits["n"] > 2  # 503 while "loading"
        self.send_response(200 if ok else 503)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


async def test_launcher_waits_for_health_generate_and_stops(tmp_path: Path) -> None:
    py = _script(tmp_path / "py", FAKE_SERVER)
    server = SGLangServer("/m", None, python=py, log_path=tmp_path / "log")
    url = await server.start(timeout=30, poll_s=0.05)
    assert url == server.url and server.proc is not None and server.proc.returncode is None
    await server.stop()
    assert server.proc.returncode == -signal.SIGTERM


async def test_launcher_timeout_kills_a_server_that_ignores_sigterm(tmp_path: Path) -> None:
    py = _script(tmp_path / "py", "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n")
    server = SGLangServer("/m", None, python=py, log_path=tmp_path / "log", stop_grace=0.3)
    with pytest.raises(SGLangLaunchError, match="not healthy"):
        await server.start(timeout=1.0, poll_s=0.1)
    assert server.proc is not None and server.proc.returncode == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.killpg(server.proc.pid, 0)  # nothing left in its process group


# ==== real SGLang (GPU) ===================================================================================
SGL = pytest.mark.asyncio(loop_scope="module")  # one SGLang engine, one event loop for the module
# Float32, no CUDA graphs, torch-native attention and sampling: the settings closest to the transformers
# reference. Radix cache off so that cached_tokens stays 0 and repeated prompts recompute everything.
ENGINE_ARGS = dict(dtype="float32", mem_fraction_static=0.3, disable_cuda_graph=True,
                   attention_backend="torch_native", sampling_backend="pytorch", disable_radix_cache=True,
                   random_seed=0)
LOGPROB_TOL = 1e-3  # TorchEngine meets 1e-4 in fp32; SGLang's GPU kernels are not yet measured here


@pytest.fixture(scope="session")
def sglang_gpu() -> None:
    pytest.importorskip("sglang", reason=SKIP_REASON)
    if not torch.cuda.is_available():
        pytest.skip("SGLang contract tests need a CUDA GPU")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sgl(sglang_gpu: None, engine_model_dir: Path):
    eng = SGLangEngine(str(engine_model_dir), **ENGINE_ARGS)
    yield eng
    await eng.aclose()


def hf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the reference does not stop at EOS either
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


async def restore(eng: SGLangEngine, path: Path) -> None:
    await eng.update_weights_from_disk(str(path), weight_version="default")


@SGL
async def test_sglang_result_shape(sglang_gpu: None, sgl: SGLangEngine) -> None:
    r = await sgl.generate([1, 5, 6], {"max_new_tokens": 5, **GREEDY}, rid="abc")
    assert {"text", "output_ids", "meta_info"} <= set(r)
    meta = r["meta_info"]
    assert meta["id"] == "abc"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 5 and meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default" == sgl.weight_version
    assert [t for _, t, _ in meta["output_token_logprobs"]] == r["output_ids"]
    assert isinstance(r["text"], str) and len(r["text"]) > 0


@SGL
async def test_sglang_greedy_equals_generate_alone_and_in_staggered_batch(
    sglang_gpu: None, sgl: SGLangEngine, engine_model_dir: Path
) -> None:
    model = hf(engine_model_dir)
    refs = [hf_greedy(model, p, 12 + 3 * i) for i, p in enumerate(PROMPTS)]
    alone = await sgl.generate(PROMPTS[2], {"max_new_tokens": 18, **GREEDY})
    assert alone["output_ids"] == refs[2]

    async def late(i: int, p: list[int]):
        await asyncio.sleep(0.005 * i)
        return await sgl.generate(p, {"max_new_tokens": 12 + 3 * i, **GREEDY})

    results = await asyncio.gather(*[late(i, p) for i, p in enumerate(PROMPTS)])
    for r, ref in zip(results, refs, strict=True):
        assert r["output_ids"] == ref
    assert len({tuple(r) for r in refs}) > 1


@SGL
@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_sglang_logprobs_equal_full_forward(
    sglang_gpu: None, sgl: SGLangEngine, tiny_model_dir: Path, engine_model_dir: Path, temperature: float
) -> None:
    # The default-init model (as in test_engine.py), loaded into the running engine; restored after.
    model = hf(tiny_model_dir)
    await sgl.update_weights_from_disk(str(tiny_model_dir), weight_version="tiny")
    try:
        results = await asyncio.gather(*[
            sgl.generate(p, {"max_new_tokens": 15, "temperature": temperature}) for p in PROMPTS
        ])
    finally:
        await restore(sgl, engine_model_dir)
    for p, r in zip(PROMPTS, results, strict=True):
        assert r["meta_info"]["weight_version"] == "tiny"
        got = [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]
        ref = hf_logprobs(model, p, r["output_ids"], temperature)
        err = max(abs(a - b) for a, b in zip(got, ref, strict=True))
        assert err <= LOGPROB_TOL, err


@SGL
async def test_sglang_stop_tokens(sglang_gpu: None, sgl: SGLangEngine) -> None:
    free = await sgl.generate(PROMPTS[2], {"max_new_tokens": 20, **GREEDY})
    stop_tok = free["output_ids"][4]
    first = free["output_ids"].index(stop_tok)
    r = await sgl.generate(PROMPTS[2], {"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [stop_tok]})
    assert r["output_ids"] == free["output_ids"][: first + 1]  # SGLang keeps the matched token
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}


@SGL
async def test_sglang_streaming_chunks_add_up_to_result(sglang_gpu: None, sgl: SGLangEngine) -> None:
    chunks = [c async for c in sgl.generate_stream(PROMPTS[0], {"max_new_tokens": 9, **GREEDY})]
    assert chunks[-1].finished and chunks[-1].result is not None
    toks = [t for c in chunks for t in c.token_ids]
    assert toks == chunks[-1].result["output_ids"] and len(toks) == 9
    lps = [lp for c in chunks for lp in c.logprobs]
    assert lps == [lp for lp, _, _ in chunks[-1].result["meta_info"]["output_token_logprobs"]]
    assert len(chunks) >= 2  # streamed as it goes, not one chunk at the end


@SGL
async def test_sglang_abort_returns_partial_output(sglang_gpu: None, sgl: SGLangEngine) -> None:
    stream = sgl.generate_stream(PROMPTS[0], {"max_new_tokens": 59, **GREEDY}, rid="r1")
    seen = []
    while sum(len(c.token_ids) for c in seen) < 3:
        seen.append(await stream.__anext__())
    assert await sgl.abort("r1")
    assert not await sgl.abort("nope")
    rest = [c async for c in stream]
    res = rest[-1].result
    assert res["meta_info"]["finish_reason"]["type"] == "abort"
    n = len(res["output_ids"])
    assert 3 <= n < 59 and len(res["meta_info"]["output_token_logprobs"]) == n
    assert res["output_ids"][:3] == [t for c in seen for t in c.token_ids][:3]


@SGL
async def test_sglang_pause_abort_and_in_place(sglang_gpu: None, sgl: SGLangEngine) -> None:
    ref = await sgl.generate(PROMPTS[2], {"max_new_tokens": 50, **GREEDY})
    try:
        task = await running(sgl, PROMPTS[2], {"max_new_tokens": 50, **GREEDY})  # type: ignore[arg-type]
        await sgl.pause("in_place")
        late = asyncio.ensure_future(sgl.generate(PROMPTS[0], {"max_new_tokens": 3, **GREEDY}))
        await asyncio.sleep(0.1)
        assert not task.done() and not late.done()  # nothing moves while paused
        await sgl.resume()
        assert (await task)["output_ids"] == ref["output_ids"]  # in_place loses nothing
        await late

        task = await running(sgl, PROMPTS[2], {"max_new_tokens": 50, **GREEDY})  # type: ignore[arg-type]
        await sgl.pause("abort")
        r = await task
        assert r["meta_info"]["finish_reason"]["type"] == "abort"
        assert r["output_ids"] == ref["output_ids"][: len(r["output_ids"])]
        blocked = asyncio.ensure_future(sgl.generate(PROMPTS[0], {"max_new_tokens": 3, **GREEDY}))
        await asyncio.sleep(0.1)
        assert not blocked.done()
        await sgl.resume()
        assert (await blocked)["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        if sgl.is_paused:
            await sgl.resume()


@SGL
async def test_sglang_weight_updates_change_version_and_outputs(
    sglang_gpu: None, sgl: SGLangEngine, engine_model_dir: Path, tiny_model_dir_b: Path
) -> None:
    model_a, model_b = hf(engine_model_dir), hf(tiny_model_dir_b)
    ref_a, ref_b = hf_greedy(model_a, PROMPTS[0], 10), hf_greedy(model_b, PROMPTS[0], 10)
    assert ref_a != ref_b
    try:
        assert (await sgl.generate(PROMPTS[0], {"max_new_tokens": 10, **GREEDY}))["output_ids"] == ref_a
        await sgl.update_weights_from_disk(str(tiny_model_dir_b), weight_version="7")
        r = await sgl.generate(PROMPTS[0], {"max_new_tokens": 10, **GREEDY})
        assert r["output_ids"] == ref_b and r["meta_info"]["weight_version"] == "7" == sgl.weight_version
        # From tensors (CUDA IPC, as verl/slime send them), back to A; no version given: "7" -> "8".
        tensors = {k: v.cuda() for k, v in model_a.state_dict().items()}
        await sgl.update_weights_from_state_dict(tensors)
        r = await sgl.generate(PROMPTS[0], {"max_new_tokens": 10, **GREEDY})
        assert r["output_ids"] == ref_a and r["meta_info"]["weight_version"] == "8"
        with pytest.raises(EngineError):
            await sgl.update_weights_from_disk(str(engine_model_dir / "missing"), weight_version="9")
        assert sgl.weight_version == "8"
    finally:
        await restore(sgl, engine_model_dir)


@SGL
async def test_sglang_bad_requests_fail_alone(sglang_gpu: None, sgl: SGLangEngine) -> None:
    good = asyncio.ensure_future(sgl.generate(PROMPTS[0], {"max_new_tokens": 20, **GREEDY}))
    for ids, params, msg in [*BAD_REQUESTS, ([1, 5], {"bogus": 1}, "sampling_params")]:
        with pytest.raises(EngineError, match=msg):
            await sgl.generate(ids, params)
        with pytest.raises(EngineError, match=msg):
            _ = [c async for c in sgl.generate_stream(ids, params)]
    r = await good
    assert r["meta_info"]["completion_tokens"] == 20
    assert await sgl.health()


@SGL
async def test_sglang_server_launcher_serves_generate(sglang_gpu: None, engine_model_dir: Path) -> None:
    from streamrl.engine.http.client import SGLangClient

    args = ["--dtype", "float32", "--mem-fraction-static", "0.2", "--disable-cuda-graph",
            "--attention-backend", "torch_native", "--sampling-backend", "pytorch"]
    ref = hf_greedy(hf(engine_model_dir), PROMPTS[0], 8)
    async with SGLangServer(str(engine_model_dir), None, args) as server, SGLangClient(server.url) as c:
        r = await c.generate(PROMPTS[0], {"max_new_tokens": 8, **GREEDY})
        assert r["output_ids"] == ref
        assert len(r["meta_info"]["output_token_logprobs"]) == 8
    assert server.proc is not None and server.proc.returncode is not None
