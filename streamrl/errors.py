"""Errors that cross layers: raised below (engine pools, the judge, rewards), caught above (the run loop,
the CLI). Each one's `str()` is one line a user can act on."""


class StreamrlError(RuntimeError):
    """A run that cannot go on, for a reason the user can act on: the CLI prints `error: <it>`, exit 1."""


class RolloutFailed(StreamrlError):
    """Groups keep failing (an engine rejecting every request, a reward function that raises), or a
    pool has no engine left: the rollout stops instead of retrying forever."""


class JudgeError(RuntimeError):
    """A judgment that failed every try; `str()` is one line: why, and how many tries. The group it
    scores fails like one whose reward raised; a held-out evaluation leaves that response out."""


class JudgeRejected(StreamrlError):
    """The judge agrees with the evaluation's reward less often than `judge.min_agreement`: RL on its
    scores would learn the judge's mistakes, so the run stops before it starts."""
