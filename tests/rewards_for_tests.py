"""Reward functions used by the run-loop tests (a random model never solves the real task)."""


def length_reward(response_text: str, answer: str) -> float:
    """Rewards longer responses: varies within a group, so GRPO has a gradient to follow."""
    return float(len(response_text))


def failing_reward(response_text: str, answer: str) -> float:
    """A reward that always fails, as a broken verifier would: every group fails while being scored."""
    raise ValueError("the verifier is down")


def half_signal_reward(response_text: str, answer: str) -> float:
    """Varies within the groups of prompts whose answer is even; equal (0) in the others: half of the
    groups carry no GRPO signal (dynamic sampling)."""
    return float(len(response_text)) if int(answer) % 2 == 0 else 0.0


def constant_reward(response_text: str, answer: str) -> float:
    """No signal in any group."""
    return 1.0
