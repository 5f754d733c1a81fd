"""Held-out evaluation: one response per held-out record through the engines (not the trainer), built by
the run's workflow and sampled as training samples (the runner's parameters, at the evaluation's
temperature and seed), scored by the evaluation's reward (`data.eval_reward`, else the training
reward), and, where the two differ (a judge checked against exact match), how often they agree."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import TYPE_CHECKING, Any

from ..errors import JudgeError, RolloutFailed
from ..types import Sample

if TYPE_CHECKING:
    from .manager import RolloutManager


async def evaluate_agreement(m: RolloutManager, *, temperature: float, seed: int = 12345,
                             records: list[dict[str, Any]] | None = None,
                             compare: bool = True) -> tuple[float, float | None, dict[str, float]]:
    """The mean evaluation reward over `records` (default: the task's held-out ones; NaN without any),
    the share of responses on which the evaluation and training rewards agree (both >= 0.5 or both
    below; None where they are one reward, or with `compare` off), and the mean per record `data_source`
    (a mixed dataset's task; empty where no record names one). A response whose evaluation reward fails
    (a judge's) counts in neither; one whose training reward fails, in the mean only."""
    records = m.task.held_out if records is None else records
    if not records:
        return float("nan"), None, {}
    compare = compare and m.task.eval_fn is not None and m.task.eval_fn is not m.task.reward_fn

    async def reward(score: Any, text: str, r: dict[str, Any]) -> float | None:
        try:
            out = score(text, r, m.judge)
            return float(await out) if inspect.isawaitable(out) else float(out)
        except JudgeError:
            return None  # counted by the judge; one judgment is no reason to stop the run
        except Exception as e:  # noqa: BLE001 - a user's reward function: say so in one line
            raise RolloutFailed(f"held-out evaluation: the reward function raised {type(e).__name__}: {e}") from e

    async def one(i: int, r: dict[str, Any]) -> tuple[float | None, float | None]:
        rid = f"eval-{seed}-{i}-{time.monotonic_ns()}"
        s = Sample(group_id=rid, prompt_ids=m.encode(r["prompt"]), meta={"answer": r.get("answer", "")})
        await m.run_episodes([s], r, sampling={"temperature": temperature, "sampling_seed": seed + i})
        text = m.response_text(s)
        if "env_reward" in s.meta:  # an environment that scores its own episodes (rollout.environment)
            return float(s.meta["env_reward"]), None
        ev = await reward(m.task.score_eval, text, r)
        return ev, (await reward(m.task.score, text, r) if compare else None)

    pairs = await asyncio.gather(*[one(i, r) for i, r in enumerate(records)])
    scores = [e for e, _ in pairs if e is not None]
    if not scores:
        raise RolloutFailed("held-out evaluation: the judge failed on every response (see judge_failures)")
    both = [(e, t) for e, t in pairs if e is not None and t is not None]
    agreement = sum((e >= 0.5) == (t >= 0.5) for e, t in both) / len(both) if both else None
    by_source: dict[str, list[float]] = {}
    for r, (e, _) in zip(records, pairs, strict=True):
        if e is not None and r.get("data_source") is not None:
            by_source.setdefault(str(r["data_source"]), []).append(e)
    return sum(scores) / len(scores), agreement, {k: sum(v) / len(v) for k, v in by_source.items()}
