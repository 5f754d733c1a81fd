"""Policy-gradient objectives for (possibly off-policy) LLM RL: GRPO advantages, PPO clip, AReaL's
decoupled PPO, truncated importance sampling (TIS), and a k3 KL penalty.

Three log-probabilities of the same tokens appear here:
  * ``logp``       — the policy being optimised (pi_theta); the only input gradients flow into.
  * ``old_logp``   — the behaviour policy (pi_behav): whatever weights the engine sampled with,
                     possibly several versions stale and from a different numeric stack.
  * ``prox_logp``  — the proximal policy (pi_prox): the trainer's own weights before this update,
                     recomputed by the trainer. Decoupled PPO clips against it instead of pi_behav.

Every per-token tensor is ``[B, T]`` and aligned with the packed ``input_ids`` (see
`streamrl.trainer.logprobs`). The module owns the arithmetic only: it never runs a model, never
decides staleness, and never knows where the logprobs came from.
"""

from __future__ import annotations

import torch

from ..config import TrainerConfig


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, std_normalize: bool = True) -> torch.Tensor:
    """GRPO advantages ``(r - mean_g) / (std_g + eps)`` for rewards ``[G, n]`` (G groups of n).

    ``std_g`` is the *sample* standard deviation (Bessel-corrected, ``unbiased=True``), which is
    TRL's convention (``rewards.view(-1, n).std(dim=1)`` with torch's default). A group of one
    sample has no spread; its std is taken as 0, so its advantage is 0 rather than NaN. With
    ``std_normalize=False`` only the mean is removed (Dr. GRPO).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, n], got shape {tuple(rewards.shape)}")
    r = rewards if rewards.is_floating_point() else rewards.float()  # [G, n]
    centred = r - r.mean(dim=1, keepdim=True)  # [G, n]
    if not std_normalize:
        return centred
    n = r.shape[1]
    std = r.std(dim=1, keepdim=True, correction=1) if n > 1 else torch.zeros_like(r[:, :1])  # [G, 1]
    return centred / (std + eps)  # [G, n]


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: TrainerConfig,
    prox_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return the scalar loss to minimise and a dict of Python-float stats.

    `cfg` is the trainer's section; the loss reads ``loss`` (the kind), ``clip_eps``,
    ``clip_eps_high``, ``behav_imp_weight_cap``, ``tis_cap`` and ``kl_coef``, bounded by the schema:
      * ``grpo``: PPO clip of pi_theta against the behaviour policy (on-policy GRPO/DAPO).
      * ``decoupled_ppo``: AReaL eq. 5, PPO clip against pi_prox, weighted by pi_prox/pi_behav; tokens
        whose weight exceeds ``behav_imp_weight_cap`` get weight 0 but still count in the denominator.
      * ``tis``: PPO clip against pi_prox, weighted by min(pi_prox/pi_behav, tis_cap) (Yao et al.).
    The ratio is clipped to ``[1 - clip_eps, 1 + clip_eps_high]`` (``clip_eps_high`` null = ``clip_eps``).

    Shapes: ``logp``, ``old_logp`` (behaviour), ``mask``, ``prox_logp``, ``ref_logp`` are ``[B, T]``;
    ``advantages`` is ``[B, T]`` or ``[B]`` (one per sequence, broadcast over tokens).

    Aggregation is token-level (DAPO): the per-token losses are summed over every token with
    ``mask`` set and divided by the number of such tokens, so long responses weigh per token, not
    per sequence. Only ``logp`` receives gradients; every other input is detached here.

    Stats (means over masked tokens): ``clip_frac`` (the clipped branch was taken), ``ratio_mean``
    (the ratio that is clipped: pi_theta/pi_behav for grpo, pi_theta/pi_prox otherwise),
    ``imp_weight_mean`` (the behaviour weight actually applied; 1 for grpo), ``cap_frac`` (tokens
    whose behaviour weight exceeded the cap: dropped for decoupled_ppo, truncated for tis), ``kl``
    (k3 to the reference; 0 without one), plus ``pg_loss``, ``loss`` and ``num_tokens``.

    Reading the stats synchronises with the device once per call.
    """
    _check_shapes(logp, cfg, old_logp=old_logp, mask=mask, prox_logp=prox_logp, ref_logp=ref_logp)
    m = mask.bool()  # [B, T]
    mf = m.to(logp.dtype)  # [B, T]
    # Clamped so an all-masked micro-batch gives loss 0 with an intact graph instead of NaN.
    n_tok = mf.sum().clamp(min=1.0)  # scalar; stays on device
    adv = advantages.detach().to(logp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logp)  # [B] -> [B, T]
    elif adv.shape != logp.shape:
        raise ValueError(f"advantages must be [B] or [B, T], got shape {tuple(advantages.shape)}")
    behav = old_logp.detach()  # [B, T]

    # The ratio is taken against pi_behav for grpo and against pi_prox for the off-policy kinds.
    if cfg.loss == "grpo":
        anchor = behav  # [B, T]
    elif prox_logp is None:
        raise ValueError(f"loss kind {cfg.loss!r} needs prox_logp (the trainer's pre-update logprobs)")
    else:
        anchor = prox_logp.detach()  # [B, T]
    # Zero the log-ratio off the mask *before* exp: padding or prompt positions may hold values
    # whose exp overflows, and inf * 0 in backward would turn the gradient NaN.
    log_ratio = torch.where(m, logp - anchor, 0.0)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    clip_high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    clipped = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + clip_high)  # [B, T]
    surr = -adv * ratio  # [B, T]
    surr_clipped = -adv * clipped  # [B, T]
    pg_tok = torch.maximum(surr, surr_clipped)  # [B, T]; = -min(rA, clip(r)A)
    clip_taken = (surr_clipped > surr) & m  # [B, T]

    weight, over_cap = _behaviour_weight(cfg, m, anchor, behav)  # [B, T] each
    pg_tok = pg_tok * weight  # [B, T]

    pg_loss = (pg_tok * mf).sum() / n_tok  # scalar
    loss = pg_loss
    kl = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None:
        # k3 estimator of KL(pi_theta || pi_ref) (Schulman): non-negative and low-variance per token.
        delta = torch.where(m, ref_logp.detach() - logp, 0.0)  # [B, T]
        kl = ((torch.exp(delta) - delta - 1.0) * mf).sum() / n_tok  # scalar
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl

    return loss, _stats(mf, n_tok, loss=loss, pg_loss=pg_loss, kl=kl, clip_frac=clip_taken.to(mf.dtype),
                        ratio_mean=ratio, imp_weight_mean=weight, cap_frac=over_cap.to(mf.dtype))


