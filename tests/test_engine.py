"""TorchEngine against transformers itself: greedy tokens, logprobs, sampling, and the SGLang-style
control contract (abort, pause/resume, weight updates, memory, bad requests)."""

from __future__ import annotations

import asyncio
import inspect
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from streamrl.engine import EngineError, EngineState, TorchEngine
from streamrl.engine.model_runner import FallbackRunner

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 14, 15], [1, 20, 4, 4, 4, 8]]


def hf(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # The reference must not stop at EOS either (min_new_tokens would ban EOS instead: a different
    # distribution from ignore_eos, which keeps EOS sampleable and just does not stop on it).
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


DEVICE = os.environ.get("STREAMRL_TEST_DEVICE", "cpu")  # `cuda` runs the same contract on a GPU
# `paged` runs it through the GPU runner (on CUDA that is what `auto` picks; on CPU through Triton's
# interpreter, TRITON_INTERPRET=1: slow, a check of the logic only).
RUNNER = os.environ.get("STREAMRL_TEST_RUNNER", "auto")


def engine(path: Path, **kw) -> TorchEngine:
    kw.setdefault("device", DEVICE)
    kw.setdefault("runner", RUNNER)
    kw.setdefault("max_running_requests", 8)
    return TorchEngine(str(path), **kw)


async def test_result_shape_matches_sglang(engine_model_dir: Path) -> None:
    async with engine(engine_model_dir) as eng:
        r = await eng.generate([1, 5, 6], {"max_new_tokens": 5, **GREEDY}, rid="abc")
    assert set(r) == {"text", "output_ids", "meta_info"}
    meta = r["meta_info"]
    assert meta["id"] == "abc"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 5 and meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default"
    assert [t for _, t, _ in meta["output_token_logprobs"]] == r["output_ids"]
    assert all(x is None for _, _, x in meta["output_token_logprobs"])
    assert isinstance(r["text"], str) and len(r["text"]) > 0


async def test_greedy_equals_generate_alone_and_in_staggered_batch(engine_model_dir: Path) -> None:
    model = hf(engine_model_dir)
    refs = [hf_greedy(model, p, 12 + 3 * i) for i, p in enumerate(PROMPTS)]
    async with engine(engine_model_dir, max_running_requests=3) as eng:
        alone = await eng.generate(PROMPTS[2], {"max_new_tokens": 18, **GREEDY})
        assert alone["output_ids"] == refs[2]

        async def late(i: int, p: list[int]):
            await asyncio.sleep(0.01 * i)  # arrivals spread over several decode steps
            return await eng.generate(p, {"max_new_tokens": 12 + 3 * i, **GREEDY})

        results = await asyncio.gather(*[late(i, p) for i, p in enumerate(PROMPTS)])
    for r, ref in zip(results, refs, strict=True):
        assert r["output_ids"] == ref
    assert len({tuple(r) for r in refs}) > 1  # the model is not degenerate


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_equal_full_forward(tiny_model_dir: Path, temperature: float) -> None:
    # The quickstart-shaped model (default init). fp32 noise grows with logit magnitude: on the
    # wide-init model the same check gives ~1e-4 on tokens of logprob ~ -15.
    model = hf(tiny_model_dir)
    async with engine(tiny_model_dir) as eng:
        results = await asyncio.gather(*[
            eng.generate(p, {"max_new_tokens": 15, "temperature": temperature, "sampling_seed": i})
            for i, p in enumerate(PROMPTS)
        ])
    for p, r in zip(PROMPTS, results, strict=True):
        got = [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]
        ref = hf_logprobs(model, p, r["output_ids"], temperature)
        err = max(abs(a - b) for a, b in zip(got, ref, strict=True))
        assert err <= 1e-4, err


async def test_logprobs_ignore_truncation(tiny_model_dir: Path) -> None:
    """top-k/top-p change what is sampled, not the reported logprob (the untruncated distribution)."""
    model = hf(tiny_model_dir)
    async with engine(tiny_model_dir) as eng:
        r = await eng.generate(PROMPTS[0], {"max_new_tokens": 10, "top_k": 3, "top_p": 0.8, "sampling_seed": 1})
    got = [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, hf_logprobs(model, PROMPTS[0], r["output_ids"]), strict=True)) < 1e-4


