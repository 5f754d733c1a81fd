"""The judge service (streamrl/judge): its parse rules and config errors, the client against a real
TorchEngine, a judgment in flight across a policy weight update, and runs whose rewards come from a
judge on its own engines, through the console script."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
from pathlib import Path

import msgspec
import pytest
import torch
from helpers import REPO, STREAMRL, processes_mentioning

from streamrl.config import ConfigError, DataConfig, JudgeConfig, load_config
from streamrl.engine import TorchEngine
from streamrl.engine.vllm import find_vllm_python
from streamrl.judge import Judge, JudgeError, load_parser, number, yes_no
from streamrl.rollout import LocalPool, build_pool
from streamrl.tasks import addition, addition_judge, load_task
from streamrl.types import Group

REWARDS = REPO / "tests" / "rewards_for_tests.py"
JUDGE_YAML = REPO / "configs" / "judge.yaml"


# ---- parse rules -------------------------------------------------------------------------------
def test_yes_no_reads_the_last_word_and_refuses_text_without_one() -> None:
    assert yes_no("85 y", []) == 1.0 and yes_no("The sum is 85. Yes", []) == 1.0
    assert yes_no("n", []) == 0.0 and yes_no("yes... on reflection, INCORRECT.", []) == 0.0
    for text in ("", "85", "maybe"):
        with pytest.raises(ValueError, match="no yes/no verdict"):
            yes_no(text, [])


def test_number_reads_the_last_number() -> None:
    assert number("reasoning 3 steps; score: 7.5", []) == 7.5 and number("-2", []) == -2.0
    with pytest.raises(ValueError, match="no number"):
        number("none here", [])


def test_a_parse_function_loads_from_a_file() -> None:
    fn = load_parser(f"{REWARDS}:judge_text_length")
    assert fn("abc", [-0.1]) == 3.0
    assert load_parser("yes_no") is yes_no


# ---- config errors: one line naming the key, before any work --------------------------------------
@pytest.mark.parametrize(("sets", "key"), [
    (["data.reward=judge"], "data.reward"),
    (["data.eval_reward=judge"], "data.eval_reward"),
    (["judge.enabled=true", "judge.prompt_template={nope}"], "judge.prompt_template"),
    (["judge.enabled=true", "judge.prompt_template=no fields"], "judge.prompt_template"),
    (["judge.enabled=true", "judge.parse=not a parser"], "judge.parse"),
    (["judge.enabled=true", "judge.engines.colocate=true"], "judge.engines.colocate"),
    (["judge.enabled=true", "judge.warm_start.enabled=true", "judge.model.init=tiny"], "judge.model.init"),
    (["judge.enabled=true", "judge.warm_start.enabled=true", "data.task=multiply"], "judge.warm_start.enabled"),
    (["judge.enabled=true", "judge.engines.pool=ray_serve"], "judge.engines.pool"),
    (["judge.enabled=true", "controller.deterministic=true"], "controller.deterministic"),
    (["judge.enabled=true", "judge.top_k=0"], "judge.top_k"),
    (["judge.enabled=true", "judge.engines.pool=http", "judge.engines.weight_sync=distributed"],
     "judge.engines.weight_sync"),
])
def test_judge_config_errors_name_the_key(sets: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, sets)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"config error: {key}"), msg


def test_a_reward_that_takes_a_judge_needs_one() -> None:
    with pytest.raises(ConfigError) as info:
        load_task(DataConfig(task="addition", reward=f"{REWARDS}:rule_and_judge"))
    assert str(info.value).startswith("config error: data.reward") and "judge.enabled" in str(info.value)
    assert load_task(DataConfig(task="addition", reward=f"{REWARDS}:rule_and_judge"), judge=True).needs_judge


def test_the_judged_quickstart_config_checks_through_the_console_script() -> None:
    p = subprocess.run([*STREAMRL, "config", str(JUDGE_YAML)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert 'data.reward: str | null = "judge"' in p.stdout and 'data.eval_reward: str | null = "task"' in p.stdout
    assert 'judge.prompt_template: str = "{prompt}{response};{answer}>"' in p.stdout


# ---- the judge's training examples -----------------------------------------------------------------
def test_judge_labels_are_the_exact_match_of_the_response() -> None:
    rng = random.Random(0)
    pairs = list(addition.split_pairs(0).train)
    seen = set()
    for prompt, text in addition_judge.examples(pairs, 500, rng):
        a, rest = prompt.split("+", 1)
        b, rest = rest.split("=", 1)
        response, answer = rest[:-1].rsplit(";", 1)
        assert answer == str(int(a) + int(b)) and prompt.endswith(">")
        assert text == ("y" if addition.reward(response, answer) == 1.0 else "n")
        seen.add(text)
    assert seen == {"y", "n"}


def test_judge_warm_start_trains_and_reports_agreement(tmp_path: Path, agent_model_dir: Path) -> None:
    m = addition_judge.warm_start(agent_model_dir, tmp_path / "judge", steps=30, batch_size=32, eval_examples=200)
    assert m["loss_last"] < m["loss_first"]
    assert 0.0 <= m["held_out_agreement"] <= 1.0 and m["held_out_examples"] == 200
    assert m["held_out_false_yes"] + m["held_out_false_no"] <= 1.0 - m["held_out_agreement"] + 1e-9
    assert (tmp_path / "judge" / "config.json").is_file()
    assert json.loads((tmp_path / "judge" / "warm_start.json").read_text())["steps"] == 30


def test_a_judge_parse_function_that_does_not_load_stops_before_any_work(tmp_path: Path) -> None:
    p = _cli(tmp_path, "run", f"judge.parse={REWARDS}:no_such_function")
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: judge.parse: ") and "no_such_function" in last and "Traceback" not in p.stderr
    assert not (tmp_path / "policy").exists() and not (tmp_path / "judge").exists()  # no model built, no warm start


class _LostPool:
    """A judge pool whose every server is gone (what HttpPool raises once none comes back)."""

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, ids: list[int], params: dict, rid: str) -> dict:
        from streamrl.rollout.replicas import EnginesLost

        self.calls += 1
        raise EnginesLost("every engine server is lost")


async def test_a_judge_pool_with_no_server_left_stops_the_run_at_once() -> None:
    from streamrl.rollout import RolloutFailed

    judge = Judge(JudgeConfig(enabled=True, retries=2), _LostPool(), tokenizer=None)
    judge.encode = lambda text: [1, 2, 3]  # type: ignore[method-assign]  # no tokenizer: the pool never answers
    with pytest.raises(RolloutFailed, match="^judge: every engine server is lost$"):
        await judge.ask("anything")
    assert judge.pool.calls == 1 and judge.counters.retries == 0  # not retried: nothing is left to answer


# ---- the client against a real engine --------------------------------------------------------------
def _judge(model: Path, tmp_path: Path, **kw: object) -> Judge:
    from transformers import AutoTokenizer

    cfg = JudgeConfig(**{"enabled": True, "prompt_template": "{prompt}{response};{answer}>", "max_new_tokens": 4, **kw})
    return Judge(cfg, build_pool(cfg.engines, str(model), run_dir=tmp_path), AutoTokenizer.from_pretrained(model))


RECORD = {"prompt": "37+48=", "answer": "85"}


async def test_a_judgment_goes_through_the_judge_engine_and_is_recorded(tmp_path: Path, agent_model_dir: Path) -> None:
    log: list[dict] = []
    async with _judge(agent_model_dir, tmp_path, parse=f"{REWARDS}:judge_text_length") as judge:
        assert judge.prompt("85", RECORD) == "37+48=85;85>"
        v = await judge.recording(log).judge("85", RECORD)
        s = judge.summary()
    assert v.score == len(v.text) and v.tries == 1 and 1 <= len(v.logprobs) <= 4
    assert log == [{"score": v.score, "text": v.text, "s": round(v.seconds, 4)}]
    assert s["calls"] == 1 and s["failures"] == 0 and s["tokens"] == len(v.logprobs)
    assert s["prompt_tokens"] == len(judge.encode("37+48=85;85>")) and s["weight_versions"] == ["0"]


async def test_an_unparsable_judge_retries_then_fails_in_one_line(tmp_path: Path, agent_model_dir: Path) -> None:
    log: list[dict] = []
    async with _judge(agent_model_dir, tmp_path, parse=f"{REWARDS}:judge_unparsable", retries=2) as judge:
        with pytest.raises(JudgeError) as info:
            await judge.recording(log).judge("85", RECORD)
        c = judge.counters
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("judge: ValueError: no verdict in ") and msg.endswith("(3 tries)")
    assert (c.calls, c.failures, c.retries) == (1, 1, 2)
    assert log == [{"error": msg.removeprefix("judge: ").removesuffix(" (3 tries)")}]


async def test_a_judge_that_does_not_answer_in_time_fails_and_leaves_nothing_running(
    tmp_path: Path, agent_model_dir: Path,
) -> None:
    async with _judge(agent_model_dir, tmp_path, parse=f"{REWARDS}:judge_text_length", timeout_s=1e-6, retries=1) as judge:
        with pytest.raises(JudgeError, match=r"^judge: no answer within judge.timeout_s = 1e-06 s \(2 tries\)$"):
            await judge.judge("85", RECORD)
        engine = judge.pool.engines[0]
        for _ in range(200):  # the timed-out requests are aborted in the engine, not left to run
            if engine.stats()["running"] == engine.stats()["waiting"] == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats()["running"] == engine.stats()["waiting"] == 0
        judge.cfg = msgspec.structs.replace(judge.cfg, timeout_s=30.0)
        v = await asyncio.wait_for(judge.ask("1+2=3;3>"), 30)  # and the judge still answers
    assert judge.counters.failures == 1 and v.tries == 1


async def test_a_judgment_in_flight_runs_through_a_policy_weight_update(
    tmp_path: Path, agent_model_dir: Path, engine_model_dir: Path,
) -> None:
    """The policy's pool pauses with abort, takes new weights and resumes while a judgment runs: the
    judgment finishes at its first try with the judge's weights, unaborted."""
    policy = LocalPool([TorchEngine(str(engine_model_dir), device="cpu", weight_version="0")])
    await policy.start()
    try:
        async with _judge(agent_model_dir, tmp_path, parse=f"{REWARDS}:judge_text_length", max_new_tokens=40) as judge:
            asked = asyncio.create_task(judge.ask("12+34=46;46>"))
            engine = judge.pool.engines[0]
            while engine.stats()["running"] == 0:
                await asyncio.sleep(0)
            await policy.pause("abort")
            await policy.weight_sync.load({}, 1)
            await policy.resume()
            v = await asyncio.wait_for(asked, 60)
            assert engine.stats()["weight_version"] == "0" and not engine.stats()["paused"]
        assert policy.engines[0].stats()["weight_version"] == "1"
    finally:
        await policy.aclose()
    assert v.tries == 1 and judge.counters.aborted == 0 and judge.summary()["weight_versions"] == ["0"]


