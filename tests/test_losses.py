"""Tests for streamrl.trainer.losses and streamrl.trainer.logprobs.

The loss references below are deliberately written another way than the module: plain Python
floats, explicit loops over tokens, ``min`` of the two surrogates instead of ``max`` of their
negatives, and hand-derived gradients.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from streamrl.config import TrainerConfig
from streamrl.trainer import logprobs as logprobs_mod
from streamrl.trainer.logprobs import Batch, pack_samples, token_logprobs
from streamrl.trainer.losses import group_advantages, policy_loss
from streamrl.types import Sample

B, T = 4, 9


def _ref_loss(
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: TrainerConfig,
    prox: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
) -> tuple[float, list[list[float]]]:
    """Loop reference: (loss, d loss / d logp[b][t])."""
    lo, hi = 1.0 - cfg.clip_eps, 1.0 + (cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high)
    rows, cols = logp.shape
    count = sum(1 for b in range(rows) for t in range(cols) if mask[b, t])
    denom = max(count, 1)
    total, kl_total = 0.0, 0.0
    grad = [[0.0] * cols for _ in range(rows)]
    for b in range(rows):
        for t in range(cols):
            if not mask[b, t]:
                continue
            lp, lb = float(logp[b, t]), float(old[b, t])
            a = float(adv[b]) if adv.dim() == 1 else float(adv[b, t])
            if cfg.loss == "grpo":
                r, w = math.exp(lp - lb), 1.0
            else:
                lq = float(prox[b, t])
                r, w = math.exp(lp - lq), math.exp(lq - lb)
                if cfg.loss == "decoupled_ppo" and cfg.behav_imp_weight_cap is not None:
                    w = 0.0 if w > cfg.behav_imp_weight_cap else w
                if cfg.loss == "tis":
                    w = min(w, cfg.tis_cap)
            rc = min(max(r, lo), hi)
            unclipped, clipped = r * a, rc * a
            total += -w * min(unclipped, clipped)
            # d/dlogp of -w*r*a is -w*a*r; the clipped branch is flat in logp.
            g = -w * a * r if unclipped <= clipped else 0.0
            if ref is not None:
                d = float(ref[b, t]) - lp
                kl_total += math.exp(d) - d - 1.0
                g += cfg.kl_coef * (1.0 - math.exp(d))
            grad[b][t] = g / denom
    return total / denom + cfg.kl_coef * kl_total / denom, grad


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    old = -rnd(B, T).abs() - 0.1  # [B, T] behaviour logprobs
    prox = old + 0.3 * rnd(B, T)  # [B, T]
    logp = prox + 0.3 * rnd(B, T)  # [B, T]; spread wide enough that some ratios clip
    ref = logp + 0.2 * rnd(B, T)  # [B, T]
    adv = rnd(B, T)  # [B, T]
    mask = torch.rand(B, T, generator=g) < 0.7  # [B, T]
    mask[:, 0] = False
    mask[-1] = False  # one fully masked row
    return {"logp": logp, "old": old, "prox": prox, "ref": ref, "adv": adv, "mask": mask}


CASES = [
    TrainerConfig(loss="grpo"),
    TrainerConfig(loss="grpo", clip_eps=0.1, clip_eps_high=0.28),
    TrainerConfig(loss="grpo", kl_coef=0.05),
    TrainerConfig(loss="decoupled_ppo"),
    TrainerConfig(loss="decoupled_ppo", behav_imp_weight_cap=1.2),
    TrainerConfig(loss="decoupled_ppo", clip_eps_high=0.3, kl_coef=0.1),
    TrainerConfig(loss="tis", tis_cap=1.2),
    TrainerConfig(loss="tis", tis_cap=2.0, kl_coef=0.02),
]


def _case_id(c: TrainerConfig) -> str:
    """The loss and the knobs that differ from the defaults, e.g. `tis-tis_cap=1.2`."""
    changed = {f: getattr(c, f) for f in c.__struct_fields__ if getattr(c, f) != getattr(TrainerConfig(), f)}
    return "-".join([c.loss, *(f"{k}={v}" for k, v in changed.items() if k != "loss")])


@pytest.mark.parametrize("cfg", CASES, ids=_case_id)
def test_policy_loss_matches_loop_reference(batch: dict[str, torch.Tensor], cfg: TrainerConfig) -> None:
    logp = batch["logp"].clone().requires_grad_(True)
    prox = batch["prox"] if cfg.loss != "grpo" else None
    ref = batch["ref"] if cfg.kl_coef > 0 else None
    loss, stats = policy_loss(
        logp, batch["old"], batch["adv"], batch["mask"], cfg, prox_logp=prox, ref_logp=ref
    )
    loss.backward()
    want, want_grad = _ref_loss(batch["logp"], batch["old"], batch["adv"], batch["mask"], cfg, prox, ref)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - want) <= 1e-6
    assert torch.allclose(logp.grad, torch.tensor(want_grad, dtype=torch.float64), atol=1e-6, rtol=0)
    assert stats["loss"] == pytest.approx(want, abs=1e-6)
    assert stats["num_tokens"] == batch["mask"].sum().item()
    assert all(isinstance(v, float) for v in stats.values())


def test_fixture_exercises_clipping_and_caps(batch: dict[str, torch.Tensor]) -> None:
    # Guards the reference test against a batch where no clip or cap ever fires.
    args = (batch["logp"], batch["old"], batch["adv"], batch["mask"])
    _, s = policy_loss(*args, TrainerConfig(loss="grpo"))
    assert 0.0 < s["clip_frac"] < 1.0
    _, s = policy_loss(
        *args, TrainerConfig(loss="decoupled_ppo", behav_imp_weight_cap=1.2), prox_logp=batch["prox"]
    )
    assert 0.0 < s["cap_frac"] < 1.0
    _, s = policy_loss(*args, TrainerConfig(loss="tis", tis_cap=1.2), prox_logp=batch["prox"])
    assert 0.0 < s["cap_frac"] < 1.0
    assert s["imp_weight_mean"] <= 1.2


def test_stats_match_hand_counts(batch: dict[str, torch.Tensor]) -> None:
    m = batch["mask"]
    cap = 1.2
    _, s = policy_loss(
        batch["logp"],
        batch["old"],
        batch["adv"],
        m,
        TrainerConfig(loss="decoupled_ppo", behav_imp_weight_cap=cap),
        prox_logp=batch["prox"],
        ref_logp=batch["ref"],
    )
    toks = [(b, t) for b in range(B) for t in range(T) if m[b, t]]
    w = [math.exp(float(batch["prox"][b, t] - batch["old"][b, t])) for b, t in toks]
    u = [math.exp(float(batch["logp"][b, t] - batch["prox"][b, t])) for b, t in toks]
    d = [float(batch["ref"][b, t] - batch["logp"][b, t]) for b, t in toks]
    assert s["cap_frac"] == pytest.approx(sum(x > cap for x in w) / len(toks), abs=1e-12)
    assert s["imp_weight_mean"] == pytest.approx(sum(x for x in w if x <= cap) / len(toks), abs=1e-9)
    assert s["ratio_mean"] == pytest.approx(sum(u) / len(toks), abs=1e-9)
    assert s["kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / len(toks), abs=1e-9)
    # kl_coef is 0: the KL is reported but not added.
    assert s["loss"] == pytest.approx(s["pg_loss"], abs=1e-12)


@pytest.mark.parametrize("cap", [None, 1.5])
def test_decoupled_equals_grpo_on_policy(batch: dict[str, torch.Tensor], cap: float | None) -> None:
    args = (batch["logp"], batch["old"], batch["adv"], batch["mask"])
    grpo, _ = policy_loss(*args, TrainerConfig(loss="grpo"))
    dec, s = policy_loss(
        *args, TrainerConfig(loss="decoupled_ppo", behav_imp_weight_cap=cap), prox_logp=batch["old"].clone()
    )
    assert abs(grpo.item() - dec.item()) <= 1e-12
    assert s["imp_weight_mean"] == pytest.approx(1.0) and s["cap_frac"] == 0.0


def test_tis_equals_decoupled_below_cap(batch: dict[str, torch.Tensor]) -> None:
    args = (batch["logp"], batch["old"], batch["adv"], batch["mask"])
    dec, _ = policy_loss(*args, TrainerConfig(loss="decoupled_ppo"), prox_logp=batch["prox"])
    tis, s = policy_loss(*args, TrainerConfig(loss="tis", tis_cap=100.0), prox_logp=batch["prox"])
    assert s["cap_frac"] == 0.0
    assert abs(dec.item() - tis.item()) <= 1e-12


@pytest.mark.parametrize("kind", ["grpo", "decoupled_ppo", "tis"])
def test_gradients_flow_only_through_logp(batch: dict[str, torch.Tensor], kind: str) -> None:
    t = {k: v.clone().requires_grad_(k != "mask") for k, v in batch.items()}
    loss, _ = policy_loss(
        t["logp"], t["old"], t["adv"], t["mask"], TrainerConfig(loss=kind, kl_coef=0.1), t["prox"], t["ref"]
    )
    loss.backward()
    assert t["logp"].grad is not None and t["logp"].grad.abs().sum() > 0
    assert (t["logp"].grad[~batch["mask"]] == 0).all()
    for name in ("old", "prox", "ref", "adv"):
        assert t[name].grad is None, name


def test_sequence_advantages_broadcast(batch: dict[str, torch.Tensor]) -> None:
    seq_adv = batch["adv"][:, 0]  # [B]
    args = (batch["logp"], batch["old"])
    a, _ = policy_loss(*args, seq_adv, batch["mask"], TrainerConfig())
    b, _ = policy_loss(*args, seq_adv[:, None].expand(B, T), batch["mask"], TrainerConfig())
    want, _ = _ref_loss(batch["logp"], batch["old"], seq_adv, batch["mask"], TrainerConfig())
    assert a.item() == pytest.approx(b.item(), abs=1e-12) == pytest.approx(want, abs=1e-12)


def test_masked_garbage_and_empty_mask_stay_finite(batch: dict[str, torch.Tensor]) -> None:
    logp = batch["logp"].clone()
    logp[~batch["mask"]] = 0.0
    old = batch["old"].clone()
    old[~batch["mask"]] = -1e4  # exp(logp - old) would overflow if it were not masked first
    logp.requires_grad_(True)
    loss, _ = policy_loss(
        logp, old, batch["adv"], batch["mask"], TrainerConfig(loss="tis"), prox_logp=old.clone()
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()

    empty = torch.zeros(B, T, dtype=torch.bool)
    logp.grad = None
    loss, s = policy_loss(logp, old, batch["adv"], empty, TrainerConfig())
    loss.backward()
    assert loss.item() == 0.0 and s["num_tokens"] == 0.0 and (logp.grad == 0).all()


def test_policy_loss_rejects_missing_inputs(batch: dict[str, torch.Tensor]) -> None:
    args = (batch["logp"], batch["old"], batch["adv"], batch["mask"])
    with pytest.raises(ValueError, match="prox_logp"):
        policy_loss(*args, TrainerConfig(loss="decoupled_ppo"))
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(*args, TrainerConfig(kl_coef=0.1))


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor(
        [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [2.0, 1.0, 0.0, 3.0]], dtype=torch.float64
    )
    adv = group_advantages(rewards)
    # Group 0: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 1/sqrt(3), so +-0.5 * sqrt(3).
    h = 0.5 * math.sqrt(3.0)
    assert torch.allclose(adv[0], torch.tensor([h, -h, -h, h], dtype=torch.float64), atol=1e-5)
    assert (adv[1] == 0).all()  # no spread, no signal
    for g, row in enumerate(rewards.tolist()):
        mu, sd = statistics.fmean(row), statistics.stdev(row)  # stdev is the n-1 sample std
        for i, r in enumerate(row):
            assert adv[g, i].item() == pytest.approx((r - mu) / (sd + 1e-6), abs=1e-9)
    centred = group_advantages(rewards, std_normalize=False)
    assert centred[2].tolist() == pytest.approx([0.5, -0.5, -1.5, 1.5])
    assert (group_advantages(torch.tensor([[1.0], [0.0]])) == 0).all()  # a group of one
    assert group_advantages(torch.tensor([[1, 0]])).dtype == torch.float32


# ---------------------------------------------------------------- logprobs


def _tiny_qwen2(attn: str) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = attn
    return Qwen2ForCausalLM(cfg).eval()


def _padded(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])  # [B, T]
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])  # [B, T]
    return ids, attn


SEQS = [[3, 7, 1, 9, 4], [5, 2, 8, 8, 6, 1, 0, 7, 3, 2, 11], [12, 4, 30]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_unpadded_forward(attn: str, temperature: float) -> None:
    model = _tiny_qwen2(attn)
    ids, mask = _padded(SEQS, pad_id=31)
    with torch.no_grad():
        got = token_logprobs(model, ids, mask, temperature=temperature)  # [B, T]
        assert got.dtype == torch.float32 and got.shape == ids.shape
        for b, seq in enumerate(SEQS):
            logits = model(input_ids=torch.tensor([seq])).logits[0].float()  # [L, V]
            logp = torch.log_softmax(logits / temperature, dim=-1)  # [L, V]
            want = [0.0] + [logp[t - 1, seq[t]].item() for t in range(1, len(seq))]
            assert torch.allclose(got[b, : len(seq)], torch.tensor(want), atol=1e-5, rtol=0)
            assert (got[b, len(seq) :] == 0).all()


def test_token_logprobs_chunking_and_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_qwen2("sdpa")
    ids, mask = _padded(SEQS, pad_id=0)
    with torch.no_grad():
        whole = token_logprobs(model, ids, mask, temperature=0.9)
    monkeypatch.setattr(logprobs_mod, "_CHUNK_ELEMENTS", 3 * 32)  # 3 rows per chunk, ragged tail
    chunked = token_logprobs(model, ids, mask, temperature=0.9)
    assert torch.allclose(whole, chunked, atol=1e-6, rtol=0)
    chunked.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError):
        token_logprobs(model, ids, mask, temperature=0.0)


# ---------------------------------------------------------------- packing


def _sample(
    prompt: list[int], resp: list[int], loss_mask: list[int], version: int, reward: float | None
) -> Sample:
    return Sample(
        group_id="g",
        prompt_ids=prompt,
        response_ids=resp,
        logprobs=[-0.1 * (i + 1) for i in range(len(resp))],
        versions=[version + (i >= 2) for i in range(len(resp))],  # tokens 2.. came after a weight sync
        loss_mask=loss_mask,
        reward=reward,
    )


def test_pack_samples_alignment() -> None:
    samples = [
        _sample([1, 2, 3], [10, 11, 12, 13], [1, 0, 0, 1], version=4, reward=1.0),  # tokens 1-2: tool output
        _sample([5], [20, 21], [1, 1], version=2, reward=None),
        _sample([6, 7], [], [], version=0, reward=0.5),
    ]
    batch = pack_samples(samples, pad_id=99, device="cpu")
    assert isinstance(batch, Batch)
    assert batch.input_ids.tolist() == [
        [1, 2, 3, 10, 11, 12, 13],
        [5, 20, 21, 99, 99, 99, 99],
        [6, 7, 99, 99, 99, 99, 99],
    ]
    assert batch.attention_mask.tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0]]
    assert batch.response_mask.dtype == torch.bool
    assert batch.response_mask.int().tolist() == [[0, 0, 0, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0, 0], [0] * 7]
    assert batch.behav_logp[0].tolist() == pytest.approx([0, 0, 0, -0.1, -0.2, -0.3, -0.4])
    assert batch.behav_logp[1].tolist() == pytest.approx([0, -0.1, -0.2, 0, 0, 0, 0])
    assert batch.versions.tolist() == [
        [-1, -1, -1, 4, 4, 5, 5],
        [-1, 2, 2, -1, -1, -1, -1],
        [-1] * 7,
    ]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5]
    assert batch.advantages.shape == (3,) and (batch.advantages == 0).all()
    assert batch.prompt_lens.tolist() == [3, 1, 2] and batch.response_lens.tolist() == [4, 2, 0]
    assert batch.num_loss_tokens == 4
    # Each behaviour logprob sits where token_logprobs puts the recomputed logprob of that token.
    for b, s in enumerate(samples):
        for j, lp in enumerate(s.logprobs):
            assert batch.behav_logp[b, len(s.prompt_ids) + j].item() == pytest.approx(lp)
            assert batch.input_ids[b, len(s.prompt_ids) + j].item() == s.response_ids[j]
    moved = batch.to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids) and moved.versions.dtype == torch.long


def test_pack_samples_rejects_ragged_sample() -> None:
    bad = Sample(
        group_id="g", prompt_ids=[1], response_ids=[2, 3], logprobs=[-0.1], versions=[0, 0], loss_mask=[1, 1]
    )
    with pytest.raises(ValueError, match="logprobs"):
        pack_samples([bad], pad_id=0)
    with pytest.raises(ValueError):
        pack_samples([], pad_id=0)
