"""Batched token sampling with per-request parameters and per-request seeds.

The logprob reported for a token is log softmax(logits / T) at that token, *before* top-k/top-p/min-p
truncation (T = 1 for greedy requests), so that a trainer recomputing it from the same weights at the
same temperature gets the same number. Sampling uses the exponential-race trick
(argmax p_i / E_i with E_i ~ Exp(1)), which draws exactly from p and lets each seeded request own its
noise stream: a seeded request samples the same tokens whatever else shares its batch.

On a GPU (the paged runner) the noise is counter-based instead: uniforms hashed from the request's
seed, the token's place in its output and the vocabulary index (`counter_uniforms`), drawn inside the
sampling kernel (engine/gpu/kernels.py) with no generator per request; `sample_counter` is the same
draw in PyTorch, for rows with top-k / top-p / min-p.
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


def counter_uniforms(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1), [B, V] float32, of (seeds[b], offsets[b]) for every vocabulary index: a
    32-bit integer hash (Wellons' lowbias32) in int64 arithmetic masked to 32 bits, bit for bit the
    noise of the GPU sampling kernel."""
    mask = 0xFFFFFFFF

    def mix(x: torch.Tensor) -> torch.Tensor:
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & mask
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & mask
        return x ^ (x >> 16)

    seeds = seeds.to(torch.int64)[:, None]
    lo, hi = seeds & mask, (seeds >> 32) & mask
    key = mix(lo ^ mix(hi ^ mix((offsets.to(torch.int64)[:, None] & mask) ^ 0x9E3779B9)))
    key2 = mix(key ^ 0x85EBCA6B)
    cols = torch.arange(vocab, dtype=torch.int64, device=seeds.device)[None, :]
    bits = mix(mix(cols ^ key) ^ key2)
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def sample_counter(logits: torch.Tensor, batch: SamplingBatch, seeds: list[int], offsets: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids [B], logprobs [B]) by the Gumbel-max trick over counter-based noise: argmax of
    log p + Gumbel(u), p after top-k / top-p / min-p; the logprob untruncated, as `sample`'s."""
    logits = logits.float()
    device = logits.device
    greedy = torch.tensor([t < 1e-6 for t in batch.temperatures], device=device)
    temps = torch.tensor([t if t >= 1e-6 else 1.0 for t in batch.temperatures], device=device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    probs = _filter(logp.exp(), batch) if batch.needs_filter else logp.exp()
    u = counter_uniforms(torch.tensor(seeds, device=device), torch.tensor(offsets, device=device), logits.shape[1])
    sampled = (probs.log() - (-u.log()).log()).argmax(dim=-1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
