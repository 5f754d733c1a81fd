"""Loading user tasks: prompt files (JSONL, Parquet; verl's and slime's layouts through dotted keys)
and reward functions named ``"module:function"`` or the built-in ``"math"``.

This module owns the on-disk prompt formats and the reward-function lookup. It returns plain records
``{"prompt", "answer", "metadata"}`` and plain callables; it knows nothing about tokenizers, engines,
or how a reward is awaited (a resolved callable may be sync or async: the caller checks).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError, DataConfig
from ..plugins import PluginError, load_plugin
from .addition import reward as exact_match
from .builtin import BUILTIN_TASKS

_MISSING = object()
# Where verl and slime files keep the reference answer: named in the hint of a missing answer_key.
_ANSWER_FIELDS = ("reward_model.ground_truth", "label", "answer", "ground_truth", "solution")


class DataKeyError(ValueError):
    """A prompt file that lacks the field a `data.*_key` names; `key` is that config key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(message)


def lookup(row: Any, key: str) -> Any:
    """`row[key]`, where a dotted key walks nested objects (``reward_model.ground_truth``); a field
    whose own name has the dots wins. `_MISSING` when it is not there."""
    if not isinstance(row, dict):
        return _MISSING
    if key in row:
        return row[key]
    head, dot, rest = key.partition(".")
    return lookup(row.get(head, _MISSING), rest) if dot and head in row else _MISSING


def _fields(row: dict[str, Any], prefix: str = "") -> list[str]:
    """A record's field paths, nested objects spelled as dotted keys, for error messages."""
    out: list[str] = []
    for k, v in row.items():
        out += _fields(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return out


def _field_list(row: dict[str, Any]) -> str:
    fields = sorted(_fields(row))
    return ", ".join(fields[:20]) + (f", ... ({len(fields)} in all)" if len(fields) > 20 else "")


def _check_prompt(prompt: Any, path: Path, i: int, prompt_key: str) -> None:
    # A prompt is text or a chat transcript (a list of {"role", "content"} messages), which the
    # tokenizer's chat template renders; anything else would fail later inside that template.
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list):
        raise DataKeyError("data.prompt_key", f"{path}: record {i} field {prompt_key!r} is a {type(prompt).__name__}, "
                                              "expected text or a list of chat messages")
    for m in prompt:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataKeyError("data.prompt_key", f"{path}: record {i} field {prompt_key!r} is a list whose items are "
                                                  "not all chat messages {\"role\", \"content\"}")


def _normalise(rows: list[Any], path: Path, prompt_key: str, answer_key: str,
               require_answer: bool = False) -> list[dict]:
    records: list[dict] = []
    any_answer = False
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: record {i} is a {type(row).__name__}, expected a JSON object")
        prompt = lookup(row, prompt_key)
        if prompt is _MISSING:
            raise DataKeyError("data.prompt_key", f"{path}: record {i} has no {prompt_key!r} field "
                                                  f"(fields: {_field_list(row)})")
        _check_prompt(prompt, path, i, prompt_key)
        answer = lookup(row, answer_key)
        any_answer = any_answer or answer is not _MISSING
        # Every field stays (rewards and workflows read them); only the ones moved up are left out.
        metadata = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
        record = {"prompt": prompt, "answer": None if answer is _MISSING else answer, "metadata": metadata}
        if "data_source" in row:  # verl's name for a record's dataset: the key a mixed run's reward dispatches on
            record["data_source"] = row["data_source"]
        records.append(record)
    if require_answer and records and not any_answer:  # a key no record has is a wrong key, not sparse data
        hint = next((f"; did you mean {f!r}?" for f in _ANSWER_FIELDS if lookup(rows[0], f) is not _MISSING), "")
        raise DataKeyError("data.answer_key", f"no record of {path} has the field {answer_key!r} "
                                              f"(record 0 has: {_field_list(rows[0])}){hint}")
    return records


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError(
            f"{path}: reading Parquet needs pyarrow, which is not installed; "
            "install pyarrow or convert the file to JSONL"
        ) from e
    return pq.read_table(path).to_pylist()


