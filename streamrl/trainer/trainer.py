"""The policy trainer: optimizer steps on batches of groups, and the weights that go back to engines.

`train_step(groups)` is synchronous torch code; the run loop calls it in the trainer's own worker
thread (with its own torch thread count) so that generation keeps going on the event loop meanwhile.
Per step: group-normalised advantages -> pack -> one forward with grad gives pi_theta; since the
weights have not moved yet, its detached value *is* the proximal policy pi_prox (no second forward)
-> loss (GRPO / decoupled PPO / TIS) -> AdamW with gradient clipping -> version + 1. A step's batch
may come in parts (`accumulate` per part, then `finish_step`), so the trainer starts on the groups
that are ready while the rest of its batch is still generating.
With `ppo_minibatches` n > 1 (AReaL's ppo_n_minibatches) a batch takes n optimizer steps instead: a
no-grad forward per part records pi_prox, then each minibatch is a forward/backward and a step whose
ratio pi_theta/pi_prox moves away from 1 after the first, so decoupled PPO's clip can bind. The
engines still get one new version per batch.
The mismatch between recomputed and behaviour logprobs of tokens produced by the *current* version is
logged: on-policy it must be ~0, a built-in check that engine and trainer compute the same model.

The trainer knows nothing about engines, HTTP or Ray: it returns tensors and numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..batching import balanced_parts, length_buckets
from ..config import TrainerConfig
from ..devices import resolve_device
from ..types import Group, Sample
from ..weights.lora import Adapter
from .logprobs import Batch, pack_samples, token_logprobs
from .lora import adapter, lora_lr, save_merged, wrap
from .losses import group_advantages, policy_loss

OPTIMIZER_FILE = "optimizer.pt"


@dataclass
class _Step:
    """What `accumulate` has gathered for the step `finish_step` will take."""

    samples: list[Sample] = field(default_factory=list)
    rewards: list[torch.Tensor] = field(default_factory=list)
    adv: list[torch.Tensor] = field(default_factory=list)  # per part, one per sample
    prox: dict[int, torch.Tensor] = field(default_factory=dict)  # ppo_minibatches > 1: sample -> pi_prox
    n_loss: int = 0  # trainable tokens of every sample (the loss's denominator)
    n_trained: int = 0  # of those, the tokens actually computed (samples with a non-zero advantage)
    computed_samples: int = 0
    stat_sums: dict[str, float] = field(default_factory=dict)  # loss stats, each weighted by its tokens
    # |prox - behav| over current-version tokens, their count, |prox - behav| over all computed tokens
    sums: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))


class Trainer:
    # Samples whose advantage is exactly 0 are not computed (see `accumulate`): the same update. Tests
    # turn it off to compare against the full computation.
    skip_zero_advantage = True

    def __init__(self, cfg: TrainerConfig, model_path: str, *, temperature: float = 1.0,
                 ref_model_path: str | None = None, version: int = 0, optimizer_state: str | Path | None = None,
                 adapter_path: str | Path | None = None) -> None:
        """`temperature`: the rollout's (engines report logprobs at it; greedy ones at 1).
        `ref_model_path`: the KL reference (loaded only when `kl_coef > 0`; default `model_path`; with
        LoRA the base itself, adapters off).
        `optimizer_state`: an `optimizer.pt` written by `save(..., optimizer=True)`, to continue a run
        with AdamW's moments and step counts as they were (the model comes from `model_path`).
        `adapter_path`: with `cfg.lora`, the adapters to continue from (a checkpoint); `model_path` is the base."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self.temperature = temperature if temperature > 0 else 1.0
        self.device = resolve_device(cfg.device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self.lora = cfg.lora.rank > 0
        if self.lora:  # adapters on a frozen base: only they train, only they go to the engines
            self.model = wrap(self.model, cfg.lora, adapter_path)
        self.model.train()
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # bfloat16: the forward (and so the backward) under autocast; weights, gradients and AdamW's
        # moments stay float32.
        self._autocast = cfg.dtype == "bfloat16"
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # fused: one kernel for every parameter instead of a loop of small ops per tensor.
        self.optimizer = torch.optim.AdamW(
            self._params, lr=lora_lr(cfg.lora, cfg.lr) if self.lora else cfg.lr, weight_decay=cfg.weight_decay,
            betas=(0.9, 0.999),
            fused=_fused_ok(self.device),
        )
        if optimizer_state is not None:
            state = torch.load(optimizer_state, map_location=self.device, weights_only=True)
            self.optimizer.load_state_dict(state["optimizer"])
        self.ref_model = None
        if cfg.kl_coef > 0 and not self.lora:
            ref = AutoModelForCausalLM.from_pretrained(ref_model_path or model_path, dtype=torch.float32)
            self.ref_model = ref.to(self.device).eval().requires_grad_(False)
        self.version = version
        self._acc: _Step | None = None  # a step in progress (accumulate called, finish_step not yet)

    def micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices grouped by length: padded tokens per micro-batch stay under the budget and within
        `micro_batch_padding` of the real ones.

        A long-tail batch padded as one is mostly padding (43 % in bench/async_vs_sync.py's `think`
        task); buckets of similar length cut the trainer's work to about the real token count.
        """
        return length_buckets(lengths, max_padding=self.cfg.micro_batch_padding, max_tokens=self.cfg.micro_batch_tokens)

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step on a whole batch: `accumulate(groups)` then `finish_step()`."""
        self.accumulate(groups)
        return self.finish_step()

    def accumulate(self, groups: list[Group]) -> None:
        """Forward and backward on part of the next step's batch; gradients add up until `finish_step`.

        Why in parts: the run loop hands over the groups that may be trained while others of the same
        batch are still generating (a long sample due now), so the trainer computes instead of
        waiting. Each micro-batch's loss is scaled by its own token count here and the sum divided by
        the batch's count in `finish_step`: the token-level loss needs the whole batch's count, which
        is only known once the last part is in. Same update as one call on the whole batch (up to
        float summation order).
        """
        if self._acc is None:  # the step's first part
            self._acc = _Step()
            # set_to_none=False: a parameter keeps a (zero) gradient even when every sample is skipped,
            # so AdamW steps exactly as it would on the all-zero gradient of the full batch.
            self.optimizer.zero_grad(set_to_none=False)
        acc = self._acc
        samples = [s for g in groups for s in g.samples]
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [G, n]
        adv = group_advantages(rewards).reshape(-1)  # [G*n]; per group, so parts are independent
        base = len(acc.samples)
        acc.samples += samples
        acc.rewards.append(rewards.reshape(-1))
        acc.adv.append(adv)
        acc.n_loss += sum(sum(s.loss_mask) for s in samples)  # the denominator counts skipped samples too
        # A sample whose advantage is exactly 0 (its group's rewards all tie) adds 0 to the policy loss
        # and its gradient; only its tokens in the denominator matter. Skipping its forward/backward
        # leaves the same update (up to float summation order). Not with a KL term, which it feeds.
        skip = self.skip_zero_advantage and self.cfg.kl_coef == 0
        nonzero = (adv != 0).tolist()
        trained = [i for i in range(len(samples)) if nonzero[i] or not skip]
        acc.n_trained += sum(sum(samples[i].loss_mask) for i in trained)
        acc.computed_samples += len(trained)
        if self.cfg.ppo_minibatches == 1:
            for sel, batch in self._packed(samples, trained):
                self._loss_backward(acc, batch, adv[sel], None)
            return
        # Several steps per batch: pi_prox is these weights before the first of them, kept per sample.
        with torch.no_grad():
            for sel, batch in self._packed(samples, trained):
                logp = self._logprobs(self.model, batch)
                self._count_mismatch(acc, logp, batch)
                for row, i in enumerate(sel):
                    start = len(samples[i].prompt_ids)
                    acc.prox[base + i] = logp[row, start : start + samples[i].num_tokens].clone()

    def _logprobs(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        with torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16, enabled=self._autocast):
            return token_logprobs(model, batch.input_ids, batch.attention_mask, self.temperature)

    def _packed(self, samples: list[Sample], idx: list[int]) -> Iterator[tuple[list[int], Batch]]:
        """`samples[idx]` in length-bucketed micro-batches: (their indices, the packed batch)."""
        for mb in self.micro_batches([len(samples[i].prompt_ids) + samples[i].num_tokens for i in idx]):
            sel = [idx[j] for j in mb]
            yield sel, pack_samples([samples[i] for i in sel], self.pad_id, self.device)

    def _loss_backward(self, acc: _Step, batch: Batch, adv: torch.Tensor, prox: torch.Tensor | None) -> None:
        """Forward with grad, the policy loss, backward. `prox` None: the weights have not moved in this
        step, so this forward's own detached logprobs *are* pi_prox (no second forward)."""
        cfg = self.cfg
        mask = batch.response_mask  # [b, T]
        logp = self._logprobs(self.model, batch)
        if prox is None:
            prox = logp.detach()
            self._count_mismatch(acc, prox, batch)
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = self._logprobs(self.ref_model, batch)
        elif self.lora and cfg.kl_coef > 0:  # the reference is the base: these weights, adapters off
            with torch.no_grad(), self.model.disable_adapter():
                ref = self._logprobs(self.model, batch)
        loss, stats = policy_loss(
            logp, batch.behav_logp, adv.to(self.device), mask, cfg,
            prox_logp=None if cfg.loss == "grpo" else prox, ref_logp=ref,
        )
        # Token-level loss over the whole batch (or minibatch): each micro-batch weighs by its share of
        # tokens, n_mb / n_loss; the division comes with the optimizer step.
        n_mb = int(mask.sum())
        (loss * n_mb).backward()
        for k, v in stats.items():
            if k != "num_tokens":  # a count, not a mean: `computed_tokens` is the step's
                acc.stat_sums[k] = acc.stat_sums.get(k, 0.0) + v * n_mb

    def _count_mismatch(self, acc: _Step, prox: torch.Tensor, batch: Batch) -> None:
        mask = batch.response_mask
        cur = mask & (batch.versions == self.version)
        diff = (prox - batch.behav_logp).abs()
        acc.sums += torch.stack([(diff * cur).sum(), cur.sum(), (diff * mask).sum()]).double().cpu()

    def finish_step(self) -> dict[str, float]:
        """The optimizer step on everything accumulated since the last one; version + 1."""
        acc, self._acc = self._acc, None
        if acc is None:
            raise RuntimeError("finish_step without accumulate: no groups to train on")
        n_loss, n_trained = acc.n_loss, acc.n_trained
        if self.cfg.ppo_minibatches == 1:
            norms = [self._optimizer_step(n_loss)]
        else:
            adv = torch.cat(acc.adv)
            norms = [self._minibatch_step(acc, adv, idx) for idx in self._minibatches(acc) or [[]]]
        grad_norm = sum(norms) / len(norms)
        st_sum, st_max = _staleness(acc.samples, self.version)
        self.version += 1
        d, n_cur, d_all = (float(x) for x in acc.sums)
        # The losses are over every token (skipped ones add 0); the other stats describe the tokens
        # that were computed.
        agg = {k: v / max(n_loss if k in ("loss", "pg_loss") else n_trained, 1) for k, v in acc.stat_sums.items()}
        agg.setdefault("loss", 0.0)
        agg.setdefault("pg_loss", 0.0)
        agg.update(
            # Only tokens of the current version can be compared like for like; None if there are none.
            logprob_mismatch=d / n_cur if n_cur > 0 else None,
            logprob_diff_all=d_all / n_trained if n_trained > 0 else None,
            staleness_mean=st_sum / max(n_loss, 1), staleness_max=st_max,
            grad_norm=grad_norm if math.isfinite(grad_norm) else float("nan"),
            reward_mean=float(torch.cat(acc.rewards).mean()), trained_samples=len(acc.samples),
            trained_tokens=n_loss, skipped_samples=len(acc.samples) - acc.computed_samples,
            computed_tokens=n_trained,
        )
        return agg

    def _optimizer_step(self, n_loss: int) -> float:
        """Gradients summed over `n_loss` tokens -> their mean, clipped; one AdamW step; the norm."""
        for p in self._params:
            if p.grad is None:  # never computed yet (first step, everything skipped)
                p.grad = torch.zeros_like(p)
            else:
                p.grad.div_(max(n_loss, 1))
        # max_norm=inf measures the norm without clipping (grad_clip 0 = off).
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params, clip))
        self.optimizer.step()
        return grad_norm

    def _minibatches(self, acc: _Step) -> list[list[int]]:
        """The batch split for its optimizer steps. Split in (group, index) order, not arrival order, so
        that which samples share a step does not depend on which part of the batch came in first."""
        order = sorted(range(len(acc.samples)), key=lambda i: (acc.samples[i].group_id, acc.samples[i].index))
        parts = balanced_parts([sum(acc.samples[i].loss_mask) for i in order], self.cfg.ppo_minibatches)
        return [sorted(order[j] for j in part) for part in parts]

    def _minibatch_step(self, acc: _Step, adv: torch.Tensor, idx: list[int]) -> float:
        """One optimizer step on the minibatch `idx`, its ratio taken against the stored pi_prox."""
        self.optimizer.zero_grad(set_to_none=False)
        for sel, batch in self._packed(acc.samples, [i for i in idx if i in acc.prox]):
            prox = torch.zeros_like(batch.behav_logp)
            for row, i in enumerate(sel):
                start = len(acc.samples[i].prompt_ids)
                prox[row, start : start + acc.samples[i].num_tokens] = acc.prox[i]
            self._loss_backward(acc, batch, adv[sel], prox)
        return self._optimizer_step(sum(sum(acc.samples[i].loss_mask) for i in idx))

    def state_dict_for_engines(self) -> dict[str, torch.Tensor] | Adapter:
        """Detached tensors the engines copy from (with LoRA the adapters only); valid until the next
        train_step mutates them."""
        if self.lora:
            return adapter(self.model)
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save(self, out_dir: str | Path, *, optimizer: bool = False, merged: bool = False) -> Path:
        """The policy as a Hugging Face folder (with LoRA: the adapters in peft's format, and with
        `merged` the merged model in `merged/`); with `optimizer`, AdamW's state beside it
        (`optimizer.pt`), which a resumed run loads through `optimizer_state`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        if self.lora and merged:
            save_merged(self.model, out / "merged")
            self.tokenizer.save_pretrained(out / "merged")
        if optimizer:
            torch.save({"optimizer": self.optimizer.state_dict(), "version": self.version}, out / OPTIMIZER_FILE)
        return out


def _fused_ok(device: str) -> bool:
    """Fused AdamW exists for CPU and CUDA tensors (torch >= 2.4); other devices take the default."""
    return torch.device(device).type in ("cpu", "cuda")


def _staleness(samples: list[Sample], version: int) -> tuple[float, float]:
    """Sum and max of (version - token version) over the trainable tokens of every sample, skipped or not."""
    total, worst = 0, 0
    for s in samples:
        for v, m in zip(s.versions, s.loss_mask, strict=True):
            if m:
                total += max(0, version - v)
                worst = max(worst, version - v)
    return float(total), float(worst)
