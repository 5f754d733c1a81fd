"""The judge service: a generative reward model on its own engine pool (`judge.*`), which rewards
await (`data.reward: judge`, or a reward function that takes a `judge` argument). The run builds the
judge's pool from `judge.engines` and gives it to the `Judge` (streamrl/assemble.py); training never
touches that pool: no weight push, pause or abort reaches it. Nothing here imports the rollout."""

from ..errors import JudgeError
from .client import Judge, JudgeCounters, RecordingJudge, Verdict, prompt_text
from .parse import PARSERS, load_parser, number, yes_no

__all__ = ["PARSERS", "Judge", "JudgeCounters", "JudgeError", "RecordingJudge", "Verdict", "load_parser", "number",
           "prompt_text", "yes_no"]
