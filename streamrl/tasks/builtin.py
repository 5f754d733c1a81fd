"""The built-in tasks by name (`data.task`): each one module that owns its prompts, its reward and its
warm start (and, for addition, the judge's), registered here and nowhere else."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .addition import addition_prompts
from .addition import reward as addition_reward
from .addition import warm_start as addition_warm_start
from .addition_judge import warm_start as judge_warm_start
from .agent_tools import reward as agent_reward
from .agent_tools import warm_start as agent_warm_start
from .multiply import multiply_prompts
from .multiply import reward as multiply_reward
from .multiply import warm_start as multiply_warm_start
from .warm import Recipe


@dataclass(frozen=True)
class BuiltinTask:
    prompts: Callable[..., list[dict[str, Any]]]  # prompts(split, seed=...) for split in train / held_out
    reward: Callable[..., Any]  # reward(response, answer)
    warm_start: Recipe | None = None  # warm_start.enabled: the policy's supervised start
    judge_warm_start: Recipe | None = None  # judge.warm_start.enabled: a judge that grades this task


BUILTIN_TASKS: dict[str, BuiltinTask] = {
    "addition": BuiltinTask(addition_prompts, addition_reward, addition_warm_start, judge_warm_start),
    "multiply": BuiltinTask(multiply_prompts, multiply_reward, multiply_warm_start),
    "agent_multiply": BuiltinTask(multiply_prompts, agent_reward, agent_warm_start),
}
