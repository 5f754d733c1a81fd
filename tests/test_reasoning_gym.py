"""reasoning-gym tasks as data and reward (`data.source: reasoning_gym`): seeded records, a held-out set
disjoint from training, the reward as the package's own `score_answer`, config errors in one line, per-task
metrics, the warm start's cache key, and the learning run of configs/reasoning_gym.yaml."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, STREAMRL

from streamrl.config import ConfigError, load_config
from streamrl.plot import read_metrics
from streamrl.tasks import build_tiny_model, load_task
from streamrl.tasks.gym_tasks import check_vocabulary, extract_answer, gym_data, render_answer
from streamrl.tasks.gym_warm import _answer_choices, _guess
from streamrl.tasks.tiny_model import TEXT_TOKENS, TOKENS
from streamrl.tasks.warm import warm_start_key

rg = pytest.importorskip("reasoning_gym")

CONFIG = REPO / "configs" / "reasoning_gym.yaml"
CACHE = REPO / ".cache" / "streamrl"
ARITH = {"name": "basic_arithmetic", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                                                 "operators": ["+", "-"], "allow_parentheses": False}}
CHAIN = {"name": "chain_sum", "weight": 2.0, "config": {"min_terms": 2, "max_terms": 3, "max_digits": 2}}


def data_cfg(*sets: str, tasks: list[dict[str, Any]] | None = None) -> Any:
    items = ["data.source=reasoning_gym", f"data.tasks={json.dumps(tasks or [ARITH, CHAIN])}", "data.train_size=600",
             "data.eval_size=60", *sets]
    return load_config(None, items, check_paths=False)


def test_records_are_seeded_and_mixed_by_weight() -> None:
    cfg = data_cfg()
    a, b, other = gym_data(cfg.data, seed=0), gym_data(cfg.data, seed=0), gym_data(cfg.data, seed=1)
    assert a.train == b.train and a.held_out == b.held_out and a.digest == b.digest
    assert a.train != other.train and a.held_out != other.held_out and a.digest != other.digest
    sources = [r["data_source"] for r in a.train]
    assert sources.count("chain_sum") > 1.6 * sources.count("basic_arithmetic") > 0  # weight 2 : 1
    assert [r["data_source"] for r in a.held_out].count("chain_sum") == 40
    r = a.train[0]
    assert set(r) == {"prompt", "answer", "metadata", "data_source"} and r["prompt"].startswith("Calculate ")
    json.dumps(a.train + a.held_out)  # metadata travels in samples.jsonl and checkpoints


def test_held_out_questions_are_distinct_and_never_trained_on() -> None:
    # one-digit questions: a small space, so the generator repeats itself and only the dedupe keeps them apart
    small = {"name": "basic_arithmetic", "config": {**ARITH["config"], "max_digits": 1}}
    for tasks in ([ARITH, CHAIN], [small]):
        d = gym_data(data_cfg(tasks=tasks).data, seed=3)
        held = [(r["data_source"], r["prompt"]) for r in d.held_out]
        assert len(held) == len(set(held)) == 60
        assert not set(held) & {(r["data_source"], r["prompt"]) for r in d.train}
        assert d.train


def test_the_reward_is_the_datasets_own_score_of_the_extracted_answer() -> None:
    task = load_task(data_cfg().data, seed=0)
    scorers = {"basic_arithmetic": rg.create_dataset("basic_arithmetic", **ARITH["config"]),
               "chain_sum": rg.create_dataset("chain_sum", **CHAIN["config"])}
    seen = set()
    for r in task.train[:40] + task.held_out[:20]:
        entry = {"question": r["prompt"], "answer": r["answer"], "metadata": r["metadata"]}
        for response in (r["answer"], f" {r['answer']} ", f"{r['answer']}0", "", "seven", f"+0{r['answer']}.00"):
            want = scorers[r["data_source"]].score_answer(answer=response.strip(), entry=entry)
            assert task.score(response, r) == want
            seen.add(want)
    assert {0.0, 1.0} < seen  # chain_sum's scorer forgives a sign and leading zeros, basic_arithmetic's gives part credit
    assert task.score_eval("nonsense", task.held_out[0]) == 0.0


def test_answer_formats() -> None:
    text = "I think <answer>3</answer> no, <answer> 42 </answer> done"
    assert extract_answer(text, "<answer>") == rg.utils.extract_answer(text, tag_name="answer") == "42"
    assert extract_answer("no tag here", "<answer>") is None
    assert extract_answer("  42\n", "raw") == "42"
    assert extract_answer("a: 1, a: 17", r"a: (\d+)") == "17" and extract_answer("x 5 y 6", r"\d") == "6"
    assert render_answer("42", "<answer>") == "<answer>42</answer>" and render_answer("42", "raw") == "42"
    with pytest.raises(ConfigError, match="data.answer_format"):
        render_answer("42", r"answer: (\d+)")  # the teacher writes bare answers, which this regex cannot read
    d = load_task(data_cfg("data.answer_format=<answer>").data, seed=0)
    r = d.held_out[0]
    assert d.score(f"so <answer>{r['answer']}</answer>", r) == 1.0 and d.score(r["answer"], r) == 0.0


@pytest.mark.parametrize(("tasks", "sets", "key", "words"), [
    ([{"name": "basic_arithmetc"}], [], "data.tasks[0].name", ["basic_arithmetic"]),
    ([ARITH, {"name": "gdc"}], [], "data.tasks[1].name", ["gcd"]),
    ([{"name": "chain_sum", "config": {"min_terms": 3, "max_terms": 2}}], [], "data.tasks[0].config",
     ["max_terms must be >= min_terms"]),
    ([{"name": "chain_sum", "config": {"max_term": 2}}], [], "data.tasks[0].config", ["max_term", "max_terms"]),
])
def test_bad_tasks_are_one_line_config_errors(tasks: list[dict[str, Any]], sets: list[str], key: str,
                                              words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_task(data_cfg(*sets, tasks=tasks).data, seed=0)
    msg = str(err.value)
    assert msg.startswith(f"config error: {key}: ") and "\n" not in msg
    assert all(w in msg for w in words), msg


@pytest.mark.parametrize(("sets", "key"), [
    (["data.source=reasoning_gym", "data.tasks=[]"], "data.tasks"),
    (["data.tasks=[{name: gcd}]"], "data.tasks"),  # tasks without the source
    (["data.source=reasoning_gym", "data.tasks=[{name: gcd, config: {seed: 3}}]"], "data.tasks[0].config"),
    (["data.source=reasoning_gym", "data.tasks=[{name: gcd, weight: 0}]"], "data.tasks[0].weight"),
    (["data.source=reasoning_gym", "data.tasks=[{name: gcd, wieght: 1}]"], "data.tasks[0]"),
    (["data.source=reasoning_gym", "data.tasks=[{name: gcd}]", "data.answer_format=(unclosed"], "data.answer_format"),
    (["data.source=reasoning_gym", "data.tasks=[{name: gcd}]", "data.task=null", "data.path=x.jsonl"], "data.path"),
])
def test_config_rules(sets: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, sets, check_paths=False)
    assert str(err.value).startswith(f"config error: {key}") and "\n" not in str(err.value)


def test_a_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if never installed
    with pytest.raises(ConfigError, match=r"^config error: data\.source: .*pip install 'streamrl\[envs\]'"):
        load_task(data_cfg().data, seed=0)


def test_the_cli_stops_on_a_bad_task_before_any_work(tmp_path: Path) -> None:
    p = subprocess.run([*STREAMRL, "run", str(CONFIG), "--set", f"run_dir={tmp_path / 'run'}",
                        "--set", "data.tasks=[{name: leg_count}]"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("config error: data.tasks[0].name: unknown reasoning-gym task "
                                                       "'leg_count' (did you mean leg_counting")
    assert not (tmp_path / "run").exists() or not (tmp_path / "run" / "metrics.jsonl").exists()


def test_questions_need_a_model_with_their_characters(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    task = load_task(data_cfg().data, seed=0)
    plain = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "plain"))
    with pytest.raises(ConfigError, match=r"^config error: model\.init: .*tiny_text"):
        check_vocabulary(task.train, plain)
    text = build_tiny_model(tmp_path / "text", text=True)
    check_vocabulary(task.train + task.held_out, AutoTokenizer.from_pretrained(text))


def test_the_text_model_adds_rows_and_keeps_the_plain_ones(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plain, text = build_tiny_model(tmp_path / "p"), build_tiny_model(tmp_path / "t", text=True)
    tok = AutoTokenizer.from_pretrained(text)
    for i, t in enumerate(TEXT_TOKENS[4:], start=4):  # every character is its own token, the plain ids unchanged
        assert tok(t, add_special_tokens=False)["input_ids"] == [i]
    a, b = AutoModelForCausalLM.from_pretrained(plain), AutoModelForCausalLM.from_pretrained(text)
    assert b.config.max_position_embeddings == 128 and b.config.vocab_size == len(TEXT_TOKENS)
    ea, eb = a.get_input_embeddings().weight, b.get_input_embeddings().weight
    assert torch.equal(ea, eb[: len(TOKENS)])


def test_the_warm_start_is_cached_by_what_changes_it(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "m", text=True)

    def key(*sets: str, seed: int = 0) -> str:
        task = load_task(data_cfg(*sets).data, seed=seed)
        return warm_start_key(task.warm_start, model, steps=10, seed=seed)

    base = key()
    assert key() == base
    assert len({base, key(seed=1), key("data.train_size=500"), key("data.answer_format=<answer>"),
                key(f"data.tasks={json.dumps([ARITH])}")}) == 5
    records = [{"answer": a, "data_source": t} for a, t in (("-1", "a"), ("x", "b"), ("y", "b"), ("x", "b"))]
    answers, right, pools = _answer_choices(records)
    assert [answers[i] for i in right] == ["-1", "x", "y", "x"]
    assert [answers[i] for i in pools[1]] == ["x", "y", "x"] and pools[1] is pools[2]  # the task's answers, as often
    rng = random.Random(0)
    assert {answers[_guess(rng, pools[1], right[1])] for _ in range(20)} == {"y"}  # a guess is a wrong answer
    assert _guess(rng, pools[0], right[0]) == right[0]  # unless the task has no other


def test_a_short_run_writes_per_task_metrics(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    model = build_tiny_model(tmp_path / "m", text=True)
    sets = [f"run_dir={run_dir}", f"model.path={model}", "model.init=none", "warm_start.enabled=false",
            "schedule.steps=4", "schedule.eval_every=4", "schedule.batch_groups=4", "rollout.group_size=2",
            "data.train_size=200", "data.eval_size=12", "controller.max_staleness=0"]
    p = subprocess.run([*STREAMRL, "run", str(CONFIG), "--no-progress", *(x for s in sets for x in ("--set", s))],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = read_metrics(run_dir)
    tasks = {"basic_arithmetic", "simple_equations"}
    assert {k for r in rows for k in r if k.startswith("reward/")} == {f"reward/{t}" for t in tasks}
    assert all("reward_mean" in r for r in rows)  # the existing keys stay
    assert {f"eval/{t}/accuracy" for t in tasks} | {"eval_sampled"} <= set(rows[-1])
    summary = json.loads((run_dir / "summary.json").read_text())
    for when in ("eval_before", "eval_after"):
        assert {f"{k}/{t}" for k in ("greedy", "sampled") for t in tasks} <= set(summary[when])
        assert 0.0 <= summary[when]["sampled/simple_equations"] <= 1.0
    assert "basic_arithmetic (sampled)" in p.stdout


@pytest.mark.slow
def test_reasoning_gym_quickstart_learns_every_task_via_cli(tmp_path: Path) -> None:
    """`streamrl run configs/reasoning_gym.yaml` as docs/environments.md shows it: every task's held-out
    accuracy (sampled) rises by at least 0.3."""
    run_dir = tmp_path / "rg"
    p = subprocess.run([*STREAMRL, "run", str(CONFIG), "--no-progress", "--set", f"run_dir={run_dir}",
                        "--set", f"model.path={CACHE / 'tiny-text-model'}", "--set", f"warm_start.cache_dir={CACHE}"],
                       capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    tasks = [k.split("/", 1)[1] for k in after if k.startswith("sampled/")]
    assert sorted(tasks) == ["basic_arithmetic", "simple_equations"]
    for t in tasks:
        assert after[f"sampled/{t}"] >= before[f"sampled/{t}"] + 0.3, (t, before, after)
    rows = read_metrics(run_dir)
    assert all(f"eval/{t}/accuracy" in rows[-1] for t in tasks)