def load_prompts(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer", *,
                 require_answer: bool = False) -> list[dict]:
    """Read a prompt file into records ``{"prompt", "answer", "metadata"}`` (and ``"data_source"``
    when the row has one, as verl's files do).

    ``.jsonl`` / ``.json`` (one object per line) and ``.parquet`` (nested columns as dicts) are read.
    A key may be dotted for a nested field (``reward_model.ground_truth``). ``answer`` is None when a
    row has no ``answer_key`` (a DataKeyError when no row has it and `require_answer`); every other
    field goes to ``metadata`` so reward functions can use it.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompt file {p} does not exist")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        rows = _read_jsonl(p)
    elif suffix == ".parquet":
        rows = _read_parquet(p)
    else:
        raise ValueError(f"{p}: unknown prompt file type {suffix!r}; expected .jsonl or .parquet")
    return _normalise(rows, p, prompt_key, answer_key, require_answer)


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """A reward function `module:function` / `file.py:function` (sync or async); PluginError otherwise."""
    return load_plugin(spec, "reward function")


async def judge_reward(response: str, answer: Any, *, record: Mapping[str, Any], judge: Any) -> float:
    """`data.reward: judge`: the judge's score of the response."""
    return await judge.score(response, record)


def is_async_reward(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` returns an awaitable (async functions and objects with async ``__call__``)."""
    if inspect.iscoroutinefunction(fn):
        return True
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)


@dataclass
class Task:
    """What a run trains and evaluates on: prompt records, the reward that scores a response, the
    held-out evaluation's reward (`eval_fn`; None = `reward_fn`), and a built-in task's warm starts."""

    train: list[dict[str, Any]]
    held_out: list[dict[str, Any]]
    reward_fn: Callable[..., Any]
    eval_fn: Callable[..., Any] | None = None
    warm_start: Callable[..., dict[str, Any]] | None = None  # the policy's (tasks.warm), a built-in task's
    judge_warm_start: Callable[..., dict[str, Any]] | None = None  # a judge that grades this task
    environment: Any = None  # rollout.environment's handle (rollout/verifiers_env.py): its workflow and process

    def __post_init__(self) -> None:
        self._extras = {id(f): _reward_extras(f) for f in (self.reward_fn, self.eval_fn) if f is not None}

    @property
    def needs_judge(self) -> bool:
        return any("judge" in e for e in self._extras.values())

    def score(self, response: str, record: Mapping[str, Any], judge: Any = None) -> Any:
        """`reward_fn` on a response to `record` (a prompt record, or a group's copy of one): as
        ``fn(response, answer)``, plus ``data_source=``, ``metadata=``, ``record=`` and ``judge=`` (the
        `judge` given here) for a function that names them, or verl's ``compute_score(data_source,
        solution_str, ground_truth, extra_info)``. Returns what the function returns (an awaitable for
        an async one)."""
        return self._call(self.reward_fn, response, record, judge)

    def score_eval(self, response: str, record: Mapping[str, Any], judge: Any = None) -> Any:
        """The held-out evaluation's reward (`eval_fn`, else `reward_fn`), called as `score` calls."""
        return self._call(self.eval_fn or self.reward_fn, response, record, judge)

    def _call(self, fn: Callable[..., Any], response: str, record: Mapping[str, Any], judge: Any) -> Any:
        answer, extras = record.get("answer", ""), self._extras[id(fn)]
        if not extras:
            return fn(response, answer)
        metadata = record.get("metadata") or {}
        data_source = record.get("data_source", metadata.get("data_source"))
        if "solution_str" in extras:
            return fn(data_source=data_source, solution_str=response, ground_truth=answer,
                      extra_info=metadata.get("extra_info"))
        given = {"data_source": data_source, "metadata": metadata, "record": record, "judge": judge}
        return fn(response, answer, **{k: v for k, v in given.items() if k in extras})


def _reward_extras(fn: Callable[..., Any]) -> frozenset[str]:
    """The record fields a reward function asks for by parameter name, beyond (response, answer)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: the plain two-argument call
        return frozenset()
    if "solution_str" in params and "ground_truth" in params:
        return frozenset({"solution_str"})
    named = frozenset(params) & {"data_source", "metadata", "record", "judge"}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return named | {"data_source", "metadata"}
    return named


def _reward(spec: str | None, default: Callable[..., Any], key: str) -> Callable[..., Any]:
    """The reward `spec` names (data.reward / data.eval_reward): `math`, `judge`, `module:function`;
    None or `task`: `default`, the task's own."""
    if spec in (None, "task"):
        return default
    if spec == "math":
        from .math_reward import math_reward

        return math_reward
    if spec == "judge":
        return judge_reward
    try:
        return load_reward_fn(spec)
    except PluginError as e:
        raise ConfigError(key, str(e)) from None


def load_task(cfg: DataConfig, *, seed: int = 0, judge: bool = False) -> Task:
    """The built-in task `data.task`, or the records of `data.path` (the first `eval_size` held out,
    at most a fifth), or those `data.tasks` generates (`data.source: reasoning_gym`, tasks/gym_tasks.py), scored by `data.reward` (`math`: the built-in math-verify check) or the task's
    own exact match (`data.eval_reward` likewise for the held-out evaluation). `judge`: whether a judge
    will be given to rewards that take one. A file, key or reward that cannot be loaded is a ConfigError
    naming its key."""
    builtin = load_plugin(cfg.task, "task", BUILTIN_TASKS) if cfg.task is not None and cfg.source == "default" else None
    reward: Callable[..., Any] = exact_match  # the task's own exact match, also for files ("task")
    gym_warm_start = None
    if cfg.source == "reasoning_gym":
        from .gym_tasks import gym_data
        from .gym_warm import make_recipe

        gym = gym_data(cfg, seed=seed)
        train, held, reward = gym.train, gym.held_out, gym.reward
        gym_warm_start = make_recipe(gym, cfg.answer_format)
    elif builtin is not None:
        train, held = builtin.prompts("train", seed=seed), builtin.prompts("held_out", seed=seed)[: cfg.eval_size]
        reward = builtin.reward
    else:
        assert cfg.path is not None  # validate() guarantees exactly one of task / path
        # A key the user set, or an answer the math reward needs, must exist: a typo would score 0 forever.
        need_answer = cfg.answer_key != "answer" or "math" in (cfg.reward, cfg.eval_reward)
        try:
            records = load_prompts(cfg.path, cfg.prompt_key, cfg.answer_key, require_answer=need_answer)
        except DataKeyError as e:
            raise ConfigError(e.key, str(e)) from None
        except (OSError, ValueError) as e:
            raise ConfigError("data.path", str(e)) from None
        n_eval = min(cfg.eval_size, len(records) // 5)
        train, held = records[n_eval:], records[:n_eval]
    train_fn = _reward(cfg.reward, reward, "data.reward")
    eval_fn = None if cfg.eval_reward is None else _reward(cfg.eval_reward, reward, "data.eval_reward")
    task = Task(train=train, held_out=held, reward_fn=train_fn, eval_fn=eval_fn,
                warm_start=builtin.warm_start if builtin else gym_warm_start,
                judge_warm_start=builtin.judge_warm_start if builtin else None)
    if task.needs_judge and not judge:
        key = "data.reward" if "judge" in task._extras[id(train_fn)] else "data.eval_reward"
        raise ConfigError(key, "the reward takes a `judge` argument: set judge.enabled: true (and judge.model.*)")
    return task
