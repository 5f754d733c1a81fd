"""Data files as verl (Parquet) and slime (JSONL) write them: dotted keys, chat prompts, the built-in
`data.reward: math`, wrong keys as one-line config errors, and short runs through `streamrl run`."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from helpers import STREAMRL

from streamrl.config import ConfigError, DataConfig
from streamrl.tasks import Task, load_prompts, load_task
from streamrl.tasks.math_reward import math_reward
from streamrl.types import Group

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


def verl_rows(n: int = 10) -> list[dict[str, Any]]:
    """Rows shaped as verl's gsm8k preprocessing writes them. The text keeps to the tiny agent
    model's vocabulary (lowercase letters, digits, `+`, space), so every character has its own token."""
    return [{
        "data_source": "openai/gsm8k" if a % 2 else "lighteval/math",
        "prompt": [{"role": "user", "content": f"what is {a}+{a}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
        "extra_info": {"split": "train", "index": a},
    } for a in range(10, 10 + n)]


def write_verl_parquet(path: Path, n: int = 10) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(verl_rows(n)), path)
    return path


def write_slime_jsonl(path: Path, n: int = 10, chat: bool = False) -> Path:
    """slime's layout (`--input-key prompt --label-key label`); a text prompt for the plain tiny model,
    whose tokenizer has no chat template."""
    rows = [{
        "prompt": [{"role": "user", "content": f"{a}+1="}] if chat else f"{a}+1=",
        "label": str(a + 1),
        "metadata": {"source": "toy"},
    } for a in range(10, 10 + n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def data_cfg(path: Path, **kw: Any) -> DataConfig:
    return msgspec.convert({"task": None, "path": str(path), **kw}, DataConfig)


# ---- loading ---------------------------------------------------------------------------------------

def test_verl_parquet_keeps_chat_prompts_nested_fields_and_data_source(tmp_path: Path) -> None:
    path = write_verl_parquet(tmp_path / "train.parquet")
    task = load_task(data_cfg(path, answer_key="reward_model.ground_truth", reward="math", eval_size=2))
    assert len(task.train) == 8 and len(task.held_out) == 2
    r = task.held_out[0]
    assert r["prompt"] == [{"role": "user", "content": "what is 10+10"}]  # a list stays a list of dicts
    assert r["answer"] == "20" and r["data_source"] == "lighteval/math"
    # Nested Parquet structs come back as dicts; nothing of the row is dropped.
    assert r["metadata"]["reward_model"] == {"style": "rule", "ground_truth": "20"}
    assert r["metadata"]["extra_info"] == {"split": "train", "index": 10}
    assert r["metadata"]["ability"] == "math"
    assert task.reward_fn is math_reward


def test_slime_jsonl_reads_label_and_metadata(tmp_path: Path) -> None:
    for chat in (False, True):
        path = write_slime_jsonl(tmp_path / f"slime_{chat}.jsonl", n=3, chat=chat)
        records = load_prompts(path, prompt_key="prompt", answer_key="label", require_answer=True)
        assert [r["answer"] for r in records] == ["11", "12", "13"]
        assert records[0]["prompt"] == ([{"role": "user", "content": "10+1="}] if chat else "10+1=")
        assert records[0]["metadata"] == {"metadata": {"source": "toy"}}
        assert "data_source" not in records[0]


def test_dotted_keys_walk_nested_objects_and_a_literal_dotted_field_wins(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    rows = [{"q": {"text": "1+1="}, "a": {"b": {"c": 2}}, "a.b": "literal"}, {"q": {"text": "2+2="}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_prompts(path, prompt_key="q.text", answer_key="a.b.c")
    assert [(r["prompt"], r["answer"]) for r in records] == [("1+1=", 2), ("2+2=", None)]
    assert load_prompts(path, prompt_key="q.text", answer_key="a.b")[0]["answer"] == "literal"


@pytest.mark.parametrize(
    ("kw", "key", "named"),
    [
        ({"answer_key": "reward_model.groundtruth"}, "data.answer_key", "'reward_model.groundtruth'"),
        ({"reward": "math"}, "data.answer_key", "did you mean 'reward_model.ground_truth'?"),
        ({"answer_key": "reward_model.ground_truth", "prompt_key": "prompt.text"}, "data.prompt_key", "'prompt.text'"),
        ({"answer_key": "reward_model.ground_truth", "prompt_key": "extra_info"}, "data.prompt_key",
         "expected text or a list of chat messages"),
    ],
)
def test_a_wrong_key_is_a_one_line_config_error_naming_it(tmp_path: Path, kw: dict, key: str, named: str) -> None:
    path = write_verl_parquet(tmp_path / "train.parquet", n=3)
    with pytest.raises(ConfigError) as e:
        load_task(data_cfg(path, **kw))
    assert e.value.key == key and str(e.value).startswith(f"config error: {key}: ")
    assert named in str(e.value) and "\n" not in str(e.value)


def test_an_unset_answer_key_missing_everywhere_is_no_error_without_the_math_reward(tmp_path: Path) -> None:
    # A prompt-only file with a reward that needs no answer loads as before.
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1="}\n')
    assert load_task(data_cfg(path, reward="streamrl.tasks.addition:reward")).train[0]["answer"] is None


# ---- the math reward ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("#### 72", "72", 1.0),
        ("so she sold 72 clips\n#### 72", GSM8K_SOLUTION, 1.0),  # GSM8K ground truth: the full solution
        ("#### 72", "#### 72", 1.0),
        ("#### $1,234.", "1234", 1.0),
        ("the answer is \\boxed{72}.", "72", 1.0),
        ("\\boxed{72}", GSM8K_SOLUTION, 1.0),
        ("$\\boxed{\\frac{1}{2}}$", "\\frac12", 1.0),
        ("0.5", "\\frac{1}{2}", 1.0),
        ("72", 72, 1.0),
        ("72", ["71", "72"], 1.0),
        ("\\boxed{B}", "B", 1.0),
        ("#### 71", GSM8K_SOLUTION, 0.0),
        ("\\boxed{71}", "72", 0.0),
        ("72 is what i thought, but #### 70", "72", 0.0),  # the final answer decides
        ("4242", "42", 0.0),
        ("", "72", 0.0),
        ("72", None, 0.0),
        ("72", "", 0.0),
        ("junk ))(( \\frac{ \\boxed{", "72", 0.0),
        ("\\boxed{\\frac{1}{0}} \\sqrt{-} ^^ __", "\\frac{1}{2}", 0.0),
        ("9" * 5000 + "+" * 5000, "72", 0.0),
    ],
)
def test_math_reward(response: str, answer: Any, expected: float) -> None:
    assert math_reward(response, answer) == expected


def test_math_reward_off_the_main_thread() -> None:
    # math-verify's timeout is signal.alarm, which only the main thread may set: elsewhere it must
    # still score, not raise.
    out: list[tuple[float, float]] = []
    t = threading.Thread(target=lambda: out.append((math_reward("\\boxed{72}", "72"), math_reward("((", "72"))))
    t.start()
    t.join()
    assert out == [(1.0, 0.0)]


# ---- data_source for a custom reward -----------------------------------------------------------------

def test_task_score_gives_a_reward_the_record_fields_it_names(tmp_path: Path) -> None:
    records = load_prompts(write_verl_parquet(tmp_path / "t.parquet", n=2), answer_key="reward_model.ground_truth")
    record = records[1]  # openai/gsm8k, answer "22"
    seen: dict[str, Any] = {}

    def plain(response: str, answer: str) -> float:
        return float(response == answer)

    def by_source(response: str, answer: str, *, data_source: str | None = None) -> float:
        seen["source"] = data_source
        return math_reward(response, answer) if data_source == "openai/gsm8k" else 0.0

    def with_metadata(response: str, answer: str, metadata: dict) -> float:
        seen["index"] = metadata["extra_info"]["index"]
        return 1.0

    def everything(response: str, answer: str, **kw: Any) -> float:
        seen["kw"] = sorted(kw)
        return 1.0

    def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
        seen["verl"] = (data_source, ground_truth, extra_info)
        return math_reward(solution_str, ground_truth)

    assert Task(records, [], plain).score("22", record) == 1.0
    assert Task(records, [], by_source).score("#### 22", record) == 1.0 and seen["source"] == "openai/gsm8k"
    assert Task(records, [], by_source).score("#### 20", records[0]) == 0.0 and seen["source"] == "lighteval/math"
    assert Task(records, [], with_metadata).score("x", record) == 1.0 and seen["index"] == 11
    assert Task(records, [], everything).score("x", record) == 1.0 and seen["kw"] == ["data_source", "metadata"]
    assert Task(records, [], compute_score).score("\\boxed{22}", record) == 1.0
    assert seen["verl"] == ("openai/gsm8k", "22", {"split": "train", "index": 11})
    # A sample's meta carries the answer alone: the reward still runs, with no data_source.
    assert Task(records, [], by_source).score("#### 22", {"answer": "22"}) == 0.0 and seen["source"] is None


# ---- through the console script ----------------------------------------------------------------------

def run_cli(tmp_path: Path, data: dict[str, Any], model_init: str, steps: int = 2) -> tuple[subprocess.CompletedProcess, Path]:
    """`streamrl run` on a fresh tiny model (built by `model.init`), no warm start, a few small steps."""
    run_dir = tmp_path / "run"
    cfg = {
        "run_dir": str(run_dir), "save_samples": True,
        "model": {"path": str(tmp_path / f"model-{model_init}"), "init": model_init},
        "warm_start": {"enabled": False},
        "data": {"task": None, "reward": "math", "eval_size": 2, **data},
        "engines": {"max_running_requests": 32},
        "rollout": {"group_size": 4, "max_new_tokens": 6},
        "trainer": {"lr": 1e-4},
        "schedule": {"steps": steps, "batch_groups": 2},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    p = subprocess.run([*STREAMRL, "run", str(tmp_path / "cfg.yaml"), "--no-progress"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    return p, run_dir


def test_a_wrong_answer_key_stops_streamrl_run_before_any_work(tmp_path: Path) -> None:
    path = write_verl_parquet(tmp_path / "train.parquet", n=3)
    p, run_dir = run_cli(tmp_path, {"path": str(path), "answer_key": "reward_model.truth"}, "tiny_agent")
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: data.answer_key: "), p.stderr
    assert "'reward_model.truth'" in lines[0] and "Traceback" not in p.stderr
    assert not run_dir.exists() and not (tmp_path / "model-tiny_agent").exists()  # stopped before any work


def test_chat_prompts_without_a_chat_template_are_a_one_line_config_error(tmp_path: Path) -> None:
    """A verl file (chat prompts) with the quickstart's plain tiny model, whose tokenizer has no chat
    template: one line naming data.prompt_key and the fixes, before the trainer or any engine starts."""
    path = write_verl_parquet(tmp_path / "train.parquet", n=3)
    p, run_dir = run_cli(tmp_path, {"path": str(path), "answer_key": "reward_model.ground_truth"}, "tiny")
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: data.prompt_key: the prompts are chat messages"), p.stderr
    assert "no chat template" in lines[0] and "tiny_agent" in lines[0] and "Traceback" not in p.stderr
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "logs").exists()


@pytest.mark.parametrize(
    ("layout", "model_init"),
    [
        ("verl_parquet", "tiny_agent"),  # chat prompts: the agent model's tokenizer has a chat template
        ("slime_jsonl", "tiny"),
    ],
)
def test_verl_and_slime_files_train_through_streamrl_run_with_the_math_reward(
    tmp_path: Path, layout: str, model_init: str
) -> None:
    if layout == "verl_parquet":
        data = {"path": str(write_verl_parquet(tmp_path / "train.parquet", n=12)),
                "prompt_key": "prompt", "answer_key": "reward_model.ground_truth"}
    else:
        data = {"path": str(write_slime_jsonl(tmp_path / "train.jsonl", n=12)),
                "prompt_key": "prompt", "answer_key": "label"}
    p, run_dir = run_cli(tmp_path, data, model_init)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    groups = [msgspec.json.decode(line, type=Group) for line in (run_dir / "samples.jsonl").read_bytes().splitlines()]
    samples = [s for g in groups for s in g.samples]
    assert samples
    for g in groups:
        if layout == "verl_parquet":
            # The chat was rendered by the template; the group keeps the whole record.
            assert g.samples[0].prompt_text.startswith("<|user|>what is ")
            assert g.meta["data_source"] in ("openai/gsm8k", "lighteval/math")
            assert g.meta["metadata"]["reward_model"]["ground_truth"] == g.meta["answer"]
        else:
            assert g.samples[0].prompt_text.endswith("+1=") and g.meta["metadata"] == {"metadata": {"source": "toy"}}
        for s in g.samples:
            # Scored by the math reward: its own verdict on the text, 0 or 1.
            assert s.reward in (0.0, 1.0)
            assert s.reward == math_reward(s.response_text, g.meta["answer"])


def test_a_custom_reward_gets_each_records_data_source_in_a_run(tmp_path: Path) -> None:
    seen = tmp_path / "seen.jsonl"
    (tmp_path / "by_source.py").write_text(
        "import json\n"
        "def score(response, answer, *, data_source=None):\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(json.dumps([data_source, answer]) + '\\n')\n"
        "    return 0.0\n"
    )
    path = write_verl_parquet(tmp_path / "train.parquet", n=12)
    p, _ = run_cli(tmp_path, {"path": str(path), "answer_key": "reward_model.ground_truth",
                              "reward": f"{tmp_path / 'by_source.py'}:score"}, "tiny_agent")
    assert p.returncode == 0, p.stderr[-3000:]
    calls = [tuple(json.loads(line)) for line in seen.read_text().splitlines()]
    # Training samples and held-out evaluation alike: each answer with its own row's data_source.
    expected = {(r["data_source"], r["reward_model"]["ground_truth"]) for r in verl_rows(12)}
    assert calls and set(calls) <= expected and {s for s, _ in calls} == {"openai/gsm8k", "lighteval/math"}
