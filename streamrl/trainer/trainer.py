"""The policy trainer: one optimizer step per batch of groups, and the weights that go back to engines.

`train_step(groups)` is synchronous torch code; the run loop calls it in the trainer's own worker
thread (with its own torch thread count) so that generation keeps going on the event loop meanwhile.
Per step: group-normalised advantages -> pack -> one forward with grad gives pi_theta; since the
weights have not moved yet, its detached value *is* the proximal policy pi_prox (no second forward)
-> loss (GRPO / decoupled PPO / TIS) -> AdamW with gradient clipping -> version + 1.
The mismatch between recomputed and behaviour logprobs of tokens produced by the *current* version is
logged: on-policy it must be ~0, a built-in check that engine and trainer compute the same model.

The trainer knows nothing about engines, HTTP or Ray: it returns tensors and numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..types import Group
from .logprobs import pack_samples, token_logprobs
from .losses import LossConfig, group_advantages, policy_loss


@dataclass(kw_only=True)
class TrainerSettings:
    lr: float = 3e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss: LossConfig
    temperature: float = 1.0  # the rollout temperature: logprobs are compared at the same T
    device: str = "cpu"
    ref_model_path: str | None = None  # KL reference (only loaded when loss.kl_coef > 0)


class Trainer:
    def __init__(self, model_path: str, settings: TrainerSettings, *, version: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.settings = settings
        self.device = settings.device
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay, betas=(0.9, 0.999)
        )
        self.ref_model = None
        if settings.loss.kl_coef > 0:
            ref = AutoModelForCausalLM.from_pretrained(settings.ref_model_path or model_path, dtype=torch.float32)
            self.ref_model = ref.to(self.device).eval().requires_grad_(False)
        self.version = version

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        cfg = self.settings.loss
        samples = [s for g in groups for s in g.samples]
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [G, n]
        adv = group_advantages(rewards).reshape(-1)  # [G*n]
        batch = pack_samples(samples, self.pad_id, self.device)
        mask = batch.response_mask  # [B, T]
        logp = token_logprobs(self.model, batch.input_ids, batch.attention_mask, self.settings.temperature)
        prox = logp.detach()
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = token_logprobs(self.ref_model, batch.input_ids, batch.attention_mask, self.settings.temperature)
        loss, stats = policy_loss(
            logp, batch.behav_logp, adv.to(self.device), mask, cfg,
            prox_logp=None if cfg.kind == "grpo" else prox, ref_logp=ref,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # max_norm=inf measures the norm without clipping (grad_clip 0 = off).
        clip = self.settings.grad_clip if self.settings.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()

        # One host sync for all logged numbers.
        cur = mask & (batch.versions == self.version)
        diff = (prox - batch.behav_logp).abs()
        stale = (self.version - batch.versions).clamp(min=0)
        nums = torch.stack([
            (diff * cur).sum() / cur.sum().clamp(min=1),
            (diff * mask).sum() / mask.sum().clamp(min=1),
            (stale * mask).sum() / mask.sum().clamp(min=1),
            torch.where(mask, stale, torch.zeros_like(stale)).max() if mask.any() else torch.zeros(()),
            grad_norm.detach().float(),
            cur.sum().float(),
        ]).tolist()
        self.version += 1
        stats.update(
            # Only tokens of the current version can be compared like for like; None if there are none.
            logprob_mismatch=nums[0] if nums[5] > 0 else None, logprob_diff_all=nums[1], staleness_mean=nums[2],
            staleness_max=nums[3], grad_norm=nums[4] if math.isfinite(nums[4]) else float("nan"),
            reward_mean=float(rewards.mean()), trained_samples=len(samples), trained_tokens=int(mask.sum()),
        )
        return stats

    def state_dict_for_engines(self) -> dict[str, torch.Tensor]:
        """Detached tensors the engines copy from; valid until the next train_step mutates them."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        return out

    def checkpoint_state(self) -> dict[str, Any]:
        return {"version": self.version, "optimizer": self.optimizer.state_dict()}
