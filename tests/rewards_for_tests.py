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


def judge_text_length(text: str, logprobs: list[float]) -> float:
    """A judge parse rule that accepts any text: its length (a random judge model writes anything)."""
    return float(len(text))


def judge_unparsable(text: str, logprobs: list[float]) -> float:
    """A judge parse rule that finds no verdict in any text, as a judge that answers off-format would."""
    raise ValueError(f"no verdict in {text!r}")


async def rule_and_judge(response: str, answer: str, *, record: dict, judge) -> float:  # noqa: ANN001
    """A reward that combines a rule and a judge: the rule first, the judge's score added."""
    verdict = await judge.judge(response, record)
    return float(response.strip() == answer) + verdict.score


_judge_calls = iter(range(1 << 62))


def judge_fails_every_tenth(text: str, logprobs: list[float]) -> float:
    """A judge that answers off-format on every tenth call (in this process) and with a score otherwise."""
    if next(_judge_calls) % 10 == 9:
        raise ValueError("the judge's tenth answer")
    return float(len(text))


def judge_always_yes(text: str, logprobs: list[float]) -> float:
    """A judge that calls every response right: it agrees with exact match only where the policy is."""
    return 1.0
