"""The agentic quickstart as docs/agentic.md writes it, through the console script: `streamrl run
configs/agentic.yaml` learns to call the calculator, and `streamrl rollout configs/agentic.yaml`
writes multi-turn samples whose tool tokens are the calculator's real answers, masked out of the loss."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from helpers import REPO, STREAMRL
from transformers import AutoTokenizer

from streamrl.plot import read_metrics
from streamrl.rollout.tools import calculator
from streamrl.tasks import multiply
from streamrl.types import decode_groups

CACHE = REPO / ".cache" / "streamrl"


def _agentic(cmd: str, run_dir: Path, *extra: str, cwd: Path) -> subprocess.CompletedProcess:
    """The documented command, with the warm start cached in the checkout (shared with other runs)."""
    args = [*STREAMRL, cmd, str(REPO / "configs" / "agentic.yaml"), *extra, "--no-progress",
            "--set", f"run_dir={run_dir}", "--set", f"model.path={CACHE / 'tiny-agent-model'}",
            "--set", f"warm_start.cache_dir={CACHE}"]
    return subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=cwd)


def test_multiply_reward_reads_the_answer_after_the_last_observation() -> None:
    assert multiply.reward("<tool>123*45</tool><result>5535</result>5535<eos>", "5535") == 1.0
    assert multiply.reward("<tool>123*45</tool><result>5535</result>5536<eos>", "5535") == 0.0
    assert multiply.reward("5535<eos>junk", "5535") == 1.0  # no tool call: the whole answer
    assert multiply.reward("<result>5535</result>", "5535") == 0.0  # the observation is not an answer
    train, held = multiply.multiply_prompts("train", n=500), multiply.multiply_prompts("held_out", n=500)
    assert len(held) == 400 and not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert all(int(r["answer"]) == eval(r["prompt"][:-1]) for r in held)  # noqa: S307 - digits and '*'


def test_agentic_quickstart_learns_to_call_the_tool_via_cli(tmp_path: Path) -> None:
    run_dir = tmp_path / "agentic"
    p = _agentic("run", run_dir, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = read_metrics(run_dir)
    assert len(rows) == 150
    tenth = len(rows) // 10

    def mean(key: str, part: list[dict]) -> float:
        return sum(r[key] for r in part) / len(part)

    # the warm start calls the tool 40 % of the time, and is right about as often; RL makes the call
    # reliable, and the answer with it (the bar: <= 0.5 before RL, >= 0.9 in the last tenth)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_before"]["sampled"] <= 0.5 and summary["eval_after"]["sampled"] >= 0.9
    assert mean("reward_mean", rows[-tenth:]) >= 0.9
    assert mean("turns_mean", rows[-tenth:]) > mean("turns_mean", rows[:tenth]) + 0.1
    calls, errors = sum(r["tool_calls"] for r in rows), sum(r["tool_errors"] for r in rows)
    assert calls > 0 and errors < 0.05 * calls  # the learnt calls parse
    assert sum(r["tool_s"] for r in rows) > 0 and 0 < mean("masked_token_frac", rows) < 1
    assert "held-out accuracy (sampled)" in p.stdout


def test_agentic_rollout_records_real_tool_results_masked(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    p = _agentic("rollout", run_dir, "--groups", "8", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    groups = decode_groups((run_dir / "rollouts.jsonl").read_bytes())
    samples = [s for g in groups for s in g.samples]
    assert len(groups) == 8 and len(samples) == 64
    summary = json.loads((run_dir / "rollout_summary.json").read_text())
    tok = AutoTokenizer.from_pretrained(summary["model_dir"] if Path(summary["model_dir"]).is_absolute()
                                        else tmp_path / summary["model_dir"])
    calls = 0
    for s in samples:
        assert len(s.loss_mask) == len(s.response_ids) <= 32
        assert s.reward == multiply.reward(s.response_text, s.meta["answer"])
        assert [t.kind for t in s.turns][::2] == ["model"] * len(s.turns[::2])  # model, tool, model, ...
        for t in s.turns:
            span = s.loss_mask[t.start:t.end]
            if t.kind == "model":
                assert set(span) == {1}
                continue
            calls += 1
            assert set(span) == {0} and t.tool == "calculator" and t.error is None
            observed = tok.decode(s.response_ids[t.start:t.end], skip_special_tokens=False)
            assert observed == f"<result>{calculator(t.call or '')}</result>"  # what the model read next
    assert calls > 0 and summary["tool_calls"] == calls
    assert summary["turns_mean"] == sum(t.kind == "model" for s in samples for t in s.turns) / 64
    assert "tool calls: per sample / errors" in p.stdout
