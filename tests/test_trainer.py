"""Trainer: micro-batching is exact, the on-policy logprob check holds, versions advance."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from streamrl.batching import balanced_parts
from streamrl.config import TrainerConfig
from streamrl.trainer.trainer import Trainer
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
    def trained(budget: int, padding: float) -> tuple[list[torch.Tensor], Trainer, dict]:
        torch.manual_seed(0)
        settings = TrainerConfig(lr=1e-3, loss=kind, micro_batch_tokens=budget, micro_batch_padding=padding)
        t = Trainer(settings, str(tiny_model_dir))
        stats = t.train_step(fake_groups(1))
        # Compare gradients, not Adam's update: Adam divides by sqrt(v), which turns float summation
        # noise on near-zero gradients into lr-sized differences.
        return [p.grad.detach().clone() for p in t.model.parameters()], t, stats

    whole, t1, s1 = trained(10**6, float("inf"))
    split, t2, s2 = trained(40, 0.25)
    assert len(t1.micro_batches([10, 10, 30, 30, 30])) == 1
    assert len(t2.micro_batches([10, 10, 30, 30, 30])) > 1
    assert any(a.abs().max() > 1e-4 for a in whole)
    for a, b in zip(whole, split, strict=True):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-4)
    assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-6)
    assert s1["staleness_mean"] == s2["staleness_mean"] == 0.0
    assert t1.version == t2.version == 1
    start = Trainer(TrainerConfig(loss=kind), str(tiny_model_dir))
    moved = [not torch.equal(a, b) for a, b in zip(t1.model.parameters(), start.model.parameters(), strict=True)]
    assert any(moved)


@pytest.mark.parametrize("kind", ["grpo", "decoupled_ppo", "tis"])
def test_skipping_zero_advantage_samples_gives_the_same_update(tiny_model_dir: Path, kind: str) -> None:
    groups = fake_groups(2, n_groups=4)
    for s in groups[0].samples + groups[2].samples:  # two groups with one reward each: advantage 0
        s.reward = 1.0
    for s in groups[1].samples:  # stale tokens, so the behaviour weight of decoupled/tis is not 1
        s.versions = [0] * len(s.versions)

    def trained(skip: bool) -> tuple[list[torch.Tensor], dict]:
        torch.manual_seed(0)
        t = Trainer(TrainerConfig(lr=1e-3, loss=kind), str(tiny_model_dir))
        t.skip_zero_advantage = skip
        t.version = 2
        stats = t.train_step(groups)
        return [p.grad.detach().clone() for p in t.model.parameters()], stats

    g_full, s_full = trained(False)
    g_skip, s_skip = trained(True)
    assert s_full["skipped_samples"] == 0 and s_skip["skipped_samples"] == 8
    assert s_skip["computed_tokens"] < s_full["computed_tokens"] == s_full["trained_tokens"]
    assert s_skip["loss"] == pytest.approx(s_full["loss"], abs=1e-6)
    assert s_skip["staleness_mean"] == s_full["staleness_mean"] > 0
    assert s_skip["staleness_max"] == s_full["staleness_max"] == 2
    assert any(g.abs().max() > 1e-4 for g in g_full)
    for a, b in zip(g_full, g_skip, strict=True):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize("kind", ["grpo", "decoupled_ppo", "tis"])
def test_a_batch_in_parts_gives_the_same_update_as_whole(tiny_model_dir: Path, kind: str) -> None:
    """The run loop hands the trainer a batch in parts (groups that may be trained while others still
    generate): accumulate per part + finish_step must equal one train_step on the whole batch,
    stats included, whatever the split (a part with no learning signal at all among them)."""
    groups = fake_groups(3, n_groups=5)
    for s in groups[1].samples:  # a group with one reward: advantage 0, skipped
        s.reward = 1.0
    for s in groups[3].samples:  # stale tokens, so the behaviour weight of decoupled/tis is not 1
        s.versions = [0] * len(s.versions)

    def trained(parts: list[list[Group]]) -> tuple[list[torch.Tensor], dict, Trainer]:
        torch.manual_seed(0)
        t = Trainer(TrainerConfig(lr=1e-3, loss=kind), str(tiny_model_dir))
        t.version = 2
        if len(parts) == 1:
            stats = t.train_step(parts[0])
        else:
            for part in parts:
                t.accumulate(part)
            stats = t.finish_step()
        return [p.grad.detach().clone() for p in t.model.parameters()], stats, t

    g_whole, s_whole, t_whole = trained([groups])
    g_parts, s_parts, t_parts = trained([groups[:1], groups[1:2], groups[2:4], groups[4:]])
    assert any(g.abs().max() > 1e-4 for g in g_whole)
    for a, b in zip(g_whole, g_parts, strict=True):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-4)
    assert set(s_parts) == set(s_whole)
    for k, v in s_whole.items():
        assert s_parts[k] == pytest.approx(v, abs=1e-6), k
    assert s_parts["skipped_samples"] >= 4 and s_parts["trained_samples"] == 20  # group 1 at least
    assert s_parts["staleness_max"] == 2
    # Gradients, not Adam's update, are compared (see above); the step itself was taken once.
    assert t_whole.version == t_parts.version == 3
    with pytest.raises(RuntimeError, match="finish_step without accumulate"):
        t_parts.finish_step()


def test_a_batch_with_no_signal_still_steps_adam_like_the_full_computation(tiny_model_dir: Path) -> None:
    """Every group has one reward: nothing is computed, yet AdamW's state advances exactly as it does
    on the all-zero gradient of the full batch (its step count drives the bias correction after)."""
    flat, informative = fake_groups(4), fake_groups(3)
    for g in flat:
        for s in g.samples:
            s.reward = 0.0

    def run(skip: bool) -> tuple[Trainer, dict]:
        torch.manual_seed(0)
        t = Trainer(TrainerConfig(lr=1e-3, loss="grpo"), str(tiny_model_dir))
        t.skip_zero_advantage = skip
        stats = t.train_step(flat)
        t.train_step(informative)
        return t, stats

    (t_full, s_full), (t_skip, s_skip) = run(False), run(True)
    assert s_skip["computed_tokens"] == 0 and s_skip["logprob_mismatch"] is None
    assert s_full["computed_tokens"] > 0
    for p_full, p_skip in zip(t_full.model.parameters(), t_skip.model.parameters(), strict=True):
        a, b = t_full.optimizer.state[p_full], t_skip.optimizer.state[p_skip]
        assert float(a["step"]) == float(b["step"]) == 2
        # Adam's moments are linear in the gradients, so they compare without sqrt(v) amplifying noise.
        assert torch.allclose(a["exp_avg"], b["exp_avg"], atol=1e-8, rtol=1e-4)


def test_a_resumed_trainer_continues_with_the_saved_optimizer_state(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two steps, save with the optimizer, load into a fresh trainer: its third step is the original's.
    Without the optimizer state (AdamW restarting its moments) the third step comes out different."""
    settings = TrainerConfig(lr=1e-3, loss="decoupled_ppo")
    a = Trainer(settings, str(tiny_model_dir))
    a.train_step(fake_groups(1))
    a.train_step(fake_groups(2))
    ckpt = a.save(tmp_path / "ckpt", optimizer=True)
    b = Trainer(settings, str(ckpt), version=a.version, optimizer_state=ckpt / "optimizer.pt")
    fresh = Trainer(settings, str(ckpt), version=a.version)
    for t in (a, b, fresh):
        t.train_step(fake_groups(3))
    assert a.version == b.version == 3
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.allclose(pa, pb, rtol=0, atol=1e-7)
    assert any(not torch.allclose(pa, pf, rtol=0, atol=1e-5)
               for pa, pf in zip(a.model.parameters(), fresh.model.parameters(), strict=True))


