"""Tasks: the built-in ones (one module each: prompts, reward, warm start; `builtin.BUILTIN_TASKS`), user
tasks (prompt files, reward functions), the tiny model builder, and the cached warm starts that make a
run's starting model (`warm.prepare_model`)."""

from streamrl.tasks.addition import (
    AdditionSplit,
    addition_prompts,
    make_answer,
    make_prompt,
    reward,
    split_pairs,
    to_records,
)
from streamrl.tasks.builtin import BUILTIN_TASKS, BuiltinTask
from streamrl.tasks.datasets import (
    Task,
    is_async_reward,
    judge_reward,
    load_prompts,
    load_reward_fn,
    load_task,
)
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
from streamrl.tasks.warm import prepare_model

__all__ = [
    "AGENT_TOKENS",
    "BOS_ID",
    "BUILTIN_TASKS",
    "EOS_ID",
    "PAD_ID",
    "PRESETS",
    "TOKENS",
    "UNK_ID",
    "AdditionSplit",
    "BuiltinTask",
    "Task",
    "addition_prompts",
    "build_tiny_model",
    "char_tokenizer_ids",
    "count_parameters",
    "is_async_reward",
    "judge_reward",
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
