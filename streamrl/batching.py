"""Length buckets: how the engine's prefill and the trainer's micro-batches keep padding small.

A right-padded batch costs its longest sequence times its size. In a long-tail batch (a few 300-token
samples among many 10-token ones) one padded batch is mostly padding; sorting by length and cutting
wherever padding would pass `max_padding` of the real tokens keeps the work close to the real count,
at the price of a few more (smaller) calls.
"""

from __future__ import annotations


def length_buckets(
    lengths: list[int], *, max_padding: float = 0.25, max_tokens: int | None = None
) -> list[list[int]]:
    """Indices of `lengths`, ascending by length, cut into buckets.

    Each bucket's padded size (its longest length times its size) stays within `(1 + max_padding)` of
    its real tokens and, if given, within `max_tokens`; a bucket always holds at least one index.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    buckets: list[list[int]] = []
    real = 0
    for i in order:
        n = lengths[i]
        padded = n * (len(buckets[-1]) + 1) if buckets else 0  # ascending: n is the width if i joins
        too_padded = padded > (1 + max_padding) * (real + n)
        if not buckets or too_padded or (max_tokens is not None and padded > max_tokens):
            buckets.append([])
            real = 0
        buckets[-1].append(i)
        real += n
    return buckets


def balanced_parts(weights: list[int], n: int) -> list[list[int]]:
    """Indices of `weights` in min(n, len) parts of about equal total weight (the heaviest item first
    into the lightest part, ties to the lower index); each part in index order.

    A PPO minibatch of a long-tail batch is then about 1/n of its tokens, not 1/n of its samples.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    n = min(n, len(weights))
    parts: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        j = min(range(n), key=lambda j: (load[j], j))
        parts[j].append(i)
        load[j] += weights[i]
    return [sorted(p) for p in parts]
