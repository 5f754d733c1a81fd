"""`streamrl rollout`: rollouts and rewards with no trainer, through the real engines (in-process and
a real `streamrl serve` process), written as JSONL that reads back as `Group`s."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import STREAMRL, processes_mentioning

from streamrl.rollout_only import summarize
from streamrl.tasks import addition
from streamrl.types import Group, Sample, decode_groups


def _config(tmp_path: Path, pool: str) -> Path:
    cfg = tmp_path / "rollout.yaml"
    cfg.write_text(f"""
run_dir: {tmp_path / "run"}
model:
  path: {tmp_path / "model"}
  init: tiny
warm_start:
  enabled: false
data:
  task: addition
engines:
  pool: {pool}
rollout:
  group_size: 4
  max_new_tokens: 5
  temperature: 1.0
schedule:
  batch_groups: 2
""")
    return cfg


@pytest.mark.parametrize("pool", ["local", "http"])
def test_rollout_writes_scored_groups_and_a_summary(tmp_path: Path, pool: str) -> None:
    p = subprocess.run([*STREAMRL, "rollout", str(_config(tmp_path, pool)), "--groups", "5", "--no-progress"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    run = tmp_path / "run"
    groups = decode_groups((run / "rollouts.jsonl").read_bytes())
    assert len(groups) == 5 and len({g.group_id for g in groups}) == 5
    for g in groups:
        assert len(g.samples) == 4
        assert len({s.prompt_text for s in g.samples}) == 1  # one prompt per group
        for s in g.samples:
            assert 1 <= len(s.response_ids) <= 5
            assert len(s.logprobs) == len(s.versions) == len(s.loss_mask) == len(s.response_ids)
            assert all(lp <= 0 for lp in s.logprobs)
            assert s.versions == [0] * len(s.response_ids)  # nothing trained, no update
            # The score is the task's reward of the decoded response, not something made up here.
            assert s.reward == addition.reward(s.response_text, s.meta["answer"])
            assert s.status == ("completed" if s.finish_reason == "stop" else "truncated")
            assert s.status == "completed" or len(s.response_ids) == 5
    summary = json.loads((run / "rollout_summary.json").read_text())
    samples = [s for g in groups for s in g.samples]
    assert summary["samples"] == 20 and summary["tokens"] == sum(len(s.response_ids) for s in samples)
    assert summary["reward_mean"] == pytest.approx(sum(s.reward or 0 for s in samples) / 20)
    assert "streamrl rollout: 5 groups, 20 samples" in p.stdout
    assert not (run / "final").exists() and not (run / "metrics.jsonl").exists()  # no trainer ran
    assert not processes_mentioning(str(tmp_path / "model").encode())  # the engine server is gone


def test_rollout_defaults_to_one_batch_and_takes_out(tmp_path: Path) -> None:
    out = tmp_path / "elsewhere" / "r.jsonl"
    out.parent.mkdir()
    p = subprocess.run([*STREAMRL, "rollout", str(_config(tmp_path, "local")), "--out", str(out), "--no-progress",
                        "--set", "rollout.group_size=2"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    groups = decode_groups(out.read_bytes())
    assert len(groups) == 2 and all(len(g.samples) == 2 for g in groups)  # schedule.batch_groups groups


@pytest.mark.parametrize(("args", "needle"), [
    (["--groups", "0"], "--groups: must be at least 1"),
    (["--groups", "many"], "--groups: want a whole number"),
    (["--set", "rollout.group_size=0"], "rollout.group_size"),
])
def test_rollout_bad_input_is_a_clear_error(tmp_path: Path, args: list[str], needle: str) -> None:
    p = subprocess.run([*STREAMRL, "rollout", str(_config(tmp_path, "local")), "--no-progress", *args],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("cmd", "sets", "says"), [
    ("rollout", [], "5 groups in a row failed (0 finished before them)"),
    # `run` meets the broken reward first in its held-out evaluation, ...
    ("run", [], "held-out evaluation: the reward function raised"),
    # ... and without one (eval_size 0) in the rollouts, where it used to retry groups forever.
    ("run", ["data.eval_size=0"], "8 groups in a row failed (0 finished before them)"),
])
def test_every_group_failing_stops_with_the_reason(tmp_path: Path, cmd: str, sets: list[str], says: str) -> None:
    reward = Path(__file__).parent / "rewards_for_tests.py"
    args = ["--groups", "5"] if cmd == "rollout" else []
    for s in [f"data.reward={reward}:failing_reward", *sets]:
        args += ["--set", s]
    p = subprocess.run([*STREAMRL, cmd, str(_config(tmp_path, "local")), "--no-progress", *args],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 1, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and says in last, p.stderr
    assert "ValueError: the verifier is down" in last and "Traceback" not in p.stderr


@pytest.mark.parametrize("cmd", ["rollout", "run"])
def test_max_new_tokens_beyond_the_context_is_a_config_error(tmp_path: Path, cmd: str) -> None:
    """The tiny model's context is 64 tokens: before, every request failed inside the engine (a
    traceback from `run`'s first evaluation, a retry loop in `rollout`)."""
    p = subprocess.run([*STREAMRL, cmd, str(_config(tmp_path, "local")), "--no-progress",
                        "--set", "rollout.max_new_tokens=1000"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    last = p.stderr.strip().splitlines()[-1]  # the lines before it: transformers writing the tiny model
    assert last.startswith("config error: rollout.max_new_tokens: 1000 new tokens")
    assert "context of 64" in last and "at most 57" in last and "Traceback" not in p.stderr
    # Stopped before the engines and the trainer: neither output file was opened.
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "rollouts.jsonl").exists()


def _group(rewards: list[float], lengths: list[int]) -> Group:
    return Group(group_id="g", samples=[
        Sample(group_id="g", index=i, prompt_ids=[1], response_ids=[5] * n, logprobs=[-1.0] * n,
               versions=[0] * n, loss_mask=[1] * n, reward=r, finish_reason="stop")
        for i, (r, n) in enumerate(zip(rewards, lengths, strict=True))
    ])


def test_summarize_counts_signal_and_lengths() -> None:
    s = summarize([_group([1, 0], [2, 4]), _group([1, 1], [6, 8]), _group([0, 0], [10, 100])], wall_s=2.0)
    assert s["groups"] == 3 and s["samples"] == 6 and s["tokens"] == 130
    assert s["groups_with_signal"] == 1  # only the first group's rewards disagree
    assert s["reward_mean"] == pytest.approx(3 / 6)
    assert (s["length_p50"], s["length_p90"], s["length_max"]) == (8, 100, 100)
    assert s["tokens_per_s"] == pytest.approx(65.0) and s["finish_reasons"] == {"stop": 6}
