"""Tasks: the built-in 2-digit addition with its warm start, user tasks (prompt files, reward functions),
the run's starting model (`prepare_model`: the tiny model builder, then the cached warm start)."""

from streamrl.tasks.addition import (
    AdditionSplit,
    addition_prompts,
    make_answer,
    make_prompt,
    reward,
    split_pairs,
    to_records,
)
from streamrl.tasks.datasets import Task, is_async_reward, load_prompts, load_reward_fn, load_task
from streamrl.tasks.tiny_model import (
    AGENT_TOKENS,
    BOS_ID,
    EOS_ID,
    PAD_ID,
    PRESETS,
    TOKENS,
    UNK_ID,
    build_tiny_model,
    char_tokenizer_ids,
    count_parameters,
)
from streamrl.tasks.warm_start import prepare_model

__all__ = [
    "AGENT_TOKENS",
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "PRESETS",
    "TOKENS",
    "UNK_ID",
    "AdditionSplit",
    "Task",
    "addition_prompts",
    "build_tiny_model",
    "char_tokenizer_ids",
    "count_parameters",
    "is_async_reward",
    "load_prompts",
    "load_reward_fn",
    "load_task",
    "make_answer",
    "make_prompt",
    "prepare_model",
    "reward",
    "split_pairs",
    "to_records",
]