def _check_shapes(logp: torch.Tensor, cfg: TrainerConfig, **others: torch.Tensor | None) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logp has {tuple(logp.shape)}")
    if cfg.kl_coef > 0 and others.get("ref_logp") is None:
        raise ValueError("kl_coef > 0 needs ref_logp")


def _behaviour_weight(cfg: TrainerConfig, m: torch.Tensor, anchor: torch.Tensor,
                      behav: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The behaviour importance weight pi_prox/pi_behav as the loss kind applies it, a constant per
    token (never differentiated), and the tokens whose weight left the cap. All [B, T]."""
    if cfg.loss == "grpo":
        return torch.ones_like(anchor), torch.zeros_like(m)
    w = torch.exp(torch.where(m, anchor - behav, 0.0))  # [B, T]
    if cfg.loss == "decoupled_ppo":
        cap = cfg.behav_imp_weight_cap
        over_cap = (w > cap) & m if cap is not None else torch.zeros_like(m)  # [B, T]
        return torch.where(over_cap, 0.0, w), over_cap
    over_cap = (w > cfg.tis_cap) & m  # [B, T]
    return w.clamp(max=cfg.tis_cap), over_cap


def _stats(mf: torch.Tensor, n_tok: torch.Tensor, *, loss: torch.Tensor, pg_loss: torch.Tensor, kl: torch.Tensor,
           **per_token: torch.Tensor) -> dict[str, float]:
    """The scalars, and each per-token tensor's mean over the masked tokens, as Python floats."""
    with torch.no_grad():
        named = {"loss": loss, "pg_loss": pg_loss, "kl": kl,
                 **{k: (v * mf).sum() / n_tok for k, v in per_token.items()}, "num_tokens": mf.sum()}
        # One stack + tolist: a single device-to-host sync instead of one per stat.
        values = torch.stack([v.detach().to(torch.float64) for v in named.values()]).tolist()
    return dict(zip(named, values, strict=True))
