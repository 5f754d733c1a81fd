"""reasoning-gym tasks as data and reward (`data.source: reasoning_gym`): the records of `data.tasks`, made by
the `reasoning-gym` package's generators and seeded from the run's seed, a held-out set disjoint from the
training records, and the reward: the record's own dataset's `score_answer` on the answer read from a
response (`data.answer_format`).

A record is `{"prompt": question, "answer", "metadata", "data_source": task label}`; the label (the task's
name, with its index where a name repeats) is what the metrics group rewards and evaluations by. The package
is imported only when a config asks for it. This module knows nothing of engines or training.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError, DataConfig

INSTALL = "pip install 'streamrl[envs]' (or pip install reasoning-gym)"
_TAG_RE = re.compile(r"<([A-Za-z_][\w.-]*)>")


def import_gym() -> Any:
    """The `reasoning_gym` package; a ConfigError that says how to install it where it is missing."""
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError("data.source", f"reasoning_gym needs the reasoning-gym package, which is not installed: "
                                         f"{INSTALL}") from None
    return reasoning_gym


# ---- reading an answer --------------------------------------------------------------------------------
def extract_answer(response: str, answer_format: str) -> str | None:
    """The answer in `response` as `data.answer_format` reads it (None where there is none): `raw`, the
    whole response stripped; a tag `<answer>`, the text of the last `<answer>...</answer>` (reasoning-gym's
    own convention); otherwise a regex, its last match (group 1 where it has groups), stripped."""
    if answer_format == "raw":
        return response.strip()
    tag = _TAG_RE.fullmatch(answer_format)
    if tag is not None:
        from reasoning_gym.utils import extract_answer as gym_extract

        return gym_extract(response, tag_name=tag.group(1))
    pattern = re.compile(answer_format)
    last = None
    for last in pattern.finditer(response):  # noqa: B007 - the last match is the answer
        pass
    if last is None:
        return None
    return (last.group(1) if pattern.groups else last.group(0)).strip()


def render_answer(answer: str, answer_format: str) -> str:
    """A response that states `answer` as `answer_format` reads it: what the warm start's teacher writes.
    A regex is given the bare answer, which it must read back (a ConfigError otherwise)."""
    tag = _TAG_RE.fullmatch(answer_format)
    if tag is not None:
        return f"<{tag.group(1)}>{answer}</{tag.group(1)}>"
    if answer_format != "raw" and extract_answer(answer, answer_format) != answer.strip():
        raise ConfigError("data.answer_format", f"the warm start writes the bare answer ('{answer}'), which this "
                                                "regex does not read back; use raw, a tag, or a regex that does")
    return answer


# ---- the records ------------------------------------------------------------------------------------------
def task_labels(names: Sequence[str]) -> list[str]:
    """Each task's label: its name, or `name_i` where several tasks share the name."""
    return [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]


def _shares(total: int, weights: Sequence[float]) -> list[int]:
    """`total` records split by weight, each task at least one where there are any."""
    s = sum(weights)
    return [max(1, round(total * w / s)) if total else 0 for w in weights]


def _unknown_setting(cls: Any, err: TypeError) -> str:
    names = [f.name for f in dataclasses.fields(cls) if f.name not in ("seed", "size")]
    bad = re.search(r"argument '(\w+)'", str(err))
    close = difflib.get_close_matches(bad.group(1), names, n=1) if bad else []
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"{err}{hint} (its settings: {', '.join(names)})"


def _dataset(gym: Any, key: str, name: str, settings: dict[str, Any], seed: int, size: int) -> Any:
    """`create_dataset(name, seed, size, **settings)`, its refusals as ConfigErrors under `key`."""
    known = sorted(gym.factory.DATASETS)
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else f"{len(known)} tasks, e.g. {', '.join(known[:4])}"
        raise ConfigError(f"{key}.name", f"unknown reasoning-gym task '{name}' ({hint})")
    try:
        return gym.create_dataset(name, seed=seed, size=size, **settings)
    except TypeError as e:  # an unknown setting, as the generator's config class words it
        raise ConfigError(f"{key}.config", f"{name}: {_unknown_setting(gym.factory.DATASETS[name][1], e)}") from None
    except (AssertionError, ValueError) as e:  # the config class's own validate()
        raise ConfigError(f"{key}.config", f"{name}: {e or 'rejected by its validate()'}") from None


def _entry(dataset: Any, key: str, name: str, idx: int) -> dict[str, Any]:
    try:
        return dataset[idx]
    except Exception as e:  # noqa: BLE001 - settings that validate() let through but the generator cannot use
        raise ConfigError(f"{key}.config", f"{name}: generating record {idx} failed: {type(e).__name__}: {e}") from None


def _json_safe(metadata: Any) -> dict[str, Any]:
    """The entry's metadata as JSON values, for samples.jsonl and checkpoints; the reward keeps the original."""
    out = json.loads(json.dumps(metadata, default=str))
    return out if isinstance(out, dict) else {"metadata": out}


