"""The calculator with an environment's latency, for bench/agentic_async.py: 0-300 ms per call, a long
tail (MAX_S x u^4, u uniform: at 300 ms, median 19 ms, mean 60 ms, p90 197 ms), the same for the same call in
every mode. Every execution is logged under the sample and turn it belongs to, so the bench can
count calls that ran more than once."""

from __future__ import annotations

import asyncio
import contextvars
import random
import time
from collections import Counter
from typing import Any

from streamrl.rollout.tools import calculator
from streamrl.rollout.workflows import multi_turn_tools

MAX_S = 0.3
EXECUTED: Counter[tuple[str, int, int]] = Counter()  # executions per (group, sample, tool turn)
WAITED: list[float] = []  # every call's latency
_episode: contextvars.ContextVar[Any] = contextvars.ContextVar("episode")


async def workflow(record: dict[str, Any], episode: Any) -> None:
    """`multi_turn_tools`, with the episode known to the tool (the context follows its calls)."""
    _episode.set(episode)
    await multi_turn_tools(record, episode)


async def slow_calculator(args: str) -> str:
    s = _episode.get().sample
    key = (s.group_id, s.index, len(s.turns))  # the tool turn this call becomes
    EXECUTED[key] += 1
    latency = MAX_S * random.Random(f"{args}#{s.index}").random() ** 4
    WAITED.append(latency)
    await asyncio.sleep(latency)
    return calculator(args)


_SANDBOX: list[Any] = []


async def code_calculator(args: str) -> str:
    """The calculator as the code tool (`tools.python`'s sandbox, real): the model's expression is printed
    by a program that first waits MAX_S x u^4 seconds (the running time of real code: a test suite, a
    request it makes), in a fresh sandboxed process tree per call. Same latency draw as `slow_calculator`."""
    from streamrl.config.schema import PythonToolConfig
    from streamrl.rollout.sandbox import PythonTool

    if not _SANDBOX:
        _SANDBOX.append(PythonTool(PythonToolConfig(enabled=True, timeout_s=MAX_S + 10)))
    s = _episode.get().sample
    EXECUTED[(s.group_id, s.index, len(s.turns))] += 1
    wait = MAX_S * random.Random(f"{args}#{s.index}").random() ** 4
    t0 = time.perf_counter()
    try:
        return (await _SANDBOX[0].run(f"import time\ntime.sleep({wait!r})\nprint({args.strip()})")).strip()
    finally:
        WAITED.append(time.perf_counter() - t0)
