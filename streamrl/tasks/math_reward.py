"""The built-in `data.reward: math`: 1.0 when a response's final answer equals the ground truth, else 0.0.

Answers are compared by value with `math-verify` (``1,234`` = ``1234``, ``\\frac12`` = ``0.5``), so one
reward serves GSM8K-style data (``#### 42``, in the ground truth or the response), MATH-style data
(``\\boxed{...}``) and plain answers; it dispatches on the answer text alone, so one run can mix data
sources without telling it which is which. It never raises: a policy's junk output scores 0.0 rather
than failing its group.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

# math-verify times a parse out with signal.alarm, which only the main thread may set; elsewhere
# (a reward called from a worker thread) parse without it rather than fail every sample.
_TIMEOUT_S = 5
# Only a response's tail is parsed: the final answer lives there, and sympy's cost grows with the text.
_TAIL_CHARS = 2000
_GSM8K_RE = re.compile(r"####\s*([^\n]*)")

# math-verify logs every expression it cannot parse; a policy's junk would flood the run's log.
logging.getLogger("math_verify").setLevel(logging.CRITICAL)


def _timeout() -> int | None:
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _gsm8k_final(text: str) -> str | None:
    """What follows the last ``####`` (GSM8K's answer marker) on its line, or None without one."""
    found = _GSM8K_RE.findall(text)
    if not found:
        return None
    return found[-1].strip().rstrip(".").replace("$", "").strip()


def _parse(text: str, *, gold: bool) -> list[Any]:
    from math_verify import parse

    final = _gsm8k_final(text)
    if final is not None:
        text = final
    if gold:
        # A bare LaTeX ground truth ("\frac{1}{2}") reads as math only inside $...$; a plain one
        # ("42") parses either way.
        parsed = parse(f"${text}$", parsing_timeout=_timeout())
        return parsed or parse(text, parsing_timeout=_timeout())
    return parse(text[-_TAIL_CHARS:], parsing_timeout=_timeout())


def _norm(text: str) -> str:
    return re.sub(r"\s+", "", text).rstrip(".").replace(",", "")


def _one(response: str, truth: str) -> bool:
    from math_verify import verify

    final = _gsm8k_final(response)
    # The same text is the same answer, whether or not math-verify reads it as math (a name, "B").
    if truth.strip() and _norm(final if final is not None else response) == _norm(_gsm8k_final(truth) or truth):
        return True
    gold = _parse(truth, gold=True)
    pred = _parse(response, gold=False) if gold else []
    return bool(pred) and verify(gold, pred, timeout_seconds=_timeout())


def math_reward(response: str, answer: Any) -> float:
    """1.0 if `response`'s final answer (after ``####``, in ``\\boxed{}``, or what math-verify reads as
    the final expression) equals `answer` (a string, a number, a GSM8K solution ending ``#### 42``,
    or a list of accepted answers), else 0.0: also for a missing answer and for text no parser
    makes sense of."""
    from math_verify.errors import TimeoutException  # a BaseException: `except Exception` misses it

    if answer is None or isinstance(answer, bool) or not isinstance(response, str):
        return 0.0
    truths = [str(a) for a in answer] if isinstance(answer, list | tuple) else [str(answer)]
    for truth in truths:
        try:
            if _one(response, truth):
                return 1.0
        except (Exception, TimeoutException):  # noqa: BLE001 - sympy raises many types; junk is a wrong answer
            continue
    return 0.0