def _stale(groups: list[Group]) -> list[Group]:
    """Every token from version 0; fake_groups' behaviour logprobs are random, not the model's, so the
    behaviour weight pi_prox/pi_behav is not 1."""
    for g in groups:
        for s in g.samples:
            s.versions = [0] * len(s.versions)
    return groups


def test_minibatches_match_a_plain_pytorch_loop(tiny_model_dir: Path) -> None:
    """ppo_minibatches=3: three AdamW steps per batch, each on a third of its tokens, every ratio
    taken against the weights before the first (pi_prox). Checked step by step against a plain
    per-sample computation of AReaL's eq. 5 at the trainer's own parameters of that step."""
    groups = _stale(fake_groups(5, n_groups=4))
    samples = [s for g in groups for s in g.samples]
    settings = TrainerConfig(lr=3e-2, grad_clip=0.0, ppo_minibatches=3, micro_batch_tokens=40,
                             loss="decoupled_ppo", clip_eps=0.2)
    t = Trainer(settings, str(tiny_model_dir))
    t.version = 3
    start = {k: v.clone() for k, v in t.model.state_dict().items()}
    seen: list[tuple[dict[str, torch.Tensor], list[torch.Tensor]]] = []  # (params, grads) at each step
    step = t.optimizer.step

    def recording_step() -> None:
        seen.append(({k: v.clone() for k, v in t.model.state_dict().items()},
                     [p.grad.clone() for p in t.model.parameters()]))
        step()

    t.optimizer.step = recording_step  # type: ignore[method-assign]
    stats = t.train_step(groups)
    assert len(seen) == 3 and t.version == 4

    ref = Trainer(TrainerConfig(loss="grpo"), str(tiny_model_dir))
    ref.model.eval()  # no dropout in the tiny model; eval only to say the reference never trains
    dev = ref.device  # the trainer's (`auto`: a GPU where there is one)

    def logp_of(s: Sample) -> torch.Tensor:  # one unpadded sequence: log p of each response token
        ids = torch.tensor([s.prompt_ids + s.response_ids], device=dev)
        logits = ref.model(input_ids=ids).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
        return lp[len(s.prompt_ids) - 1:]

    rewards = torch.tensor([g.rewards for g in groups], device=dev)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).reshape(-1)
    ref.model.load_state_dict(start)
    with torch.no_grad():
        prox = [logp_of(s) for s in samples]
    parts = balanced_parts([s.num_tokens for s in samples], 3)  # fake_groups: already in (group, index) order
    clipped = 0
    for (params, grads), part in zip(seen, parts, strict=True):
        ref.model.load_state_dict(params)
        ref.model.zero_grad()
        total, n = torch.zeros((), device=dev), 0
        for i in part:
            s = samples[i]
            lp = logp_of(s)
            behav = torch.tensor(s.logprobs, device=dev)
            r, w = torch.exp(lp - prox[i]), torch.exp(prox[i] - behav)
            surr = torch.minimum(r * adv[i], r.clamp(0.8, 1.2) * adv[i])
            clipped += int(((r.detach() - 1).abs() > 0.2).sum()) if adv[i] != 0 else 0
            total = total - (w * surr).sum()
            n += s.num_tokens
        (total / n).backward()
        for got, p in zip(grads, ref.model.parameters(), strict=True):
            want = p.grad if p.grad is not None else torch.zeros_like(p)
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)
    assert any(g.abs().max() > 1e-4 for g in seen[2][1])
    assert clipped > 0 and stats["clip_frac"] > 0  # the clip binds from the second step on


