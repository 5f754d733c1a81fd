"""The addition task's split and reward, prompt-file loading, and reward-function lookup."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path

import pytest

from streamrl.tasks import (
    addition_prompts,
    is_async_reward,
    load_prompts,
    load_reward_fn,
    reward,
    split_pairs,
)


def test_split_is_disjoint_complete_and_deterministic() -> None:
    s = split_pairs(seed=0)
    train, held = set(s.train), set(s.held_out)
    assert not train & held
    assert len(train) + len(held) == 90 * 90
    assert len(held) == 810
    assert all(10 <= a <= 99 and 10 <= b <= 99 for a, b in train | held)
    assert split_pairs(seed=0) == s
    assert set(split_pairs(seed=1).held_out) != held
    assert len(split_pairs(seed=0, held_out_fraction=0.2).held_out) == 1620


def test_prompt_records() -> None:
    held = addition_prompts("held_out")
    train_prompts = {r["prompt"] for r in addition_prompts("train")}
    assert not train_prompts & {r["prompt"] for r in held}
    for r in held[:50]:
        a, b = r["prompt"].removesuffix("=").split("+")
        assert r["answer"] == str(int(a) + int(b))
    with pytest.raises(ValueError, match="split"):
        addition_prompts("test")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("85", 1.0),
        (" 85 \n", 1.0),
        ("85<eos>", 1.0),
        ("85<eos><pad><pad>", 1.0),
        ("85<eos>junk", 1.0),
        ("86", 0.0),
        ("085", 0.0),
        ("85+1", 0.0),
        ("8 5", 0.0),
        ("", 0.0),
        ("<eos>85", 0.0),
    ],
)
def test_reward(response: str, expected: float) -> None:
    assert reward(response, "85") == expected


def test_load_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    rows = [{"q": "1+1=", "a": "2", "level": 1}, {"q": "2+2="}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    records = load_prompts(path, prompt_key="q", answer_key="a")
    assert records == [
        {"prompt": "1+1=", "answer": "2", "metadata": {"level": 1}},
        {"prompt": "2+2=", "answer": None, "metadata": {}},
    ]


def test_load_jsonl_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_prompts(bad)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="no 'prompt' field"):
        load_prompts(missing)
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "nope.jsonl")
    csv = tmp_path / "p.csv"
    csv.write_text("prompt\n")
    with pytest.raises(ValueError, match="unknown prompt file type"):
        load_prompts(csv)


def test_parquet_prompts(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"q": ["1+1=", "2+3="], "a": ["2", "5"], "level": [1, 2]}), path)
    rows = load_prompts(path, prompt_key="q", answer_key="a")
    assert [(r["prompt"], r["answer"]) for r in rows] == [("1+1=", "2"), ("2+3=", "5")]
    assert rows[1]["metadata"] == {"level": 2}


def test_load_reward_fn_resolves_sync_and_async(tmp_path: Path) -> None:
    fn = load_reward_fn("streamrl.tasks.addition:reward")
    assert fn("85", "85") == 1.0
    assert not is_async_reward(fn)
    file = tmp_path / "my_reward.py"
    file.write_text(
        textwrap.dedent(
            """
            class Judge:
                @staticmethod
                async def score(response, answer):
                    return float(response == answer)
            """
        )
    )
    afn = load_reward_fn(f"{file}:Judge.score")
    assert is_async_reward(afn)
    assert asyncio.run(afn("1", "1")) == 1.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("streamrl.tasks.addition", "must look like 'module:function'"),
        (":reward", "must look like 'module:function'"),
        ("no_such_module_xyz:fn", "'no_such_module_xyz' not found"),
        ("streamrl.tasks.no_such_mod:fn", "not found"),
        ("streamrl.tasks.addition:no_such_fn", "has no attribute 'no_such_fn'"),
        ("streamrl.tasks.addition:LOW", "is a int, which is not callable"),
        ("/nonexistent/dir/r.py:fn", "does not exist"),
    ],
)
def test_load_reward_fn_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_reward_fn(spec)


def test_load_reward_fn_reports_broken_dependency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_reward_mod.py").write_text("import definitely_missing_dep_xyz\ndef fn(): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="failed to import.*definitely_missing_dep_xyz"):
        load_reward_fn("broken_reward_mod:fn")