async def test_seeded_sampling_is_reproducible_whatever_the_batch(engine_model_dir: Path) -> None:
    params = {"max_new_tokens": 20, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 42}
    async with engine(engine_model_dir) as eng:
        a = await eng.generate(PROMPTS[0], params)
        others = [eng.generate(p, {"max_new_tokens": 20, "temperature": 1.0}) for p in PROMPTS[1:]]
        b, *_ = await asyncio.gather(eng.generate(PROMPTS[0], params), *others)
        c = await eng.generate(PROMPTS[0], {**params, "sampling_seed": 43})
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


async def test_truncation_params_reduce_to_greedy(engine_model_dir: Path) -> None:
    async with engine(engine_model_dir) as eng:
        greedy = await eng.generate(PROMPTS[1], {"max_new_tokens": 12, **GREEDY})
        for extra in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
            r = await eng.generate(PROMPTS[1], {"max_new_tokens": 12, "ignore_eos": True, **extra})
            assert r["output_ids"] == greedy["output_ids"], extra


async def test_stop_tokens_and_eos(engine_model_dir: Path) -> None:
    async with engine(engine_model_dir) as eng:
        free = await eng.generate(PROMPTS[2], {"max_new_tokens": 20, **GREEDY})
        stop_tok = free["output_ids"][4]
        first = free["output_ids"].index(stop_tok)
        r = await eng.generate(PROMPTS[2], {"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [stop_tok]})
        zero = await eng.generate(PROMPTS[2], {"max_new_tokens": 0})
    assert r["output_ids"] == free["output_ids"][: first + 1]  # SGLang keeps the matched token
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"


async def test_streaming_chunks_add_up_to_result(engine_model_dir: Path) -> None:
    async with engine(engine_model_dir) as eng:
        chunks = [c async for c in eng.generate_stream(PROMPTS[0], {"max_new_tokens": 9, **GREEDY})]
    assert chunks[-1].finished and chunks[-1].result is not None
    toks = [t for c in chunks for t in c.token_ids]
    assert toks == chunks[-1].result["output_ids"] and len(toks) == 9
    assert len(chunks) >= 9  # one chunk per decode step, not one at the end


async def test_abort_returns_partial_output(engine_model_dir: Path) -> None:
    async with engine(engine_model_dir, max_running_requests=1) as eng:
        stream = eng.generate_stream(PROMPTS[0], {"max_new_tokens": 50, **GREEDY}, rid="r1")
        seen = [await stream.__anext__() for _ in range(3)]
        waiting = asyncio.ensure_future(eng.generate(PROMPTS[1], {"max_new_tokens": 5}, rid="r2"))
        await asyncio.sleep(0.01)
        assert await eng.abort("r2") and await eng.abort("r1")  # r2 still waits for the one row
        assert not await eng.abort("nope")  # unknown rid: no-op
        rest = [c async for c in stream]
        res = rest[-1].result
        w = await waiting
    assert res["meta_info"]["finish_reason"]["type"] == "abort"
    n = len(res["output_ids"])
    assert 3 <= n < 50 and len(res["meta_info"]["output_token_logprobs"]) == n
    assert res["output_ids"][:3] == [c.token_ids[0] for c in seen]
    assert w["meta_info"]["finish_reason"]["type"] == "abort" and w["output_ids"] == []


async def running(eng: TorchEngine, prompt: list[int], params: dict) -> asyncio.Future[dict]:
    """A request known to run: its first token has streamed back (an event, not a sleep, so a fast
    GPU cannot finish it, nor a slow machine not yet start it, before the caller acts). Returns the
    future of its final result; the rest of its stream is read in the background."""
    stream = eng.generate_stream(prompt, params)
    first = await stream.__anext__()
    assert not first.finished and first.token_ids

    async def rest() -> dict:
        async for chunk in stream:
            if chunk.finished:
                assert chunk.result is not None
                return chunk.result
        raise AssertionError("the stream ended without a result")

    return asyncio.ensure_future(rest())


async def test_pause_abort_and_in_place(engine_model_dir: Path) -> None:
    params = {"max_new_tokens": 40, **GREEDY}
    async with engine(engine_model_dir) as eng:
        ref = await eng.generate(PROMPTS[2], params)
        task = await running(eng, PROMPTS[2], params)
        await eng.pause("in_place")
        frozen = eng.stats()["running"]
        late = asyncio.ensure_future(eng.generate(PROMPTS[0], {"max_new_tokens": 3, **GREEDY}))
        await asyncio.sleep(0.05)
        assert not task.done() and not late.done() and frozen == 1  # nothing moves while paused
        await eng.resume()
        assert (await task)["output_ids"] == ref["output_ids"]  # in_place loses nothing
        await late

        task = await running(eng, PROMPTS[2], params)
        await eng.pause("abort")
        r = await task
        assert r["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(r["output_ids"]) < 40 and r["output_ids"] == ref["output_ids"][: len(r["output_ids"])]
        blocked = asyncio.ensure_future(eng.generate(PROMPTS[0], {"max_new_tokens": 3, **GREEDY}))
        await asyncio.sleep(0.05)
        assert not blocked.done()
        await eng.resume()
        assert (await blocked)["meta_info"]["finish_reason"]["type"] == "length"


async def test_weight_update_from_state_dict_and_disk(engine_model_dir: Path, tiny_model_dir_b: Path) -> None:
    model_a, model_b = hf(engine_model_dir), hf(tiny_model_dir_b)
    ref_a, ref_b = hf_greedy(model_a, PROMPTS[0], 10), hf_greedy(model_b, PROMPTS[0], 10)
    assert ref_a != ref_b
    async with engine(engine_model_dir) as eng:
        assert (await eng.generate(PROMPTS[0], {"max_new_tokens": 10, **GREEDY}))["output_ids"] == ref_a
        await eng.update_weights_from_state_dict(model_b.state_dict(), weight_version="7")
        r = await eng.generate(PROMPTS[0], {"max_new_tokens": 10, **GREEDY})
        assert r["output_ids"] == ref_b and r["meta_info"]["weight_version"] == "7"
        await eng.update_weights_from_disk(str(engine_model_dir), weight_version="8")
        r = await eng.generate(PROMPTS[0], {"max_new_tokens": 10, **GREEDY})
        assert r["output_ids"] == ref_a and eng.weight_version == "8"
        with pytest.raises(EngineError, match="shape mismatch"):
            await eng.update_weights_from_state_dict({"lm_head.weight": torch.zeros(3, 3)})
        with pytest.raises(EngineError, match="unknown parameter"):
            await eng.update_weights_from_state_dict({"nope": torch.zeros(3)})
        assert eng.weight_version == "8"


def hf_greedy_on_stale_cache(old, new, prefix: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and logprobs of `new` continuing `prefix` on the KV cache `old` computed for all
    of it but its last token: what an engine paused in place holds when its weights change."""
    # transformers 5.2x renamed the argument `past_key_values` to `cache`; an unknown name would be ignored.
    name = "cache" if "cache" in inspect.signature(new.forward).parameters else "past_key_values"
    with torch.no_grad():
        cache = old(torch.tensor([prefix[:-1]]), use_cache=True).past_key_values
        tok, out, lps = prefix[-1], [], []
        for _ in range(n):
            lp = torch.log_softmax(new(torch.tensor([[tok]]), **{name: cache}).logits[0, -1].float(), -1)
            tok = int(lp.argmax())
            out.append(tok)
            lps.append(lp[tok].item())
    return out, lps


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_update_mid_request_recomputes_or_keeps_kv_and_records_versions(
    engine_model_dir: Path, tiny_model_dir_b: Path, mode: str
) -> None:
    """SGLang's two ways to pause without losing requests, across a weight update: `retract`
    recomputes their KV with the new weights (the tokens after the update are the new model's, given
    the tokens so far); `in_place` keeps the old weights' KV, and the new weights read it."""
    model_a, model_b = hf(engine_model_dir), hf(tiny_model_dir_b)
    async with engine(engine_model_dir) as eng:
        stream = eng.generate_stream(PROMPTS[0], {"max_new_tokens": 16, **GREEDY})
        first = [await stream.__anext__() for _ in range(4)]
        await eng.pause(mode)
        prefilled = eng.stats()["prefill_tokens"]
        await eng.update_weights_from_state_dict(model_b.state_dict(), weight_version="1")
        await eng.resume()
        rest = [c async for c in stream]
        recomputed = eng.stats()["prefill_tokens"] - prefilled
    res = rest[-1].result
    prefix = [c.token_ids[0] for c in first]
    assert res["output_ids"][:4] == prefix
    # Chunks queued before the pause still carry the old version: count by the chunks' own label.
    n_old = sum(len(c.token_ids) for c in first + rest if c.weight_version == "default")
    assert 4 <= n_old < 16
    old, new = res["output_ids"][:n_old], res["output_ids"][n_old:]
    new_lp = [lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]][n_old:]
    exact_ids = hf_greedy(model_b, PROMPTS[0] + old, len(new))
    exact = exact_ids, hf_logprobs(model_b, PROMPTS[0] + old, exact_ids)
    stale = hf_greedy_on_stale_cache(model_a, model_b, PROMPTS[0] + old, len(new))
    assert abs(exact[1][0] - stale[1][0]) > 1e-3  # this model pair tells the two modes apart
    want_ids, want_lp = exact if mode == "retract" else stale
    assert new == want_ids
    assert max(abs(a - b) for a, b in zip(new_lp, want_lp, strict=True)) < 1e-4
    # retract: the prompt and the old tokens once more, in one prefill; in_place: nothing.
    assert recomputed == (len(PROMPTS[0]) + n_old if mode == "retract" else 0)
    spans = res["meta_info"]["weight_versions"]
    assert spans == [
        {"version": "default", "start": 0, "end": n_old},
        {"version": "1", "start": n_old, "end": 16},
    ]


async def test_bad_requests_fail_alone(engine_model_dir: Path) -> None:
    bad = [
        ([], {}, "non-empty"),
        ([1, 999], {}, "outside the vocabulary"),
        ([1, -1], {}, "outside the vocabulary"),
        ([1] * 60, {"max_new_tokens": 10}, "exceeds the context"),
        ([1] * 64, {"max_new_tokens": 1}, "context is 64"),
        ([1, 5], {"temperature": -1}, "temperature"),
        ([1, 5], {"top_p": 0}, "top_p"),
        ([1, 5], {"top_k": 0}, "top_k"),
        ([1, 5], {"min_p": 2}, "min_p"),
        ([1, 5], {"max_new_tokens": -1}, "max_new_tokens"),
        ([1, 5], {"stop_token_ids": [500]}, "stop_token_ids"),
        ([1, 5], {"bogus": 1}, "sampling_params"),
        ([1, 5], {"temperature": "hot"}, "sampling_params"),
    ]
    async with engine(engine_model_dir) as eng:
        good = asyncio.ensure_future(eng.generate(PROMPTS[0], {"max_new_tokens": 20, **GREEDY}))
        for ids, params, msg in bad:
            with pytest.raises(EngineError, match=msg):
                await eng.generate(ids, params)
        r = await good
        assert r["meta_info"]["completion_tokens"] == 20
        assert await eng.health()


async def test_release_and_resume_memory(engine_model_dir: Path) -> None:
    async with engine(engine_model_dir) as eng:
        ref = await eng.generate(PROMPTS[0], {"max_new_tokens": 8, **GREEDY})
        assert eng.stats()["kv_cache_bytes"] > 0
        await eng.release_memory()
        assert eng.stats()["kv_cache_bytes"] == 0
        await eng.resume_memory()
        r = await eng.generate(PROMPTS[0], {"max_new_tokens": 8, **GREEDY})
    assert r["output_ids"] == ref["output_ids"]


async def test_the_lifecycle_is_one_state(engine_model_dir: Path) -> None:
    """Every transition of `EngineState`; a released engine refuses `resume` (its KV is gone) and
    `resume_memory` returns to the state it was released from."""
    async with engine(engine_model_dir) as eng:
        assert eng.state is EngineState.SERVING and not eng.is_paused
        await eng.pause("retract")
        assert eng.state is EngineState.PAUSED_RETRACT and eng.stats()["state"] == "paused_retract"
        await eng.release_memory()
        assert eng.state is EngineState.RELEASED and eng.is_paused and eng.stats()["kv_cache_bytes"] == 0
        waiting = asyncio.ensure_future(eng.generate(PROMPTS[0], {"max_new_tokens": 2, **GREEDY}))
        with pytest.raises(EngineError, match="resume_memory first"):
            await eng.resume()
        await eng.resume_memory()
        assert eng.state is EngineState.PAUSED_RETRACT and not waiting.done()  # still paused, as before
        await eng.resume()
        assert eng.state is EngineState.SERVING
        assert len((await asyncio.wait_for(waiting, 30))["output_ids"]) == 2
        await eng.release_memory()
        await eng.resume_memory()
        assert eng.state is EngineState.SERVING  # released while serving: serving again
    assert eng.state is EngineState.CLOSED
    with pytest.raises(EngineError, match="closed"):
        await eng.generate(PROMPTS[0], {"max_new_tokens": 2})


async def test_cancelled_generate_frees_its_slot(engine_model_dir: Path) -> None:
    """A caller that stops waiting (an HTTP client that hung up) must not leave its request decoding."""
    async with engine(engine_model_dir) as eng:
        task = asyncio.ensure_future(eng.generate(PROMPTS[0], {"max_new_tokens": 40, **GREEDY}, rid="gone"))
        while eng.stats()["running"] == 0:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0
        assert not await eng.abort("gone")  # already gone
        r = await eng.generate(PROMPTS[1], {"max_new_tokens": 3, **GREEDY})  # and the engine still serves
        assert r["meta_info"]["completion_tokens"] == 3


async def test_running_and_token_limits_queue_requests(engine_model_dir: Path) -> None:
    async with engine(engine_model_dir, max_running_requests=2, max_total_tokens=40) as eng:
        peak = 0

        async def watch():
            nonlocal peak
            while True:
                peak = max(peak, eng.stats()["running"])
                await asyncio.sleep(0)

        w = asyncio.ensure_future(watch())
        rs = await asyncio.gather(*[eng.generate(p, {"max_new_tokens": 15, **GREEDY}) for p in PROMPTS])
        w.cancel()
    assert all(r["meta_info"]["completion_tokens"] == 15 for r in rs)
    assert 1 <= peak <= 2  # 2 rows, and 40 tokens only fit two requests of ~20


async def test_fallback_runner_for_other_architectures(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=32, n_positions=64, n_embd=32, n_layer=2, n_head=2, initializer_range=0.5)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    model = hf(tmp_path / "gpt2")
    async with engine(tmp_path / "gpt2", load_tokenizer=False, runner="auto") as eng:  # no paged runner for GPT-2
        assert isinstance(eng.runner, FallbackRunner)
        rs = await asyncio.gather(*[eng.generate(p, {"max_new_tokens": 8, **GREEDY}) for p in PROMPTS[:3]])
    for p, r in zip(PROMPTS, rs, strict=False):
        assert r["output_ids"] == hf_greedy(model, p, 8)


def test_prefill_in_length_buckets_equals_one_padded_batch(tiny_model_dir: Path) -> None:
    """Mixed lengths (resumed partials beside new prompts) are prefilled in buckets; logits and the KV
    cache a later decode reads must be those of one padded batch."""
    from streamrl.engine.model_runner import ModelRunner

    model = hf(tiny_model_dir)
    seqs = [[1] + [4 + (i * j) % 17 for j in range(n)] for i, n in enumerate([3, 40, 5, 60, 4, 41, 2])]
    bucketed, padded = ModelRunner(model, 8, 64), ModelRunner(model, 8, 64)
    rows = [6, 0, 5, 1, 4, 2, 3]
    with torch.inference_mode():
        a = bucketed.prefill(rows, seqs)
        b = padded._prefill_padded(rows, seqs)
        assert torch.allclose(a, b, atol=1e-5)
        by_row = sorted(range(len(seqs)), key=lambda i: rows[i])
        toks, lens = [int(a[i].argmax()) for i in by_row], [len(seqs[i]) for i in by_row]
        assert torch.allclose(bucketed.decode(toks, lens), padded.decode(toks, lens), atol=1e-5)


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_prefill_computes_a_repeated_prompt_once(tiny_model_dir: Path, cpu_kernel: bool) -> None:
    """A group's samples share their prompt: the runner computes it once and copies its KV. Logits and
    what later decode steps read must equal computing every row, and only distinct sequences run."""
    from streamrl.engine.model_runner import ModelRunner

    model = hf(tiny_model_dir)
    a_, b_ = [1, 5, 9, 4], [1] + [4 + j % 13 for j in range(37)]
    seqs = [a_, b_, a_, a_, [1, 7], b_, a_]
    shared, full = ModelRunner(model, 8, 64, cpu_kernel=cpu_kernel), ModelRunner(model, 8, 64, cpu_kernel=cpu_kernel)
    rows = [6, 0, 5, 1, 4, 2, 3]
    computed: list[int] = []
    inner = shared._prefill_padded
    shared._prefill_padded = lambda r, s: (computed.extend(len(x) for x in s), inner(r, s))[1]  # type: ignore[method-assign]
    with torch.inference_mode():
        x = shared.prefill(rows, seqs)
        y = full._prefill_distinct(rows, seqs)
        assert sorted(computed) == [2, 4, 38]  # three distinct sequences, each computed once
        assert torch.allclose(x, y, atol=1e-5)
        by_row = sorted(range(len(seqs)), key=lambda i: rows[i])
        toks, lens = [int(x[i].argmax()) for i in by_row], [len(seqs[i]) for i in by_row]
        for _ in range(3):  # every row attends to its copied prompt
            lx, ly = shared.decode(toks, lens), full.decode(toks, lens)
            assert torch.allclose(lx, ly, atol=1e-5)
            toks, lens = [int(t) for t in lx.argmax(-1)], [n + 1 for n in lens]


def test_split_span_reads_less_than_padding_and_covers_every_row() -> None:
    from streamrl.engine.model_runner import split_span

    keys = [20] * 56 + [300] * 6 + [290, 301]
    span, alone = split_span(keys)
    assert span == 20 and sorted(keys[r] for r in alone) == [290] + [300] * 6 + [301]
    assert split_span([50] * 8) == (50, [])  # uniform: one dense call
    assert split_span([200, 210]) == (210, [])  # a lone call would cost more than the padding it saves


async def test_decode_split_into_dense_and_single_rows_matches_full_forward(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import streamrl.engine.model_runner as mr

    monkeypatch.setattr(mr, "_CALL_COST_POSITIONS", 0)  # split at nearly every step
    model = hf(tiny_model_dir)
    prompts = [[1] + [4 + (i * j) % 17 for j in range(n)] for i, n in enumerate([2, 30, 3, 45, 5, 12])]
    async with engine(tiny_model_dir, cpu_kernel=False) as eng:  # the SDPA path (CPU defaults to the kernel)
        results = await asyncio.gather(*[
            eng.generate(p, {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True})
            for i, p in enumerate(prompts)
        ])
    for p, r in zip(prompts, results, strict=True):
        got = [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]
        ref = hf_logprobs(model, p, r["output_ids"])
        assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) <= 1e-4
