"""End-to-end runs of the training loop through the Python API (`streamrl.run.run`) and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from helpers import run_quickstart_cli
from transformers import AutoModelForCausalLM

from streamrl.config import ConfigError, config_from_dict
from streamrl.run import run
from streamrl.types import Group

REQUIRED = ("step", "version", "wall_s", "samples", "reward_mean", "tokens_generated", "gen_tps", "loss",
            "logprob_mismatch", "staleness_mean", "staleness_max", "partial_resumed", "tokens_discarded",
            "dropped_stale", "engine_idle_frac", "trainer_wait_s")
REPO = Path(__file__).parents[1]


def small_cfg(tmp_path: Path, model_dir: Path, **sections) -> dict:
    cfg = {
        "run_dir": str(tmp_path / "run"), "save_samples": True,
        "model": {"path": str(model_dir), "init": "none"},
        "data": {"eval_size": 16},
        "engines": {"max_running_requests": 32},
        "rollout": {"group_size": 4, "max_new_tokens": 6},
        "trainer": {"lr": 1e-4}, "schedule": {"steps": 6, "batch_groups": 2},
    }
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return cfg


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_groups(run_dir: Path) -> list[Group]:
    dec = msgspec.json.Decoder(Group)
    return [dec.decode(line) for line in (run_dir / "samples.jsonl").read_bytes().splitlines()]


async def test_sync_run_is_on_policy_and_writes_outputs(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = config_from_dict(small_cfg(
        tmp_path, tiny_model_dir, controller={"max_staleness": 0},
        data={"reward": f"{REPO / 'tests' / 'rewards_for_tests.py'}:length_reward"},
        # Every sample computed (a KL term: none is skipped for a zero advantage), so each step's
        # on-policy logprob check has tokens to compare, also when a step's groups all tie.
        trainer={"kl_coef": 1e-3},
    ))
    summary = await run(cfg, show_progress=False, log=lambda *_: None)
    run_dir = Path(summary["run_dir"])
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["version"] for r in rows] == list(range(1, 7))
    for r in rows:
        assert all(k in r for k in REQUIRED)
        # Built-in correctness check: engine logprobs == trainer logprobs on on-policy tokens.
        assert r["logprob_mismatch"] is not None and r["logprob_mismatch"] < 1e-4
        assert r["staleness_max"] == 0 and r["partial_resumed"] == 0 and r["tokens_discarded"] == 0
    assert rows[-1]["samples"] == 6 * 2 * 4
    assert (run_dir / "config.yaml").is_file()
    model = AutoModelForCausalLM.from_pretrained(summary["final_model"])
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    moved = sum((a - b).abs().sum().item() for a, b in zip(model.parameters(), start.parameters(), strict=True))
    assert moved > 0  # the weights were trained
    groups = read_groups(run_dir)
    assert len(groups) == 12 and all(len(g.samples) == 4 for g in groups)
    for g in groups:
        for s in g.samples:
            assert len(s.response_ids) == len(s.logprobs) == len(s.versions) == len(s.loss_mask)
            assert s.reward == len(s.response_text)


async def test_async_run_resumes_partials_across_versions(tmp_path: Path, tiny_model_dir: Path) -> None:
    """η = 2 with long responses and few engine rows: weight updates interrupt samples, which continue
    with the new weights; a checkpoint taken between steps holds the interrupted samples."""
    cfg = config_from_dict(small_cfg(
        tmp_path, tiny_model_dir, controller={"max_staleness": 2},
        rollout={"group_size": 4, "max_new_tokens": 40},
        schedule={"steps": 8, "batch_groups": 2, "save_every": 2},
        engines={"max_running_requests": 2},
    ))
    summary = await run(cfg, show_progress=False, log=lambda *_: None)
    # The same budget as a sync run: no group started that the 8 steps would never train.
    assert summary["groups_admitted"] == summary["groups_generated"] == 8 * 2
    run_dir = Path(cfg.run_dir)
    rows = read_metrics(run_dir)
    parked = []
    for step in (2, 4, 6, 8):
        ckpt = run_dir / "checkpoints" / f"step-{step}"
        state = json.loads((ckpt / "state.json").read_text())
        assert state["step"] == step and state["version"] == step
        assert AutoModelForCausalLM.from_pretrained(ckpt) is not None
        generating = msgspec.msgpack.decode((ckpt / "generating.msgpack").read_bytes(), type=list[Group])
        partial = [s for g in generating for s in g.samples if s.status == "partial"]
        assert len(partial) == state["partials"] and len(generating) == state["generating_groups"]
        for s in partial:
            assert s.num_resumes >= 1
            assert len(s.response_ids) == len(s.logprobs) == len(s.versions) and s.versions == sorted(s.versions)
            assert all(v < step for v in s.versions)  # produced before this checkpoint's update
            parked.append(s)
    assert any(s.num_tokens for s in parked)  # updates landed mid-sample, and the checkpoints kept the tokens
    assert sum(r["partial_resumed"] for r in rows) > 0
    assert sum(r["tokens_discarded"] for r in rows) == 0
    assert max(r["staleness_max"] for r in rows) <= 2
    versions_seen = set()
    for step, g in enumerate(read_groups(run_dir)):
        for s in g.samples:
            assert len(s.response_ids) == len(s.logprobs) == len(s.versions)
            assert s.versions == sorted(s.versions)  # a sample only moves forward in versions
            versions_seen.update(s.versions)
            trained_at = step // 2  # 2 groups per batch; trainer version when this batch was trained
            assert trained_at - min(s.versions) <= 2
    assert any(len(set(s.versions)) > 1 for g in read_groups(run_dir) for s in g.samples)


async def test_colocated_run_yields_engine_memory_around_every_step(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`engines.colocate`: while the trainer computes a step the engine holds no KV cache (its memory is
    its weights alone), samples it was generating come back partial and resume with 0 tokens lost,
    and every step still trains a whole batch within η."""
    cfg = config_from_dict(small_cfg(
        tmp_path, tiny_model_dir, controller={"max_staleness": 1},
        rollout={"group_size": 4, "max_new_tokens": 30}, schedule={"steps": 6, "batch_groups": 2},
        engines={"colocate": True, "max_running_requests": 4},
    ))
    summary = await run(cfg, show_progress=False, log=lambda *_: None)
    rows = read_metrics(Path(cfg.run_dir))
    assert [r["version"] for r in rows] == list(range(1, 7)) and summary["samples"] == 6 * 2 * 4
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    weights = sum(t.numel() * t.element_size() for t in [*ref.parameters(), *ref.buffers()])
    for r in rows:
        assert r["engine_bytes_during_step"] == weights  # the KV cache was freed while the trainer computed
        assert r["engine_release_s"] >= 0 and r["engine_restore_s"] >= 0
    assert sum(r["tokens_discarded"] for r in rows) == 0 and max(r["staleness_max"] for r in rows) <= 1
    assert sum(r["partial_resumed"] for r in rows) > 0  # the releases interrupted samples, which went on


