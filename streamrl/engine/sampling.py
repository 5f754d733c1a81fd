"""Batched token sampling with per-request parameters and per-request seeds.

The logprob reported for a token is log softmax(logits / T) at that token, *before* top-k/top-p/min-p
truncation (T = 1 for greedy requests), so that a trainer recomputing it from the same weights at the
same temperature gets the same number. Sampling uses the exponential-race trick
(argmax p_i / E_i with E_i ~ Exp(1)), which draws exactly from p and lets each seeded request own its
noise stream: a seeded request samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row sampling settings, built by the engine from each request's SamplingParams."""

    temperatures: list[float]  # 0 for greedy rows
    top_ps: list[float]
    top_ks: list[int]
    min_ps: list[float]
    generators: list[torch.Generator | None]  # a request's own stream when it has sampling_seed

    @property
    def all_greedy(self) -> bool:
        return all(t < 1e-6 for t in self.temperatures)

    @property
    def needs_filter(self) -> bool:
        return any(p < 1.0 for p in self.top_ps) or any(k > 0 for k in self.top_ks) or any(
            m > 0 for m in self.min_ps
        )


def sample(
    logits: torch.Tensor, batch: SamplingBatch, shared_gen: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (token_ids [B], logprobs [B]) for logits [B, V]."""
    logits = logits.float()
    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)  # [B]
        logp = torch.log_softmax(logits, dim=-1)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1)

    device = logits.device
    greedy = torch.tensor([t < 1e-6 for t in batch.temperatures], device=device)  # [B]
    temps = torch.tensor([t if t >= 1e-6 else 1.0 for t in batch.temperatures], device=device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)  # [B, V], untruncated
    probs = logp.exp()
    if batch.needs_filter:
        probs = _filter(probs, batch)

    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(batch.generators) if g is None]
    if unseeded:
        # One draw for all unseeded rows keeps the common case to a single kernel.
        noise[unseeded] = torch.empty((len(unseeded), probs.shape[1]), device=device).exponential_(
            generator=shared_gen
        )
    for i, g in enumerate(batch.generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    sampled = (probs / noise).argmax(dim=-1)  # [B]
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def _filter(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Zero out tokens removed by top-k, top-p and min-p (SGLang's order: k, then p, then min-p)."""
    device = probs.device
    vocab = probs.shape[1]
    top_ks = torch.tensor([k if k > 0 else vocab for k in batch.top_ks], device=device)  # [B]
    top_ps = torch.tensor(batch.top_ps, device=device)  # [B]
    min_ps = torch.tensor(batch.min_ps, device=device)  # [B]

    sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(vocab, device=device)[None, :]  # [1, V]
    keep = rank < top_ks[:, None]
    sorted_p = sorted_p * keep
    # Keep the smallest prefix whose mass reaches top_p; the first token always survives.
    cum_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep = keep & (cum_before < top_ps[:, None] * sorted_p.sum(-1, keepdim=True))
    keep = keep & (sorted_p >= min_ps[:, None] * sorted_p[:, :1])
    keep[:, 0] = True
    filtered = torch.zeros_like(probs)
    filtered.scatter_(1, order, sorted_p * keep)
    return filtered
