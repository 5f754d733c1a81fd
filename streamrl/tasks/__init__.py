"""Built-in tasks (2-digit addition), user task loading (prompt files, reward functions) and the tiny model builder."""

from streamrl.tasks.addition import (
    AdditionSplit,
    addition_prompts,
    make_answer,
    make_prompt,
    reward,
    split_pairs,
    to_records,
)
from streamrl.tasks.datasets import is_async_reward, load_prompts, load_reward_fn
from streamrl.tasks.tiny_model import (
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

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "PRESETS",
    "TOKENS",
    "UNK_ID",
    "AdditionSplit",
    "addition_prompts",
    "build_tiny_model",
    "char_tokenizer_ids",
    "count_parameters",
    "is_async_reward",
    "load_prompts",
    "load_reward_fn",
    "make_answer",
    "make_prompt",
    "reward",
    "split_pairs",
    "to_records",
]