async def test_colocate_needs_the_local_pool_and_a_push_every_step() -> None:
    with pytest.raises(ConfigError, match="engines.colocate: colocated engines run in this process"):
        config_from_dict({"engines": {"colocate": True, "pool": "http"}})
    with pytest.raises(ConfigError, match="schedule.push_every: colocated engines take the weights after every step"):
        config_from_dict({"engines": {"colocate": True}, "controller": {"max_staleness": 2},
                          "schedule": {"push_every": 2}})


async def test_async_run_over_http_resumes_group_batches(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The same through a `streamrl serve` process, where a group travels as one batched request: the
    pause returns every member's partial output, and only the interrupted members go again."""
    cfg = config_from_dict(small_cfg(
        tmp_path, tiny_model_dir, controller={"max_staleness": 2},
        rollout={"group_size": 4, "max_new_tokens": 40}, schedule={"steps": 6, "batch_groups": 2},
        engines={"pool": "http", "max_running_requests": 4},
    ))
    summary = await run(cfg, show_progress=False, log=lambda *_: None)
    assert summary["groups_admitted"] == summary["groups_generated"] == 6 * 2
    run_dir = Path(cfg.run_dir)
    rows = read_metrics(run_dir)
    assert sum(r["partial_resumed"] for r in rows) > 0 and sum(r["tokens_discarded"] for r in rows) == 0
    assert max(r["staleness_max"] for r in rows) <= 2
    groups = read_groups(run_dir)
    assert len(groups) == 12 and all(len(g.samples) == 4 for g in groups)
    for g in groups:
        assert sorted(s.index for s in g.samples) == [0, 1, 2, 3]
        for s in g.samples:
            assert len(s.response_ids) == len(s.logprobs) == len(s.versions) and s.versions == sorted(s.versions)
            assert s.finish_reason in ("stop", "length")
    assert any(len(set(s.versions)) > 1 for g in groups for s in g.samples)


@pytest.mark.parametrize(("partial", "pool"), [("retract", "local"), ("in_place", "http")])
async def test_samples_kept_in_the_engines_across_updates(tmp_path: Path, tiny_model_dir: Path, partial: str,
                                                          pool: str) -> None:
    """`rollout.partial` retract / in_place: a weight update pauses the engines without ending their
    requests, so no sample comes back partial; a sample that lived through updates comes back once,
    its tokens labelled with the versions that produced them, every trained one within η."""
    cfg = config_from_dict(small_cfg(
        tmp_path, tiny_model_dir, controller={"max_staleness": 2},
        rollout={"group_size": 4, "max_new_tokens": 40, "partial": partial},
        schedule={"steps": 6, "batch_groups": 2}, engines={"pool": pool, "max_running_requests": 2},
    ))
    summary = await run(cfg, show_progress=False, log=lambda *_: None)
    assert summary["groups_admitted"] == summary["groups_generated"] == 6 * 2
    rows = read_metrics(Path(cfg.run_dir))
    groups = read_groups(Path(cfg.run_dir))
    crossed = [s for g in groups for s in g.samples if len(set(s.versions)) > 1]
    assert crossed  # updates landed mid-sample
    assert sum(r["partial_resumed"] for r in rows) >= len(crossed)
    assert sum(r["tokens_discarded"] for r in rows) == 0 and max(r["staleness_max"] for r in rows) <= 2
    for step, g in enumerate(groups):
        for s in g.samples:
            assert s.num_resumes == 0 and s.finish_reason in ("stop", "length")  # never came back partial
            assert len(s.response_ids) == len(s.logprobs) == len(s.versions) and s.versions == sorted(s.versions)
            assert step // 2 - min(s.versions) <= 2


async def test_weights_pushed_every_n_steps(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`trainer.push_every: 2`: the engines get the weights after steps 2, 4, 6 and the last one only,
    so every trained token comes from an even version, each still within η of its step."""
    cfg = config_from_dict(small_cfg(
        tmp_path, tiny_model_dir, controller={"max_staleness": 2},
        rollout={"group_size": 4, "max_new_tokens": 40},
        schedule={"steps": 7, "batch_groups": 2, "push_every": 2}, engines={"max_running_requests": 2},
    ))
    summary = await run(cfg, show_progress=False, log=lambda *_: None)
    assert summary["groups_admitted"] == summary["groups_generated"] == 7 * 2
    rows = read_metrics(Path(cfg.run_dir))
    assert [r["step"] for r in rows if r["weight_sync_s"] > 0] == [2, 4, 6, 7]
    assert sum(r["tokens_discarded"] for r in rows) == 0 and max(r["staleness_max"] for r in rows) <= 2
    versions = set()
    for step, g in enumerate(read_groups(Path(cfg.run_dir))):
        for s in g.samples:
            versions.update(s.versions)
            assert step // 2 - min(s.versions) <= 2
    assert versions <= {0, 2, 4, 6} and len(versions) > 1


async def test_ppo_minibatches_take_several_steps_and_push_one_version(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`trainer.ppo_minibatches: 2` in a real run: one new version per batch; the pi_prox the trainer
    records before its steps is the engines' policy (the on-policy logprob check holds on it), and
    the ratio to it moves enough in the second step for the clip to bind."""
    cfg = config_from_dict(small_cfg(
        tmp_path, tiny_model_dir, controller={"max_staleness": 1},
        data={"reward": f"{REPO / 'tests' / 'rewards_for_tests.py'}:length_reward"},
        trainer={"lr": 3e-2, "ppo_minibatches": 2, "loss": "decoupled_ppo"}, schedule={"steps": 4, "batch_groups": 2},
    ))
    await run(cfg, show_progress=False, log=lambda *_: None)
    rows = read_metrics(Path(cfg.run_dir))
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    checked = [r["logprob_mismatch"] for r in rows if r["logprob_mismatch"] is not None]
    assert checked and max(checked) < 1e-4
    assert max(r["clip_frac"] for r in rows) > 0


async def test_discard_mode_counts_discarded_tokens(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = config_from_dict(small_cfg(
        tmp_path, tiny_model_dir, controller={"max_staleness": 2},
        rollout={"group_size": 4, "max_new_tokens": 40, "partial": "discard"},
        schedule={"steps": 6, "batch_groups": 2}, engines={"max_running_requests": 2},
    ))
    await run(cfg, show_progress=False, log=lambda *_: None)
    rows = read_metrics(Path(cfg.run_dir))
    assert sum(r["tokens_discarded"] for r in rows) > 0
    for g in read_groups(Path(cfg.run_dir)):
        for s in g.samples:
            assert len(set(s.versions)) <= 1  # restarted from scratch: one version per sample


@pytest.mark.slow
async def test_a_failed_weight_push_stops_the_run_with_its_error(tmp_path: Path, tiny_model_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The push runs beside the next step's parts: when it fails (here the pool's update to version 3
    raises, as for an engine lost mid-update), the run stops with that error, and the metrics hold
    the steps whose weights reached the engines."""
    import asyncio

    import streamrl.assemble as assemble_mod

    real = assemble_mod.build_pool

    def failing_pool(cfg, model_dir, **kw):  # noqa: ANN001, ANN003, ANN202 - a thin wrapper of the real builder
        pool = real(cfg, model_dir, **kw)
        load = pool.weight_sync.load

        async def failing_load(weights, version):  # noqa: ANN001, ANN202
            if version == 3:
                raise RuntimeError("engine lost during the update to version 3")
            await load(weights, version)

        pool.weight_sync.load = failing_load
        return pool

    monkeypatch.setattr(assemble_mod, "build_pool", failing_pool)
    # Sync: the next batch is only admitted once the push is done, so without the push's error the
    # trainer would wait for it forever.
    cfg = config_from_dict(small_cfg(tmp_path, tiny_model_dir, controller={"max_staleness": 0}))
    with pytest.raises(RuntimeError, match="update to version 3"):
        await asyncio.wait_for(run(cfg, show_progress=False, log=lambda *_: None), 120)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_quickstart_reward_rises_via_cli(tmp_path: Path) -> None:
    """The README's run command, shortened: warm start (cached per recipe) then GRPO; reward must rise."""
    run_dir = tmp_path / "qs"
    p = run_quickstart_cli(run_dir, "schedule.steps=300", cwd=tmp_path, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = read_metrics(run_dir)
    first = sum(r["reward_mean"] for r in rows[:50]) / 50
    last = sum(r["reward_mean"] for r in rows[-50:]) / 50
    assert last > first + 0.15, (first, last)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_after"]["sampled"] > summary["eval_before"]["sampled"] + 0.1
    assert "held-out accuracy (sampled)" in p.stdout


async def test_custom_dataset_and_async_reward(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"q": f"{a}+1=", "a": str(a + 1)}) + "\n" for a in range(10, 60)))
    (tmp_path / "my_reward.py").write_text(
        "import asyncio\n"
        "async def score(response_text, answer):\n"
        "    await asyncio.sleep(0)\n"
        "    return len(response_text) / 10 + (answer == '11') * 0\n"
    )
    cfg = config_from_dict(small_cfg(
        tmp_path, tiny_model_dir, schedule={"steps": 2},
        data={"task": None, "path": str(data), "prompt_key": "q", "answer_key": "a", "eval_size": 5,
              "reward": f"{tmp_path / 'my_reward.py'}:score"},
    ))
    await run(cfg, show_progress=False, log=lambda *_: None)
    groups = read_groups(Path(cfg.run_dir))
    assert groups and all(g.samples[0].prompt_text.endswith("+1=") for g in groups)
    for g in groups:
        for s in g.samples:
            assert s.reward == pytest.approx(len(s.response_text) / 10)


async def test_http_pool_launches_servers_behind_the_real_router(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Engines in their own `streamrl serve` processes behind sglang-router; on-policy logprobs still
    match the trainer's after a JSON round trip, and weight updates reach both servers."""
    cfg = config_from_dict(small_cfg(
        tmp_path, tiny_model_dir, controller={"max_staleness": 0}, schedule={"steps": 4},
        engines={"pool": "http", "num_replicas": 2, "router": "launch", "max_running_requests": 16},
        data={"reward": f"{REPO / 'tests' / 'rewards_for_tests.py'}:length_reward"},
    ))
    summary = await run(cfg, show_progress=False, log=lambda *_: None)
    rows = read_metrics(Path(cfg.run_dir))
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    assert all(r["logprob_mismatch"] is not None and r["logprob_mismatch"] < 1e-4 for r in rows)
    logs = Path(cfg.run_dir) / "logs"
    assert {p.name for p in logs.iterdir()} >= {"engine-0.log", "engine-1.log", "router.log"}
    for i in range(2):  # both workers served generation and loaded every new version
        text = (logs / f"engine-{i}.log").read_text()
        assert "listening on http://127.0.0.1:" in text
    assert summary["eval_after"]["greedy"] >= 0.0
    assert not _live_routers()  # the router runs as a grandchild; stopping the run must reach it


def _live_routers() -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"sglang::router" in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


async def test_http_pool_gloo_weight_sync(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Weights broadcast over gloo (`/update_weights_from_distributed`) instead of a disk folder."""
    cfg = config_from_dict(small_cfg(
        tmp_path, tiny_model_dir, controller={"max_staleness": 0}, schedule={"steps": 3},
        engines={"pool": "http", "num_replicas": 2, "weight_sync": "distributed", "max_running_requests": 16},
        data={"reward": f"{REPO / 'tests' / 'rewards_for_tests.py'}:length_reward"},
    ))
    await run(cfg, show_progress=False, log=lambda *_: None)
    rows = read_metrics(Path(cfg.run_dir))
    assert [r["version"] for r in rows] == [1, 2, 3]
    # Had a server missed an update, its logprobs would differ from the trainer's new weights.
    assert all(r["logprob_mismatch"] is not None and r["logprob_mismatch"] < 1e-4 for r in rows)
