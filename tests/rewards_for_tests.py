"""Reward functions used by the run-loop tests (a random model never solves the real task)."""


def length_reward(response_text: str, answer: str) -> float:
    """Rewards longer responses: varies within a group, so GRPO has a gradient to follow."""
    return float(len(response_text))
