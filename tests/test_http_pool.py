"""`HttpPool` (the rollout manager's handle on `streamrl serve` / SGLang servers) against a real server
on 127.0.0.1: a group as one batched request, and weights staged before the pause."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import test_http_server
from safetensors.torch import load_file
from test_http_server import GREEDY, PROMPT, Server, until

from streamrl.rollout.http_pool import HttpPool
from streamrl.weights import DiskSync

pytestmark = pytest.mark.asyncio(loop_scope="module")
srv = test_http_server.srv  # the in-process server fixture (one per module)


async def test_http_pool_sends_a_group_as_one_batch(srv: Server) -> None:
    """`HttpPool.generate_many`: one POST for the whole group, answers in order and equal to separate
    requests; a pause with mode abort returns every member's partial output."""
    pool = HttpPool([srv.url])
    await pool.start()
    try:
        calls: list[object] = []
        real = pool.clients[0].generate

        async def counted(input_ids, *a, **kw):
            calls.append(input_ids)
            return await real(input_ids, *a, **kw)

        pool.clients[0].generate = counted
        prompts = [PROMPT, PROMPT[:3], PROMPT + [8]]
        params = [{"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 7 + i} for i in range(3)]
        rids = ["g-0", "g-1", "g-2"]
        batch = await pool.generate_many(prompts, params, rids)
        assert len(calls) == 1 and calls[0] == prompts  # one request carried the group
        assert [r["meta_info"]["id"] for r in batch] == rids
        for p, sp, r in zip(prompts, params, batch, strict=True):  # seeded: the same as alone
            alone = await pool.generate(p, sp, "alone-" + r["meta_info"]["id"])
            assert alone["output_ids"] == r["output_ids"]
            assert [x[0] for x in alone["meta_info"]["output_token_logprobs"]] == pytest.approx(
                [x[0] for x in r["meta_info"]["output_token_logprobs"]], abs=1e-5)

        long = [{"max_new_tokens": 50, **GREEDY}] * 3
        task = asyncio.create_task(pool.generate_many(prompts, long, ["p-0", "p-1", "p-2"]))
        before = srv.engine.stats()["generated_tokens"]
        await until(lambda: srv.engine.stats()["generated_tokens"] >= before + 6)  # every member has tokens
        await pool.pause("abort")
        out = await task
        assert [r["meta_info"]["finish_reason"]["type"] for r in out] == ["abort"] * 3
        for r in out:
            assert 0 < len(r["output_ids"]) < 50
            assert len(r["output_ids"]) == len(r["meta_info"]["output_token_logprobs"])
        await pool.resume()
        assert (await pool.generate_many([PROMPT], [{"max_new_tokens": 2, **GREEDY}], ["after"]))[0][
            "meta_info"]["completion_tokens"] == 2
    finally:
        await pool.aclose()


async def test_http_pool_stages_weights_before_the_pause(srv: Server, tiny_model_dir_b: Path) -> None:
    """`DiskSync.stage` writes the folder while the engines still generate; `load` of that version then
    only loads it (`push_weights` does both around the pause). Another version is written at load time."""
    params = {"max_new_tokens": 8, **GREEDY}
    before = await srv.client.generate(PROMPT, params)
    weights_b = load_file(str(tiny_model_dir_b / "model.safetensors"))
    pool = HttpPool([srv.url])
    await pool.start()
    sync = pool.weight_sync
    assert isinstance(sync, DiskSync)
    try:
        writes: list[int] = []
        real = sync._write

        async def counted(named_tensors, version):
            writes.append(version)
            return await real(named_tensors, version)

        sync._write = counted
        await sync.stage(weights_b, 7)
        assert writes == [7] and (sync.root / "v7" / "model.safetensors").exists()
        assert srv.engine.weight_version != "7"  # staging leaves the engines alone
        await pool.pause("abort")
        await sync.load(weights_b, 7)
        await pool.resume()
        assert writes == [7] and srv.engine.weight_version == "7"
        assert (await srv.client.generate(PROMPT, params))["output_ids"] != before["output_ids"]
        weights_a = load_file(str(srv.model_dir / "model.safetensors"))
        await pool.push_weights(weights_a, 8)  # staged inside push_weights, loaded in its pause
        assert writes == [7, 8] and not (sync.root / "v7").exists() and srv.engine.weight_version == "8"
        assert not pool.is_paused and not srv.engine.is_paused
        assert (await srv.client.generate(PROMPT, params))["output_ids"] == before["output_ids"]
    finally:
        await pool.aclose()
        await srv.client.update_weight_version("default")
    assert not sync.root.exists()  # the folders leave with the pool
