"""The `ray_serve` pool against real Ray Serve: one Ray session for this whole module.

Replicas are real Serve replica processes running TorchEngine; a replica is killed with SIGKILL by
its pid, as a crash would.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest
import torch

from streamrl.config import ConfigError, EnginesConfig, config_from_dict
from streamrl.engine import EngineError, TorchEngine
from streamrl.engine.args import EngineArgs
from streamrl.rollout.ray_serve_pool import RayServePool, start_ray
from streamrl.run import run
from streamrl.types import Group
from streamrl.weights import pack, unpack

ENGINE = dict(device="cpu", dtype="float32", max_running_requests=32, weight_version="0")
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
PROMPTS = [[1, 5 + i, 9, 3 + (i % 4)] for i in range(6)]


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory: pytest.TempPathFactory):
    import ray
    from ray import serve

    started = start_ray(tmp_path_factory.mktemp("ray"), num_cpus=4)
    assert started and ray.is_initialized()
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
async def pool(ray_session, engine_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    cfg = EnginesConfig(pool="ray_serve", num_replicas=2, cpus_per_replica=1, stream_interval=2)
    p = RayServePool(str(engine_model_dir), cfg, EngineArgs(num_threads=1, **ENGINE), run_dir=tmp_path_factory.mktemp("pool"))
    await p.start()
    yield p
    await p.aclose()


async def reference_outputs(model_dir: Path, weights: dict | None = None) -> list[list[int]]:
    async with TorchEngine(str(model_dir), num_threads=1, **ENGINE) as eng:
        if weights is not None:
            await eng.update_weights_from_state_dict(weights, "1")
        return [(await eng.generate(p, GREEDY))["output_ids"] for p in PROMPTS]


async def generate_spread(pool: RayServePool, params: dict, n_batches: int = 6) -> list[dict]:
    """Requests in separate event-loop turns: each turn is one batch call that Serve routes."""
    tasks = []
    for b in range(n_batches):
        tasks += [asyncio.create_task(pool.generate(p, params, f"s{b}-{i}-{time.monotonic_ns()}"))
                  for i, p in enumerate(PROMPTS)]
        await asyncio.sleep(0.01)
    return await asyncio.gather(*tasks)


def test_packed_weights_round_trip() -> None:
    # Odd-sized narrow tensors before wide ones: every view must start at a multiple of its element size.
    state = {"c": torch.randn(3).bfloat16(), "a": torch.randn(3, 4), "i8": torch.arange(3, dtype=torch.int8),
             "b": torch.arange(5, dtype=torch.int64), "s": torch.tensor(2.5), "e": torch.empty(0, 4),
             "t": torch.randn(4, 3).t(), "h": torch.randn(7).half()}
    table, data = pack(state)
    back = unpack(table, data)
    assert set(back) == set(state)
    for k, v in state.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v)


async def test_two_replicas_serve_generation(pool: RayServePool, engine_model_dir: Path) -> None:
    expected = await reference_outputs(engine_model_dir)
    results = await generate_spread(pool, GREEDY)
    for k, res in enumerate(results):
        assert res["output_ids"] == expected[k % len(PROMPTS)]
        meta = res["meta_info"]
        assert meta["finish_reason"]["type"] in ("stop", "length")
        assert len(meta["output_token_logprobs"]) == len(res["output_ids"])
        assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    assert len([r for r in pool.requests_by_replica if r]) == 2, pool.requests_by_replica
    await pool.refresh_stats()
    stats = pool.stats()
    assert len(stats["replicas"]) == 2 and len({s["pid"] for s in stats["replicas"]}) == 2
    assert all(s["pid"] != os.getpid() for s in stats["replicas"])  # generation runs in other processes


async def test_bad_request_fails_alone(pool: RayServePool) -> None:
    bad = asyncio.create_task(pool.generate([1, 2], {"max_new_tokens": 10_000}, "too-long"))
    good = asyncio.create_task(pool.generate(PROMPTS[0], GREEDY, "fine"))
    with pytest.raises(EngineError, match="context length"):
        await bad
    assert len((await good)["output_ids"]) > 0


async def test_abort_by_rid_reaches_the_replica_that_runs_it(pool: RayServePool) -> None:
    params = {"max_new_tokens": 50, "temperature": 1.0, "ignore_eos": True}
    task = asyncio.create_task(pool.generate(PROMPTS[1], params, "long-one"))
    while not pool._inflight or not (await _running(pool)):
        await asyncio.sleep(0.005)
    assert await pool.abort("long-one")
    res = await task
    assert res["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(res["output_ids"]) < 50
    assert not await pool.abort("no-such-request")


async def test_pause_abort_returns_partials_and_resume(pool: RayServePool) -> None:
    params = {"max_new_tokens": 50, "temperature": 1.0, "ignore_eos": True}
    tasks = [asyncio.create_task(pool.generate(p, params, f"pz{i}")) for i, p in enumerate(PROMPTS)]
    while await _running(pool) == 0:
        await asyncio.sleep(0.005)
    await pool.pause("abort")
    results = await asyncio.gather(*tasks)
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)
    assert pool.is_paused
    await pool.resume()
    assert not pool.is_paused
    assert len((await pool.generate(PROMPTS[0], GREEDY, "after-resume"))["output_ids"]) > 0


async def test_release_and_resume_memory_on_every_replica(pool: RayServePool) -> None:
    await pool.pause("abort")
    await pool.release_memory()
    await pool.refresh_stats()
    assert [s["kv_cache_bytes"] for s in pool.stats()["replicas"]] == [0, 0]
    await pool.resume_memory()
    await pool.resume()
    await pool.refresh_stats()
    assert all(s["kv_cache_bytes"] > 0 for s in pool.stats()["replicas"])
    assert len((await pool.generate(PROMPTS[0], GREEDY, "after-memory"))["output_ids"]) > 0


async def test_weight_update_reaches_every_replica(pool: RayServePool, tiny_model_dir_b: Path) -> None:
    from transformers import AutoModelForCausalLM

    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir_b).state_dict()
    await pool.push_weights(new, 1)
    assert not pool.is_paused
    await pool.refresh_stats()
    assert [s["weight_version"] for s in pool.stats()["replicas"]] == ["1", "1"]
    expected = await reference_outputs(tiny_model_dir_b)  # same architecture, the other weights
    results = await generate_spread(pool, GREEDY)
    assert [r["output_ids"] for r in results] == [expected[k % len(PROMPTS)] for k in range(len(results))]
    assert {r["meta_info"]["weight_version"] for r in results} == {"1"}
    assert len([r for r in pool.requests_by_replica if r]) >= 2


async def test_replacement_replica_loads_current_weights_before_serving(pool: RayServePool) -> None:
    """Runs after the update to version 1: a replica killed now comes back at version 1."""
    await pool.refresh_stats()
    before = {s["pid"]: s for s in pool.stats()["replicas"]}
    victim = sorted(before)[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while True:
        await asyncio.sleep(0.5)
        await pool.refresh_stats()
        pids = {s["pid"]: s for s in pool.stats()["replicas"]}
        if len(pids) == 2 and victim not in pids:
            break
        assert time.monotonic() < deadline, "Serve did not replace the killed replica"
    assert [s["weight_version"] for s in pids.values()] == ["1", "1"]
    results = await generate_spread(pool, GREEDY)
    assert {r["meta_info"]["weight_version"] for r in results} == {"1"}


async def test_an_adapter_push_reaches_every_replica_as_adapter_tensors(pool: RayServePool,
                                                                        tiny_model_dir_b: Path) -> None:
    """LoRA: the object store carries the adapter tensors only; each replica merges them into the weights
    it holds (version 1, tiny_model_dir_b's) and serves what a local engine with that adapter serves."""
    from test_lora import lora_trainer, moved

    adapter = moved(lora_trainer(tiny_model_dir_b))
    await pool.push_weights(adapter, 2)
    await pool.refresh_stats()
    assert [s["weight_version"] for s in pool.stats()["replicas"]] == ["2", "2"]
    async with TorchEngine(str(tiny_model_dir_b), num_threads=1, **ENGINE) as eng:
        await eng.load_lora_adapter(adapter, "2")
        expected = [(await eng.generate(p, GREEDY))["output_ids"] for p in PROMPTS]
    assert expected != await reference_outputs(tiny_model_dir_b)  # the adapter changes what is generated
    results = await generate_spread(pool, GREEDY)
    assert [r["output_ids"] for r in results] == [expected[k % len(PROMPTS)] for k in range(len(results))]
    assert len([r for r in pool.requests_by_replica if r]) >= 2


async def _running(pool: RayServePool) -> int:
    await pool.refresh_stats()
    return sum(s["running"] for s in pool.stats()["replicas"])


def test_sglang_replicas_need_the_ray_serve_pool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="engines.engine"):
        config_from_dict({"run_dir": str(tmp_path), "engines": {"pool": "local", "engine": "sglang"}},
                         check_paths=False)


