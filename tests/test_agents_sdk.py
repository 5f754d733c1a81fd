"""The agents quickstart as docs/agentic.md writes it, through the console script: `streamrl run
configs/agents_sdk.yaml` trains an ordinary openai-agents Agent (examples/agents_sdk.py), run by the
SDK's own Runner against the capture endpoint, to call its calculator tool."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from helpers import REPO, STREAMRL

from streamrl.plot import read_metrics
from streamrl.tasks import agent_tools

CACHE = REPO / ".cache" / "streamrl"


def test_the_agent_reward_reads_its_last_answer() -> None:
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call><|end|>'
    result = "<|user|><tool_response>5535</tool_response><|end|><|assistant|>"
    assert agent_tools.reward(call + result + "5535<|end|>", "5535") == 1.0
    assert agent_tools.reward(call + result + "5536<|end|>", "5535") == 0.0
    assert agent_tools.reward("5535<|end|>", "5535") == 1.0  # answered at once
    assert agent_tools.reward(call, "5535") == 0.0  # a call is no answer
    assert agent_tools.reward(call + result + call, "5535") == 0.0


def test_agents_quickstart_learns_to_call_the_tool_via_cli(tmp_path: Path) -> None:
    run_dir = tmp_path / "agents"
    args = [*STREAMRL, "run", str(REPO / "configs" / "agents_sdk.yaml"), "--no-progress", "--set", f"run_dir={run_dir}",
            "--set", f"model.path={CACHE / 'tiny-tools-model'}", "--set", f"warm_start.cache_dir={CACHE}",
            "--set", f"rollout.workflow={REPO / 'examples' / 'agents_sdk.py'}:solve"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = read_metrics(run_dir)
    tenth = len(rows) // 10

    def mean(key: str, part: list[dict]) -> float:
        return sum(r[key] for r in part) / len(part)

    # It learns (0.24 -> ~0.8 measured), short of the bar of 0.9 (docs/agentic.md says why):
    # this asserts the learning it does, not the bar.
    summary = json.loads((run_dir / "summary.json").read_text())
    before, after = summary["eval_before"]["sampled"], summary["eval_after"]["sampled"]
    assert before <= 0.5 and after >= before + 0.35
    assert mean("reward_mean", rows[-tenth:]) >= before + 0.35
    # the tool-call rate rises: the SDK ran the calculator (episode.run_tool) on the model's parsed
    # calls in nearly every episode at the end; nothing was lost across weight updates
    assert mean("turns_mean", rows[-tenth:]) >= rows[0]["turns_mean"] + 0.3
    assert sum(r["tool_calls"] for r in rows[-tenth:]) >= 0.85 * 64 * tenth
    assert sum(r["tool_calls_parsed"] for r in rows) >= sum(r["tool_calls"] for r in rows) > 0
    assert sum(r["tokens_discarded"] for r in rows) == 0
