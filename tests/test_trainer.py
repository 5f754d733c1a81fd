"""Trainer: micro-batching is exact, the on-policy logprob check holds, versions advance."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from streamrl.trainer.losses import LossConfig
from streamrl.trainer.trainer import Trainer, TrainerSettings
from streamrl.types import Group, Sample


def fake_groups(seed: int, n_groups: int = 3, n: int = 4) -> list[Group]:
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [1] + [rng.randrange(4, 22) for _ in range(rng.randint(3, 7))]
        samples = []
        for i in range(n):
            s = Sample(group_id=f"g{g}", index=i, prompt_ids=prompt, reward=float(rng.random() < 0.5))
            k = rng.choice([1, 2, 3, 20])  # long tail, so micro-batches really differ in width
            s.append([rng.randrange(4, 22) for _ in range(k)], [-rng.random() * 3 for _ in range(k)], 0)
            samples.append(s)
        groups.append(Group(group_id=f"g{g}", samples=samples))
    return groups


@pytest.mark.parametrize("kind", ["grpo", "decoupled_ppo"])
def test_micro_batches_give_the_same_update(tiny_model_dir: Path, kind: str) -> None:
    def trained(budget: int) -> tuple[list[torch.Tensor], Trainer, dict]:
        torch.manual_seed(0)
        t = Trainer(str(tiny_model_dir), TrainerSettings(lr=1e-3, loss=LossConfig(kind=kind), micro_batch_tokens=budget))
        stats = t.train_step(fake_groups(1))
        # Compare gradients, not Adam's update: Adam divides by sqrt(v), which turns float summation
        # noise on near-zero gradients into lr-sized differences.
        return [p.grad.detach().clone() for p in t.model.parameters()], t, stats

    whole, t1, s1 = trained(10**6)
    split, t2, s2 = trained(40)
    assert len(t2.micro_batches([10, 10, 30, 30, 30])) > 1
    assert any(a.abs().max() > 1e-4 for a in whole)
    for a, b in zip(whole, split, strict=True):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-4)
    assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-6)
    assert s1["staleness_mean"] == s2["staleness_mean"] == 0.0
    assert t1.version == t2.version == 1
    start = Trainer(str(tiny_model_dir), TrainerSettings(loss=LossConfig(kind=kind)))
    moved = [not torch.equal(a, b) for a, b in zip(t1.model.parameters(), start.model.parameters(), strict=True)]
    assert any(moved)