async def test_run_survives_a_killed_replica(ray_session, tmp_path: Path, tiny_model_dir: Path) -> None:
    """`streamrl run` with two replicas; one is SIGKILLed while it generates. Every prompt's group is
    trained exactly once: nothing lost (a lost group would be replaced by a prompt of the next epoch)
    and nothing counted twice."""
    from ray import serve

    prompts = [f"{a}+{b}=" for a in range(10, 22) for b in range(20, 24)]  # 48 prompts = 12 steps x 4 groups
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
    cfg = config_from_dict({
        "run_dir": str(tmp_path / "run"), "save_samples": True,
        "model": {"path": str(tiny_model_dir), "init": "none"},
        "warm_start": {"enabled": False},
        "data": {"task": None, "path": str(data), "eval_size": 0},
        # A random model rarely emits EOS: every sample runs its full 40 tokens, so replicas are busy.
        "engines": {"pool": "ray_serve", "num_replicas": 2, "cpus_per_replica": 1, "stream_interval": 4},
        "rollout": {"group_size": 4, "max_new_tokens": 40},
        "controller": {"max_staleness": 0},
        "trainer": {"lr": 1e-5}, "schedule": {"steps": 12, "batch_groups": 4},
    })
    before = set(serve.status().applications)
    task = asyncio.create_task(run(cfg, show_progress=False, log=lambda *_: None))
    try:
        # Touch Serve only once the run trains: Serve builds its config objects through a global,
        # unlocked cloudpickle registry, so a status call racing the run's own deploy can break it.
        metrics = Path(cfg.run_dir) / "metrics.jsonl"
        while not task.done() and not (metrics.is_file() and metrics.read_text()):
            await asyncio.sleep(0.05)
        killed = await _kill_a_busy_replica(task, before)
        summary = await task
    finally:  # a failed assertion above must not leave the run (and its replicas) behind
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert killed, "no replica was caught generating"
    assert summary["requests_lost_with_a_replica"] > 0
    dec = msgspec.json.Decoder(Group)
    groups = [dec.decode(line) for line in (Path(cfg.run_dir) / "samples.jsonl").read_bytes().splitlines()]
    assert len(groups) == 48 and len({g.group_id for g in groups}) == 48
    assert sorted(g.samples[0].prompt_text for g in groups) == sorted(prompts)
    assert all(len(g.samples) == 4 for g in groups)
    for g in groups:
        for s in g.samples:  # resumed samples kept their tokens: each has its whole budget
            assert len(s.response_ids) == len(s.logprobs) == len(s.versions)
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["partial_resumed"] for r in rows) > 0
    assert sum(r["tokens_discarded"] for r in rows) == 0
    assert set(serve.status().applications) == before  # the run removed its app


async def _kill_a_busy_replica(run_task: asyncio.Task, other_apps: set[str]) -> bool:
    """Find the run's Serve app, wait for a replica with requests running, SIGKILL it by pid."""
    from ray import serve

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not run_task.done():
        apps = [a for a, st in serve.status().applications.items() if a not in other_apps and st.status == "RUNNING"]
        stats = []
        if apps:
            try:
                handle = serve.get_deployment_handle("engine", apps[0])
                stats = await handle.broadcast("stats").results_async(return_exceptions=True)
            except Exception:  # noqa: BLE001 - the app is still deploying
                pass
            # A replica in the middle of a batch, not one finishing its last sample: the stats are a
            # few ms old when the kill lands, and a replica that has just gone idle loses nothing.
            busy = sorted((s for s in stats if isinstance(s, dict) and s["running"] >= 4), key=lambda s: -s["running"])
            if busy:
                os.kill(busy[0]["pid"], signal.SIGKILL)
                return True
        await asyncio.sleep(0.01)
    return False
