"""Loading user tasks: prompt files (JSONL, Parquet) and reward functions named ``"module:function"``.

This module owns the on-disk prompt formats and the reward-function lookup. It returns plain records
``{"prompt", "answer", "metadata"}`` and plain callables; it knows nothing about tokenizers, engines,
or how a reward is awaited (a resolved callable may be sync or async: the caller checks).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError, DataConfig


def _normalise(rows: Iterable[dict[str, Any]], path: Path, prompt_key: str, answer_key: str) -> list[dict]:
    records: list[dict] = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: record {i} is a {type(row).__name__}, expected a JSON object")
        if prompt_key not in row:
            raise ValueError(f"{path}: record {i} has no {prompt_key!r} field (fields: {sorted(row)})")
        prompt = row[prompt_key]
        # A prompt is text or a chat transcript (a list of {"role", "content"} messages).
        if not isinstance(prompt, str | list):
            raise ValueError(f"{path}: record {i} field {prompt_key!r} is a {type(prompt).__name__}")
        metadata = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
        records.append({"prompt": prompt, "answer": row.get(answer_key), "metadata": metadata})
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


def load_prompts(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[dict]:
    """Read a prompt file into records ``{"prompt", "answer", "metadata"}``.

    ``.jsonl`` / ``.json`` (one object per line) and ``.parquet`` are read. ``answer`` is None when a
    row has no ``answer_key``; every other field goes to ``metadata`` so reward functions can use it.
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
    return _normalise(rows, p, prompt_key, answer_key)


def _import_module(module_name: str) -> Any:
    # "path/to/file.py:fn" loads a file directly, so a one-off reward needs no package.
    if module_name.endswith(".py"):
        file = Path(module_name)
        if not file.is_file():
            raise ValueError(f"reward module file {file} does not exist")
        spec = importlib.util.spec_from_file_location(f"_streamrl_reward_{file.stem}", file)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot load reward module file {file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only report "not found" when it is the named module (or a parent) that is missing; a missing
        # dependency *inside* the module is a different problem and must not be disguised as this one.
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"reward module {module_name!r} not found (is it on PYTHONPATH?)") from e
        raise ValueError(f"reward module {module_name!r} failed to import: {e}") from e


def load_callable(spec: str, what: str = "reward function") -> Callable[..., Any]:
    """Resolve ``"package.module:function"`` (or ``"module:Class.method"``, ``"file.py:function"``).

    Returns the callable as is, sync or async. Raises ValueError naming what is wrong (a malformed
    spec, a missing module, a missing attribute, or a value that is not callable), with `what` it
    was meant to be.
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"{what} spec {spec!r} must look like 'module:function'")
    obj: Any = _import_module(module_name)
    walked = module_name
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ValueError(f"{what} {spec!r}: {walked!r} has no attribute {attr!r}")
        obj = getattr(obj, attr)
        walked = f"{walked}:{attr}" if walked == module_name else f"{walked}.{attr}"
    if not callable(obj):
        raise ValueError(f"{what} {spec!r} is a {type(obj).__name__}, which is not callable")
    return obj


def load_reward_fn(spec: str) -> Callable[..., Any]:
    return load_callable(spec, "reward function")


def is_async_reward(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` returns an awaitable (async functions and objects with async ``__call__``)."""
    if inspect.iscoroutinefunction(fn):
        return True
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)


@dataclass
class Task:
    """What a run trains and evaluates on: prompt records and the reward that scores a response."""

    train: list[dict[str, Any]]
    held_out: list[dict[str, Any]]
    reward_fn: Callable[..., Any]


def load_task(cfg: DataConfig, *, seed: int = 0) -> Task:
    """The built-in task `data.task`, or the records of `data.path` (the first `eval_size` held out,
    at most a fifth), scored by `data.reward` or the task's own exact match. A file or reward that
    cannot be loaded is a ConfigError naming the key."""
    from . import addition

    reward: Callable[..., Any] = addition.reward
    if cfg.task == "addition":
        train = addition.addition_prompts("train", seed=seed)
        held = addition.addition_prompts("held_out", seed=seed)
    elif cfg.task == "multiply":
        from . import multiply

        train, held = multiply.multiply_prompts("train", seed=seed), multiply.multiply_prompts("held_out", seed=seed)
        reward = multiply.reward
    else:
        assert cfg.path is not None  # validate() guarantees exactly one of task / path
        try:
            records = load_prompts(cfg.path, cfg.prompt_key, cfg.answer_key)
        except (OSError, ValueError) as e:
            raise ConfigError("data.path", str(e)) from None
        n_eval = min(cfg.eval_size, len(records) // 5)
        train, held = records[n_eval:], records[:n_eval]
    if cfg.reward:
        try:
            reward = load_reward_fn(cfg.reward)
        except (ValueError, ImportError) as e:
            raise ConfigError("data.reward", str(e)) from None
    return Task(train=train, held_out=held[: cfg.eval_size], reward_fn=reward)