# ---- runs through the console script ----------------------------------------------------------------
def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _cli_args(tmp_path: Path, cmd: str, *sets: str, groups: int = 0) -> list[str]:
    """`configs/judge.yaml` on fresh random tiny models (no warm starts), small."""
    args = [*STREAMRL, cmd, str(JUDGE_YAML), "--no-progress", *(["--groups", str(groups)] if groups else [])]
    for s in (f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'policy'}", "warm_start.enabled=false",
              f"judge.model.path={tmp_path / 'judge'}", "judge.warm_start.enabled=false", "data.eval_size=16",
              "judge.min_agreement=null",
              "rollout.group_size=4", "schedule.batch_groups=2", *sets):
        args += ["--set", s]
    return args


def _cli(tmp_path: Path, cmd: str, *sets: str, groups: int = 0) -> subprocess.CompletedProcess:
    return subprocess.run(_cli_args(tmp_path, cmd, *sets, groups=groups), capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)


def test_a_judged_run_trains_on_the_judges_scores_and_never_updates_the_judge(tmp_path: Path) -> None:
    p = _cli(tmp_path, "run", "schedule.steps=3", f"judge.parse={REWARDS}:judge_text_length", "save_samples=true")
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "run"
    rows = _rows(run)
    assert [r["version"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["judge_s"] > 0 and r["judge_failures"] == 0 and r["judge_calls"] >= 0
    assert sum(r["judge_calls"] for r in rows) >= rows[-1]["samples"] - 8  # all but the last step's
    summary = json.loads((run / "summary.json").read_text())
    j = summary["judge"]
    # Three weight pushes reached the policy; none reached the judge, and none of its requests was aborted.
    assert j["weight_versions"] == ["0"] and j["aborted"] == 0 and j["failures"] == 0
    assert j["calls"] >= rows[-1]["samples"] and j["calls_per_s"] > 0 and j["tokens_per_s"] > 0
    assert j["devices"] == ["cpu"] and j["memory_bytes"] > j["kv_cache_bytes"] > 0  # its weights and KV cache
    for k in ("greedy", "sampled"):  # held-out: exact match, and the judge's agreement with it
        assert 0.0 <= summary["eval_after"][f"agreement_{k}"] <= 1.0
    dec = msgspec.json.Decoder(Group)
    samples = [s for line in (run / "samples.jsonl").read_bytes().splitlines() for s in dec.decode(line).samples]
    assert samples
    for s in samples:  # the reward is the judge's score of that sample, recorded on it
        [verdict] = s.meta["judge"]
        assert s.reward == verdict["score"] == len(verdict["text"])
    assert "judge: " in p.stdout and "judgments/s" in p.stdout


def test_a_judge_warm_started_below_min_agreement_stops_the_run_before_the_trainer(tmp_path: Path) -> None:
    """judge.min_agreement against the judge's warm start (a few steps: it has learned nothing yet)."""
    p = _cli(tmp_path, "run", "judge.warm_start.enabled=true", "judge.warm_start.steps=3",
             f"judge.warm_start.cache_dir={tmp_path / 'cache'}", "judge.min_agreement=0.95")
    assert p.returncode == 1, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the judge agrees with exact match on ") and "Traceback" not in p.stderr
    assert "of its warm start's held-out examples, below judge.min_agreement (95%)" in last
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "judge").exists()


def test_a_judge_below_min_agreement_on_the_held_out_responses_stops_before_rl(tmp_path: Path) -> None:
    """A judge given as it is (no warm start) that says yes to everything: the held-out evaluation before
    RL shows how often it agrees with exact match, and RL never starts on it."""
    p = _cli(tmp_path, "run", f"judge.parse={REWARDS}:judge_always_yes", "judge.min_agreement=0.9")
    assert p.returncode == 1, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the judge agrees with exact match on ") and "held-out responses before RL" in last
    assert not (tmp_path / "run" / "metrics.jsonl").read_text()  # not one step


def test_a_judge_failure_fails_its_group_and_the_rollouts_go_on(tmp_path: Path) -> None:
    p = _cli(tmp_path, "rollout", f"judge.parse={REWARDS}:judge_fails_every_tenth", "judge.retries=0", groups=12)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((tmp_path / "run" / "rollout_summary.json").read_text())
    assert s["groups"] == 12 and s["failed_groups"] >= 1 and s["judge"]["failures"] == s["failed_groups"]
    assert s["last_error"] == "JudgeError: judge: ValueError: the judge's tenth answer (1 try)"
    assert "the last failure" in p.stdout and "the judge's verdicts" in p.stdout


def test_a_judge_failure_is_retried(tmp_path: Path) -> None:
    p = _cli(tmp_path, "rollout", f"judge.parse={REWARDS}:judge_fails_every_tenth", "judge.retries=1", groups=6)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((tmp_path / "run" / "rollout_summary.json").read_text())
    assert s["failed_groups"] == 0 and s["judge"]["retries"] >= 2 and s["judge"]["failures"] == 0


def test_a_judge_that_never_parses_stops_the_run_with_the_reason(tmp_path: Path) -> None:
    p = _cli(tmp_path, "rollout", f"judge.parse={REWARDS}:judge_unparsable", "judge.retries=0", groups=4)
    assert p.returncode == 1, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "groups in a row failed" in last, last
    assert "JudgeError: judge: ValueError: no verdict in " in last and "Traceback" not in p.stderr


def _judge_pool_rollout(tmp_path: Path, *sets: str) -> dict:
    p = _cli(tmp_path, "rollout", f"judge.parse={REWARDS}:judge_text_length", "judge.engines.pool=http", *sets,
             groups=3)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((tmp_path / "run" / "rollout_summary.json").read_text())
    assert s["groups"] == 3 and s["failed_groups"] == 0
    assert s["judge"]["calls"] == 12 and s["judge"]["failures"] == 0 and s["judge"]["tokens"] >= 12
    for e in s["judged_examples"]:
        assert e["reward"] == e["judge"]["score"] == len(e["judge"]["text"])
    return s


def test_a_judge_on_a_launched_streamrl_serve_server(tmp_path: Path) -> None:
    """judge.engines.pool: http: the judge's own `streamrl serve` process, logging under run/judge/logs,
    gone when the command ends."""
    _judge_pool_rollout(tmp_path)
    logs = list((tmp_path / "run" / "judge").rglob("*.log"))
    assert logs, list((tmp_path / "run").rglob("*"))
    assert not processes_mentioning(str(tmp_path / "judge").encode())


PYTHON_VLLM = find_vllm_python()


@pytest.mark.skipif(PYTHON_VLLM is None, reason="vLLM is not installed here: run bash scripts/setup_vllm.sh")
def test_a_judge_on_a_real_vllm_server(tmp_path: Path) -> None:
    _judge_pool_rollout(tmp_path, "judge.engines.backend=vllm")
    assert not processes_mentioning(str(tmp_path / "judge").encode())


def test_a_judged_run_resumes_from_a_checkpoint_that_holds_nothing_of_the_judge(tmp_path: Path) -> None:
    sets = (f"judge.parse={REWARDS}:judge_text_length", "schedule.save_every=1")
    p = _cli(tmp_path, "run", *sets, "schedule.steps=2")
    assert p.returncode == 0, p.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoints" / "step-2"
    # The policy's weights and the run's state: no judge key, the judge's verdicts only inside queued samples.
    assert not [k for k in json.loads((ckpt / "state.json").read_text()) if "judge" in k]
    assert json.loads((ckpt / "config.json").read_text())["vocab_size"] < json.loads(
        (tmp_path / "judge" / "config.json").read_text())["vocab_size"]  # the tiny policy's, not the judge's
    p = subprocess.run(
        [*_cli_args(tmp_path, "run", *sets, "schedule.steps=4"), "--resume", str(ckpt)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["resumed_from"] and s["judge"]["calls"] > 0 and s["judge"]["weight_versions"] == ["0"]
    rows = _rows(tmp_path / "run")
    assert [r["version"] for r in rows][-2:] == [3, 4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the judge's engine beside the policy's on one")
def test_a_judge_colocated_on_the_policys_gpu_keeps_its_memory_share(tmp_path: Path) -> None:
    """Policy engine, trainer and judge engine on one GPU, the policy's engines colocated with the
    trainer (they free their KV cache around every step): the judge's engine holds its own share, the
    KV cache of judge.engines.max_total_tokens, through every step, and no release, push or abort
    reaches it."""
    tokens = 4096
    p = _cli(tmp_path, "run", "schedule.steps=4", f"judge.parse={REWARDS}:judge_text_length",
             "engines.device=cuda", "engines.dtype=bfloat16", "trainer.device=cuda", "engines.colocate=true",
             "judge.engines.device=cuda", "judge.engines.dtype=bfloat16", f"judge.engines.max_total_tokens={tokens}")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _rows(tmp_path / "run")
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    for r in rows:  # the policy's engines gave their KV cache up for each step; the judge went on judging
        assert r["engine_bytes_during_step"] > 0 and r["engine_release_s"] > 0 and r["judge_failures"] == 0
    j = json.loads((tmp_path / "run" / "summary.json").read_text())["judge"]
    assert j["devices"] == ["cuda"] and j["weight_versions"] == ["0"] and j["aborted"] == 0 and j["failures"] == 0
    m = json.loads((tmp_path / "judge" / "config.json").read_text())
    head_dim = m.get("head_dim") or m["hidden_size"] // m["num_attention_heads"]
    per_token = 2 * m["num_hidden_layers"] * m["num_key_value_heads"] * head_dim * 2  # K and V, bf16
    from streamrl.engine.gpu.runner import PAGE

    assert tokens * per_token <= j["kv_cache_bytes"] < (tokens + PAGE) * per_token  # its share: whole pages
    assert j["memory_bytes"] > j["kv_cache_bytes"]  # and its weights
