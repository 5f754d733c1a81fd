"""Length buckets shared by the engine's prefill and the trainer's micro-batches; PPO minibatch parts."""

from __future__ import annotations

import random

import pytest

from streamrl.batching import balanced_parts, length_buckets


def _padded(lengths: list[int], bucket: list[int]) -> int:
    return max(lengths[i] for i in bucket) * len(bucket)


def test_every_index_once_in_ascending_buckets() -> None:
    rng = random.Random(0)
    lengths = [rng.choice([rng.randint(8, 16), rng.randint(60, 300)]) for _ in range(64)]
    buckets = length_buckets(lengths, max_padding=0.25, max_tokens=4096)
    assert sorted(i for b in buckets for i in b) == list(range(64))
    flat = [lengths[i] for b in buckets for i in b]
    assert flat == sorted(flat)
    for b in buckets:
        assert b
        real = sum(lengths[i] for i in b)
        assert len(b) == 1 or _padded(lengths, b) <= min(1.25 * real, 4096)


def test_long_tail_padding_is_cut() -> None:
    lengths = [10] * 60 + [280, 150, 290]
    one = length_buckets(lengths, max_padding=float("inf"))
    assert len(one) == 1 and _padded(lengths, one[0]) == 290 * 63
    cut = length_buckets(lengths, max_padding=0.25)
    assert sum(_padded(lengths, b) for b in cut) <= 1.25 * sum(lengths)


@pytest.mark.parametrize("max_tokens", [1, 50])
def test_a_sequence_longer_than_the_budget_gets_a_bucket_of_its_own(max_tokens: int) -> None:
    assert length_buckets([100, 5, 5], max_padding=10.0, max_tokens=max_tokens) == (
        [[1], [2], [0]] if max_tokens == 1 else [[1, 2], [0]]
    )


def test_empty() -> None:
    assert length_buckets([]) == []


def test_balanced_parts_cover_every_index_once_with_loads_within_one_item() -> None:
    rng = random.Random(0)
    for _ in range(200):
        weights = [rng.choice([1, 2, 3, 5, 40, 300]) for _ in range(rng.randint(1, 40))]
        n = rng.randint(1, 6)
        parts = balanced_parts(weights, n)
        assert len(parts) == min(n, len(weights))
        assert sorted(i for p in parts for i in p) == list(range(len(weights)))
        assert all(p == sorted(p) and p for p in parts)
        loads = [sum(weights[i] for i in p) for p in parts]
        assert max(loads) - min(loads) <= max(weights)
    assert balanced_parts([300, 2, 2, 2, 300, 1], 2) == [[0, 1, 3], [2, 4, 5]]
    with pytest.raises(ValueError, match="n must be >= 1"):
        balanced_parts([1], 0)
