"""The judge service: a generative reward model on its own engine pool (`judge.*`), which rewards
await (`data.reward: judge`, or a reward function that takes a `judge` argument). Training never
touches its pool: no weight push, pause or abort reaches it."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from ..config import Config, JudgeConfig
from .client import (
    Judge,
    JudgeCounters,
    JudgeError,
    Verdict,
    judge_reward,
    prompt_text,
    recording,
)
from .parse import load_parser, number, yes_no


def build_judge(cfg: JudgeConfig, model_dir: str, *, run_dir: Path, seed: int = 0) -> Judge:
    """A Judge over a pool of `cfg.engines` serving `model_dir` (not started yet). Launched servers
    log to run_dir/judge/logs."""
    from transformers import AutoTokenizer

    from ..rollout import build_pool

    pool = build_pool(cfg.engines, model_dir, run_dir=run_dir / "judge", seed=seed)
    return Judge(cfg, pool, AutoTokenizer.from_pretrained(model_dir), seed=seed)


async def open_judge(cfg: Config, stack: AsyncExitStack, task: Any, *, log: Any = print) -> Judge | None:
    """With `judge.enabled`: the judge model prepared (built and warm-started like the policy's, cached),
    its pool (`judge.engines`) started inside `stack`, and the judge given to `task`'s rewards. None
    otherwise."""
    j = cfg.judge
    if not j.enabled:
        return None
    from ..tasks import prepare_model

    recipe = f"{cfg.data.task}_judge" if j.warm_start.enabled else None
    model_dir, warm = prepare_model(j.model, j.warm_start, seed=cfg.seed, task=recipe, log=lambda m: log(f"judge: {m}"))
    if "held_out_agreement" in warm:
        log(f"judge: agrees with exact match on {warm['held_out_agreement']:.1%} of its warm start's held-out examples")
    judge = await stack.enter_async_context(build_judge(j, model_dir, run_dir=Path(cfg.run_dir), seed=cfg.seed))
    judge.warm_start = warm
    task.judge = judge
    return judge


__all__ = ["Judge", "JudgeCounters", "JudgeError", "Verdict", "build_judge", "judge_reward",
           "load_parser", "number", "open_judge", "prompt_text", "recording", "yes_no"]
