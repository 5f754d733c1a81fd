"""verifiers environments as streamrl rollouts (`rollout.environment: verifiers`), against the installed
`verifiers` package in its own environment (.venv-verifiers; scripts/setup_verifiers.sh). The environment
(tests/verifiers_envs_for_tests.py) is a taskset with an MCP tool and a reward, run by verifiers' own `null`
harness (its chat loop) in a local subprocess runtime: its rewards are the rewards, the model's turns are
the engine's tokens, what the environment wrote is masked, a weight update mid-turn loses no token.

A scripted pool (a mock model that "decides" to call the tool) where the model must write a tool call;
the real TorchEngine through `streamrl rollout` and `streamrl run`."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers import STREAMRL
from test_workflows import ScriptedPool, _until, manager_for, producing, update_weights_mid_turn
from transformers import AutoTokenizer

from streamrl.config import ConfigError, VerifiersConfig
from streamrl.engine import TorchEngine, build_result
from streamrl.engine.protocol import finish_reason
from streamrl.rollout import LocalPool
from streamrl.rollout.verifiers_env import VerifiersEnv, VerifiersWorkflow, find_verifiers_python
from streamrl.types import decode_groups

REPO = Path(__file__).parents[1]
PYTHON = find_verifiers_python()
pytestmark = pytest.mark.skipif(PYTHON is None, reason="verifiers is not installed: its own environment "
                                "(.venv-verifiers) is missing; run `bash scripts/setup_verifiers.sh`")
ENV_ARGS = {"taskset": {"num_tasks": 2}, "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}
CALL = '<tool_call>{"name": "calc_multiply", "arguments": {"a": 123, "b": 45}}</tool_call><|end|>'
ANSWER = "5535<|end|>"


@pytest.fixture(scope="module")
def tok(tools_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tools_model_dir)


@pytest.fixture
def tool_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "tool_calls.txt"
    monkeypatch.setenv("VF_TOOL_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests"))
    return log


def log_tail(tmp_path: Path) -> str:
    return (tmp_path / "verifiers.log").read_text()[-3000:]


def open_env(tmp_path: Path, **over: Any) -> VerifiersEnv:
    cfg = VerifiersConfig(env="verifiers_envs_for_tests", args=ENV_ARGS) if not over else VerifiersConfig(**over)
    return VerifiersEnv.open(cfg, tmp_path / "verifiers.log")


async def test_a_tool_using_environment_scores_its_episode_and_the_model_tokens_are_the_engines(
        tok: Any, tmp_path: Path, tool_log: Path) -> None:
    env = open_env(tmp_path)
    try:
        task = env.task(0)
        assert [r["vf_idx"] for r in task.train] == [0, 1]
        pool = ScriptedPool(tok, [CALL, ANSWER])
        manager, buffer, _ = manager_for(pool, tok, workflow="single_turn", tools=[], group_size=1, max_new_tokens=120)
        manager.task, manager.prompts = task, task.train[:1]
        manager.workflow, manager.multi_turn = VerifiersWorkflow(env), True
        async with producing(manager):
            try:
                [group] = await asyncio.wait_for(buffer.get_batch(1), 120)
            except TimeoutError:
                raise AssertionError(f"no group: {manager.counters} {log_tail(tmp_path)}") from None
    finally:
        env.close()
    [s] = group.samples
    assert s.reward == 1.0 and s.meta["env_rewards"] == {"correct": 1.0}  # the environment's reward
    assert tool_log.read_text() == "123*45\n"  # the environment's own tool server ran the call, once
    model = [t for t in s.turns if t.kind == "model"]
    # Each model turn is exactly the engine's tokens, and trainable; everything else is masked.
    assert [s.response_ids[t.start:t.end] for t in model] == [tok(CALL, add_special_tokens=False)["input_ids"],
                                                              tok(ANSWER, add_special_tokens=False)["input_ids"]]
    for t in s.turns:
        assert set(s.loss_mask[t.start:t.end]) <= ({1} if t.kind == "model" else {0})
    masked = tok.decode([i for i, m in zip(s.response_ids, s.loss_mask, strict=True) if m == 0])
    assert "5535" in masked and "tool_response" in masked  # the tool's result, as the environment wrote it
    assert manager.counters.prefix_mismatch == 0 and manager.counters.tool_calls_parsed == 1
    assert "123*45=" in tok.decode(s.prompt_ids)  # the environment's prompt, as its harness sent it


class _CallThenEngine(LocalPool):
    """The first request answered with the tool call (the tiny model cannot write one), every later one by
    the real engine, made to run to its token limit so a weight update can land in the middle of it."""

    def __init__(self, engine: TorchEngine, tok: Any) -> None:
        super().__init__([engine])
        self.tok, self.calls = tok, 0

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]:
        self.calls += 1
        if self.calls == 1:
            ids = self.tok(CALL, add_special_tokens=False)["input_ids"]
            return build_result(rid=rid, text=CALL, output_ids=ids, logprobs=[-0.5] * len(ids),
                                finish=finish_reason("stop"), prompt_tokens=len(input_ids), weight_version="0")
        return await super().generate(input_ids, {**sampling_params, "ignore_eos": True}, rid)

    async def generate_many(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]],
                            rids: list[str]) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*map(self.generate, input_ids, sampling_params, rids)))


async def test_a_turn_interrupted_by_a_weight_update_resumes_with_no_token_lost_and_no_tool_run_twice(
        tools_model_dir: Path, tok: Any, tmp_path: Path, tool_log: Path) -> None:
    engine = TorchEngine(str(tools_model_dir), device="cpu", max_running_requests=8, weight_version="0")
    pool = _CallThenEngine(engine, tok)
    env = open_env(tmp_path)
    manager, buffer, _ = manager_for(pool, tok, workflow="single_turn", tools=[], group_size=1, max_new_tokens=200)
    task = env.task(0)
    manager.task, manager.prompts = task, task.train[:1]
    manager.workflow, manager.multi_turn = VerifiersWorkflow(env), True
    await pool.start()
    try:
        async with producing(manager):
            try:  # the tool has run and the answer turn is in the engine, a few tokens in
                await _until(lambda: pool.calls == 2 and engine.stats()["running"] == 1, timeout=120)
                before = engine.stats()["generated_tokens"]
                await _until(lambda: engine.stats()["generated_tokens"] >= before + 3)
            except TimeoutError:
                raise AssertionError(f"no answer turn in the engine: {pool.calls} {engine.stats()} "
                                     f"{manager.counters} {log_tail(tmp_path)}") from None
            await update_weights_mid_turn(pool, engine, running=1)
            [group] = await asyncio.wait_for(buffer.get_batch(1), 120)
    finally:
        await pool.aclose()
        env.close()
    [s] = group.samples
    assert tool_log.read_text() == "123*45\n"  # the environment's tool ran once, before the interruption
    call, *_, answer = [t for t in s.turns if t.kind == "model"]
    assert s.response_ids[call.start:call.end] == tok(CALL, add_special_tokens=False)["input_ids"]
    v = s.versions[answer.start:answer.end]
    assert 0 in v and v[-1] == 1 and v == sorted(v)  # the same turn went on at the new version
    assert s.num_resumes == 1 and manager.counters.tokens_discarded == 0
    assert manager.counters.prefix_mismatch == 0
    assert len(s.logprobs) == len(s.versions) == len(s.loss_mask) == len(s.response_ids)


def test_an_environment_that_does_not_load_is_one_line_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        open_env(tmp_path, env="no_such_verifiers_env", args={})
    msg = str(e.value)
    assert msg.startswith("config error: rollout.verifiers.env: no_such_verifiers_env: the environment does not load")
    assert "\n" not in msg and "not found" in msg
    with pytest.raises(ConfigError, match="rollout.verifiers.python"):
        open_env(tmp_path, env="x", python=str(tmp_path / "nope"))


def _config(tmp_path: Path, steps: int = 1) -> Path:
    cfg = tmp_path / "vf.yaml"
    args = ENV_ARGS | {"taskset": {"num_tasks": 4}}
    cfg.write_text(f"""