@dataclass
class GymData:
    """`data.tasks`' records and the reward that scores them; `digest` covers every training record (the
    warm start's cache key)."""

    train: list[dict[str, Any]]
    held_out: list[dict[str, Any]]
    reward: Callable[..., float]
    labels: list[str]
    digest: str


def gym_data(cfg: DataConfig, *, seed: int) -> GymData:
    """Generate `cfg.tasks`' records: per task its share (by weight) of `eval_size` distinct held-out questions,
    then of `train_size` training records from the seeds after them, less any whose question is held out."""
    gym = import_gym()
    labels = task_labels([t.name for t in cfg.tasks])
    weights = [t.weight for t in cfg.tasks]
    n_train, n_held = _shares(cfg.train_size, weights), _shares(cfg.eval_size, weights)
    train: list[dict[str, Any]] = []
    held: list[dict[str, Any]] = []
    datasets: dict[str, Any] = {}
    entries: dict[tuple[str, str], dict[str, Any]] = {}
    for i, (spec, label) in enumerate(zip(cfg.tasks, labels, strict=True)):
        key = f"data.tasks[{i}]"
        # A generator draws entry idx from Random(seed + idx): held-out entries take the seeds [base, base +
        # used), training entries the ones after, and equal questions from other seeds are dropped.
        base = random.Random(f"reasoning_gym:{seed}:{label}").randrange(2**31)
        tries = 4 * n_held[i] + 100
        held_set = _dataset(gym, key, spec.name, spec.config, base, tries)
        questions: set[str] = set()
        used = 0
        while len(questions) < n_held[i] and used < tries:
            e = _entry(held_set, key, spec.name, used)
            used += 1
            if e["question"] not in questions:
                questions.add(e["question"])
                held.append(_record(e, label))
                entries[(label, e["question"])] = e
        train_set = _dataset(gym, key, spec.name, spec.config, base + used, n_train[i])
        kept = 0
        for j in range(n_train[i]):
            e = _entry(train_set, key, spec.name, j)
            if e["question"] not in questions:
                train.append(_record(e, label))
                entries.setdefault((label, e["question"]), e)
                kept += 1
        if not kept:
            raise ConfigError(f"{key}.config", f"{spec.name}: every generated question is a held-out one; widen its "
                                               "settings or lower data.eval_size")
        datasets[label] = held_set
    digest = hashlib.sha256(json.dumps([(r["data_source"], r["prompt"], r["answer"]) for r in train]).encode())
    return GymData(train, held, GymReward(datasets, entries, cfg.answer_format), labels, digest.hexdigest())


def _record(entry: Mapping[str, Any], label: str) -> dict[str, Any]:
    return {"prompt": entry["question"], "answer": str(entry["answer"]), "metadata": _json_safe(entry.get("metadata", {})),
            "data_source": label}


class GymReward:
    """The reward of `data.source: reasoning_gym`: the record's dataset's `score_answer` on the answer read
    from the response. A response the scorer cannot read scores 0.0 rather than stopping the run."""

    def __init__(self, datasets: dict[str, Any], entries: dict[tuple[str, str], dict[str, Any]],
                 answer_format: str) -> None:
        self.datasets, self.entries, self.answer_format = datasets, entries, answer_format

    def __call__(self, response: str, answer: Any, *, record: Mapping[str, Any]) -> float:
        label, question = record["data_source"], record["prompt"]
        # The generated entry itself where this run made the record (its metadata as the scorer made it).
        entry = self.entries.get((label, question)) or {"question": question, "answer": answer,
                                                         "metadata": record.get("metadata") or {}}
        try:
            return float(self.datasets[label].score_answer(answer=extract_answer(response, self.answer_format),
                                                           entry=entry))
        except Exception:  # noqa: BLE001 - a scorer that chokes on the model's text: a wrong answer
            return 0.0


def check_vocabulary(records: Sequence[Mapping[str, Any]], tokenizer: Any) -> None:
    """Every character of the questions and answers is one the model's tokenizer knows: a byte-level tokenizer
    drops a character its vocabulary lacks (or reads it as `<unk>`), and a question read without its words
    cannot be learned. A ConfigError naming `model.init` otherwise."""
    unk = getattr(tokenizer, "unk_token_id", None)
    chars: dict[str, set[str]] = {}
    for r in records:
        chars.setdefault(r["data_source"], set()).update(str(r["prompt"]), str(r["answer"]))
    for label, used in chars.items():
        # Whitespace alone may encode to nothing in a real tokenizer (sentencepiece): only other characters count.
        missing = sorted(c for c in used if not c.isspace()
                         and ((ids := tokenizer(c, add_special_tokens=False)["input_ids"]) == [] or unk in ids))
        if missing:
            shown = "".join(missing[:12]) + ("..." if len(missing) > 12 else "")
            raise ConfigError("model.init", f"the questions of task {label} use characters the model's vocabulary "
                                            f"lacks ({shown!r}): use model.init: tiny_text, or a model.path that has them")
