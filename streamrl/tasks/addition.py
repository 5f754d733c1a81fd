"""The built-in quickstart task: two-digit addition, ``"37+48="`` -> ``"85"``, with an exact-match reward.

This module owns the prompt format, the deterministic train / held-out split and the reward. It knows
nothing about tokenizers or models: prompts and answers are plain text, and records have the same
shape ``{"prompt", "answer"}`` that `streamrl.tasks.datasets.load_prompts` returns.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

LOW, HIGH = 10, 99  # operands are two-digit integers, both ends inclusive
EOS_TEXT = "<eos>"

Pair = tuple[int, int]


def make_prompt(a: int, b: int) -> str:
    """The prompt text for ``a + b`` (no ``<bos>``: the caller's tokenizer policy adds it)."""
    return f"{a}+{b}="


def make_answer(a: int, b: int) -> str:
    return str(a + b)


@dataclass(frozen=True)
class AdditionSplit:
    """Disjoint operand pairs: ``held_out`` pairs never appear in ``train``."""

    train: tuple[Pair, ...]
    held_out: tuple[Pair, ...]


def all_pairs() -> list[Pair]:
    return [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]


def split_pairs(seed: int = 0, held_out_fraction: float = 0.1) -> AdditionSplit:
    """Shuffle all 8,100 ordered pairs with ``seed`` and hold out a fraction of them.

    Ordered pairs are split independently, so ``(a, b)`` may be held out while ``(b, a)`` is trained
    on: the held-out set measures generalisation to unseen prompts, not to unseen sums.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    pairs = all_pairs()
    random.Random(seed).shuffle(pairs)
    n_held = round(len(pairs) * held_out_fraction)
    return AdditionSplit(train=tuple(sorted(pairs[n_held:])), held_out=tuple(sorted(pairs[:n_held])))


def to_records(pairs: tuple[Pair, ...] | list[Pair]) -> list[dict[str, str]]:
    return [{"prompt": make_prompt(a, b), "answer": make_answer(a, b)} for a, b in pairs]


def addition_prompts(
    split: Literal["train", "held_out"] = "train", *, seed: int = 0, held_out_fraction: float = 0.1
) -> list[dict[str, str]]:
    """Prompt records ``{"prompt": "37+48=", "answer": "85"}`` of one side of the split."""
    s = split_pairs(seed, held_out_fraction)
    if split == "train":
        return to_records(s.train)
    if split == "held_out":
        return to_records(s.held_out)
    raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")


def reward(response_text: str, answer: str) -> float:
    """1.0 iff the response, cut at its first ``<eos>`` and stripped of whitespace, equals ``answer``.

    ``response_text`` is the generated text only (not the prompt). Engines usually stop at eos and
    decode without special tokens, in which case the cut is a no-op; it is there so a response decoded
    with special tokens kept (``"85<eos><pad>"``) scores the same. Anything else is a miss: ``"85 "``
    scores 1.0, ``"85+1"`` and ``"085"`` score 0.0.
    """
    text = response_text.split(EOS_TEXT, 1)[0]
    return 1.0 if text.strip() == answer.strip() else 0.0