run_dir: {tmp_path / "run"}
model: {{path: {tmp_path / "model"}, init: tiny_tools}}
warm_start: {{enabled: false}}
data: {{eval_size: 0}}
rollout:
  environment: verifiers
  verifiers: {{env: verifiers_envs_for_tests, args: {json.dumps(args)}}}
  group_size: 2
  max_new_tokens: 24
schedule: {{steps: {steps}, batch_groups: 2, eval_every: 0}}
""")
    return cfg


def test_streamrl_rollout_runs_the_environment_and_its_rewards_score_it(tmp_path: Path, tool_log: Path) -> None:
    p = subprocess.run([*STREAMRL, "rollout", str(_config(tmp_path)), "--groups", "2", "--no-progress"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    groups = decode_groups((tmp_path / "run" / "rollouts.jsonl").read_bytes())
    assert len(groups) == 2
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    for g in groups:
        for s in g.samples:
            assert s.reward == s.meta["env_reward"] == sum(s.meta["env_rewards"].values())
            assert "*" in tok.decode(s.prompt_ids)  # the environment's task, as its harness rendered it
            model = [t for t in s.turns if t.kind == "model"]
            assert model and all(set(s.loss_mask[t.start:t.end]) == {1} for t in model if t.end > t.start)
            assert all(set(s.loss_mask[t.start:t.end]) <= {0} for t in s.turns if t.kind != "model")
            assert len(s.logprobs) == len(s.versions) == len(s.loss_mask) == len(s.response_ids)


def test_streamrl_run_trains_on_the_environments_episodes(tmp_path: Path, tool_log: Path) -> None:
    p = subprocess.run([*STREAMRL, "run", str(_config(tmp_path, steps=2)), "--no-progress"],
                       capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["tokens_discarded"] == 0 for r in rows if "tokens_discarded" in r)
    assert all("turns_mean" in r for r in rows)  # the environment's turns are counted as a workflow's
    assert (tmp_path / "run" / "final").exists()
