"""Reward functions used by the run-loop tests (a random model never solves the real task)."""


def length_reward(response_text: str, answer: str) -> float:
    """Rewards longer responses: varies within a group, so GRPO has a gradient to follow."""
    return float(len(response_text))


def failing_reward(response_text: str, answer: str) -> float:
    """A reward that always fails, as a broken verifier would: every group fails while being scored."""
    raise ValueError("the verifier is down")
