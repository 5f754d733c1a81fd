"""Token logprobs from a causal LM, and packing `Sample` records into padded training tensors.

This module owns the one alignment convention the trainer relies on: every per-token tensor is
``[B, T]`` and aligned with ``input_ids`` (prompt followed by response, right-padded), so that
``x[:, t]`` describes the token ``input_ids[:, t]``. Behaviour logprobs from the engine, logprobs
recomputed here, versions and the loss mask therefore line up position by position, with no shift.

It is pure torch: no Ray, no HTTP, no optimiser. It knows the HF causal-LM call convention
(``model(input_ids=..., attention_mask=...).logits``) and nothing about how samples were generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from streamrl.types import Sample

# Rows of vocab-wide logits upcast to fp32 at a time: 2**26 floats = 256 MiB per chunk, whatever
# the vocabulary size, so the fp32 working set stays bounded when the model emits bf16 logits.
_CHUNK_ELEMENTS = 1 << 26


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Return ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` in fp32, shape ``[B, T]``.

    The distribution is ``softmax(logits / temperature)``, matching an engine sampling at that
    temperature. ``out[:, 0]`` is 0 (nothing predicts the first token) and so are padding
    positions. Batches must be right-padded: real tokens then sit at positions 0..L-1 and never
    attend to padding, so each row equals an unpadded forward of that sequence.

    Differentiable with respect to the model's parameters when called under grad mode.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"want input_ids and attention_mask of one [B, T] shape, got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    B, T = input_ids.shape
    # use_cache=False: a training forward must not allocate a KV cache it will never read.
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, V]
    V = logits.shape[-1]
    flat = logits.reshape(B * T, V)  # [B*T, V], a view for the usual contiguous logits
    # Position t predicts token t+1; the last position's label is a dummy whose result is dropped.
    next_ids = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1).reshape(B * T, 1)  # [B*T, 1]

    # log p(label) = logit[label]/temp - logsumexp(logits/temp): gathers one logit per token instead
    # of materialising a [B, T, V] log_softmax; upcasting chunk by chunk bounds the fp32 copy.
    chunk = max(1, _CHUNK_ELEMENTS // V)
    pieces: list[torch.Tensor] = []
    for start in range(0, B * T, chunk):
        rows = flat[start : start + chunk].float()  # [c, V] fp32
        if temperature != 1.0:
            rows = rows / temperature
        label = rows.gather(1, next_ids[start : start + chunk]).squeeze(1)  # [c]
        pieces.append(label - torch.logsumexp(rows, dim=1))  # [c]
    shifted = torch.cat(pieces).view(B, T)  # [B, T]; shifted[:, t] = log p(input_ids[:, t+1])

    out = torch.cat([shifted.new_zeros(B, 1), shifted[:, :-1]], dim=1)  # [B, T]
    return out * attention_mask.to(out.dtype)  # [B, T]; zero at padding


@dataclass(kw_only=True)
class Batch:
    """Padded tensors for a list of samples; every tensor below is ``[B, T]`` unless noted.

    ``input_ids`` is prompt followed by response, right-padded with ``pad_id``. Per-token fields are
    aligned with ``input_ids`` (see the module docstring), so the behaviour logprob of response
    token ``j`` of row ``b`` sits at ``[b, prompt_len[b] + j]``.
    """

    input_ids: torch.Tensor  # long
    attention_mask: torch.Tensor  # long, 1 on real tokens (prompt and response)
    response_mask: torch.Tensor  # bool, True on response tokens whose loss_mask is 1
    behav_logp: torch.Tensor  # fp32, engine logprobs at response positions, 0 elsewhere
    versions: torch.Tensor  # long, weight version at response positions, -1 elsewhere
    advantages: torch.Tensor  # fp32 [B], one per sequence; zeros until the trainer fills it
    rewards: torch.Tensor  # fp32 [B]; a missing reward (None) packs as 0
    prompt_lens: torch.Tensor  # long [B]
    response_lens: torch.Tensor  # long [B]

    @property
    def num_loss_tokens(self) -> int:
        """Tokens that contribute to the loss. Forces a device sync when the batch is on GPU."""
        return int(self.response_mask.sum().item())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def pack_samples(samples: Sequence[Sample], pad_id: int, device: torch.device | str = "cpu") -> Batch:
    """Pack samples into a right-padded `Batch` of width ``max(len(prompt) + len(response))``.

    Tokens with ``loss_mask == 0`` (tool or environment output) are attended to but excluded from
    ``response_mask``; their behaviour logprobs and versions are still copied so the stats that
    read them stay complete.
    """
    if not samples:
        raise ValueError("pack_samples needs at least one sample")
    B = len(samples)
    T = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    if T == 0:
        raise ValueError("every sample is empty")

    # Fill plain Python lists then convert once: one host-to-device copy per field, not per row.
    ids = [[pad_id] * T for _ in range(B)]
    attn = [[0] * T for _ in range(B)]
    resp = [[False] * T for _ in range(B)]
    behav = [[0.0] * T for _ in range(B)]
    vers = [[-1] * T for _ in range(B)]
    for b, s in enumerate(samples):
        P, R = len(s.prompt_ids), len(s.response_ids)
        if not (len(s.logprobs) == len(s.versions) == len(s.loss_mask) == R):
            raise ValueError(
                f"sample {s.group_id}/{s.index}: {R} response tokens but {len(s.logprobs)} logprobs, "
                f"{len(s.versions)} versions, {len(s.loss_mask)} loss_mask entries"
            )
        ids[b][:P] = s.prompt_ids
        ids[b][P : P + R] = s.response_ids
        attn[b][: P + R] = [1] * (P + R)
        resp[b][P : P + R] = [bool(m) for m in s.loss_mask]
        behav[b][P : P + R] = s.logprobs
        vers[b][P : P + R] = s.versions

    return Batch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),  # [B, T]
        attention_mask=torch.tensor(attn, dtype=torch.long, device=device),  # [B, T]
        response_mask=torch.tensor(resp, dtype=torch.bool, device=device),  # [B, T]
        behav_logp=torch.tensor(behav, dtype=torch.float32, device=device),  # [B, T]
        versions=torch.tensor(vers, dtype=torch.long, device=device),  # [B, T]
        advantages=torch.zeros(B, dtype=torch.float32, device=device),  # [B]
        rewards=torch.tensor(
            [s.reward if s.reward is not None else 0.0 for s in samples], dtype=torch.float32, device=device
        ),  # [B]
        prompt_lens=torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long, device=device),
        response_lens=torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long, device=device),
    )