def test_one_step_per_batch_never_clips_and_minibatches_in_parts_match_whole(tiny_model_dir: Path) -> None:
    """With one step pi_theta = pi_prox, so decoupled PPO's clip cannot bind; with two it does. The
    run loop's parts (pi_prox recorded per part, the steps at finish_step) give the same as whole."""
    def run(n: int, parts: list[list[Group]]) -> tuple[dict, list[torch.Tensor]]:
        t = Trainer(TrainerConfig(lr=3e-2, ppo_minibatches=n, loss="decoupled_ppo"), str(tiny_model_dir))
        for part in parts:
            t.accumulate(part)
        return t.finish_step(), [p.detach().clone() for p in t.model.parameters()]

    groups = _stale(fake_groups(6, n_groups=4))
    one, _ = run(1, [groups])
    two, p_whole = run(2, [groups])
    # Parts in another order than the whole: the steps' split does not follow arrival order.
    two_parts, p_parts = run(2, [groups[3:], groups[:1], groups[1:3]])
    assert one["clip_frac"] == 0.0 and one["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert two["clip_frac"] > 0
    assert set(two_parts) == set(two)
    for k, v in two.items():  # (on a GPU, other summation orders: ~1e-5 on ratios of ~1 after an Adam step)
        assert two_parts[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    # Parameters after two AdamW steps. Adam turns float summation noise on near-zero gradients into
    # moves of up to ~lr (3e-2) for the few elements where it flips a sign: ~1e-4 at most on this CPU,
    # a few elements past 1e-3 on a GPU (other summation orders). A step on other samples (a split in
    # arrival order) moves most elements by ~1e-1.
    off = sum(int(((a - b).abs() > 1e-3).sum()) for a, b in zip(p_whole, p_parts, strict=True))
    assert off <= 0.01 * sum(p.numel() for p in p_whole), off


def test_bf16_autocast_and_checkpointing_keep_float32_weights_and_the_gradient(tiny_model_dir: Path) -> None:
    """`trainer.dtype: bfloat16` computes under autocast (the GPU setting) and `gradient_checkpointing`
    recomputes activations: the weights and AdamW's state stay float32, and the gradient is the
    float32 one up to bf16 rounding (checkpointing alone: the same to float noise)."""
    def grads(**kw: object) -> tuple[list[torch.Tensor], Trainer]:
        torch.manual_seed(0)
        t = Trainer(TrainerConfig(lr=1e-3, loss="grpo", **kw), str(tiny_model_dir))  # type: ignore[arg-type]
        t.train_step(fake_groups(3))
        return [p.grad.detach().clone().flatten() for p in t.model.parameters()], t

    ref, _ = grads()
    ckpt, _ = grads(gradient_checkpointing=True)
    bf16, t = grads(dtype="bfloat16", gradient_checkpointing=True)
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    assert all(v.dtype == torch.float32 for st in t.optimizer.state.values() for v in st.values() if v.dim() > 0)
    flat = [torch.cat(g) for g in (ref, ckpt, bf16)]
    torch.testing.assert_close(flat[1], flat[0], atol=1e-6, rtol=1e-4)
    assert not torch.allclose(flat[2], flat[0], atol=1e-6, rtol=1e-4)  # autocast did compute in bf16
    assert torch.nn.functional.cosine_similarity(flat[2], flat[0], dim=0) > 0.97  # and kept the direction
