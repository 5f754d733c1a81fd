"""How a judge's text becomes a score (`judge.parse`): the built-in rules and a user's function.

A rule gets the judge's text and the logprob of each token it wrote, and returns a float, or raises
ValueError when the text holds no verdict (the judge client retries, then counts a failure).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from ..plugins import load_plugin

Parser = Callable[[str, list[float]], "float | Awaitable[float]"]

_YES = frozenset({"y", "yes", "true", "correct"})
_NO = frozenset({"n", "no", "false", "incorrect", "wrong"})
_WORD = re.compile(r"[A-Za-z]+")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def yes_no(text: str, logprobs: list[float]) -> float:
    """1.0 / 0.0 by the judge's last word: y, yes, true, correct / n, no, false, incorrect, wrong
    (any case). Reasoning may come first: only its verdict, the last word, counts."""
    words = _WORD.findall(text)
    last = words[-1].lower() if words else ""
    if last in _YES:
        return 1.0
    if last in _NO:
        return 0.0
    raise ValueError(f"no yes/no verdict at the end of the judge's text {_short(text)}")


def number(text: str, logprobs: list[float]) -> float:
    """The last number in the judge's text (a score it gives after its reasoning)."""
    found = _NUMBER.findall(text)
    if not found:
        raise ValueError(f"no number in the judge's text {_short(text)}")
    return float(found[-1])


def _short(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:77] + "...")


PARSERS: dict[str, Parser] = {"yes_no": yes_no, "number": number}


def load_parser(spec: str) -> Parser:
    """`yes_no`, `number`, or a user's `module:function` / `file.py:function` (sync or async) called
    as `fn(text, logprobs)`; PluginError otherwise."""
    return load_plugin(spec, "judge parse function", PARSERS)
