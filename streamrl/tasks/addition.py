"""The built-in quickstart task: two-digit addition, ``"37+48="`` -> ``"85"``, with an exact-match reward,
and its warm start.

This module owns the prompt format, the deterministic train / held-out split, the reward, and the
supervised warm start that makes the quickstart's RL run learn: a *sloppy teacher*. Why: a clean
supervised run caught mid-transition gets worse under GRPO, while labels that are off by one half of
the time give a model that knows the sum but samples it inconsistently, which is what RL then fixes
(docs/benchmarks.md has the figures). Records have the shape ``{"prompt", "answer"}`` that
`streamrl.tasks.datasets.load_prompts` returns. It knows nothing of engines or the RL trainer.
"""

from __future__ import annotations

import inspect
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from .warm import cosine, load_for_training, loss_window, save_trained

LOW, HIGH = 10, 99  # operands are two-digit integers, both ends inclusive
EOS_TEXT = "<eos>"

Pair = tuple[int, int]


def make_prompt(a: int, b: int) -> str:
    """The prompt text for ``a + b`` (no ``<bos>``: the caller's tokenizer policy adds it)."""
    return f"{a}+{b}="


def make_answer(a: int, b: int) -> str:
    return str(a + b)


@dataclass(frozen=True)
class AdditionSplit:
    """Disjoint operand pairs: ``held_out`` pairs never appear in ``train``."""

    train: tuple[Pair, ...]
    held_out: tuple[Pair, ...]


def all_pairs() -> list[Pair]:
    return [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]


def split_pairs(seed: int = 0, held_out_fraction: float = 0.1) -> AdditionSplit:
    """Shuffle all 8,100 ordered pairs with ``seed`` and hold out a fraction of them.

    Ordered pairs are split independently, so ``(a, b)`` may be held out while ``(b, a)`` is trained
    on: the held-out set measures generalisation to unseen prompts, not to unseen sums.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    pairs = all_pairs()
    random.Random(seed).shuffle(pairs)
    n_held = round(len(pairs) * held_out_fraction)
    return AdditionSplit(train=tuple(sorted(pairs[n_held:])), held_out=tuple(sorted(pairs[:n_held])))


def to_records(pairs: tuple[Pair, ...] | list[Pair]) -> list[dict[str, str]]:
    return [{"prompt": make_prompt(a, b), "answer": make_answer(a, b)} for a, b in pairs]


def addition_prompts(
    split: Literal["train", "held_out"] = "train", *, seed: int = 0, held_out_fraction: float = 0.1
) -> list[dict[str, str]]:
    """Prompt records ``{"prompt": "37+48=", "answer": "85"}`` of one side of the split."""
    s = split_pairs(seed, held_out_fraction)
    if split == "train":
        return to_records(s.train)
    if split == "held_out":
        return to_records(s.held_out)
    raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")


def reward(response_text: str, answer: str) -> float:
    """1.0 iff the response, cut at its first ``<eos>`` and stripped of whitespace, equals ``answer``.

    ``response_text`` is the generated text only (not the prompt). Engines usually stop at eos and
    decode without special tokens, in which case the cut is a no-op; it is there so a response decoded
    with special tokens kept (``"85<eos><pad>"``) scores the same. Anything else is a miss: ``"85 "``
    scores 1.0, ``"85+1"`` and ``"085"`` score 0.0.
    """
    text = response_text.split(EOS_TEXT, 1)[0]
    return 1.0 if text.strip() == answer.strip() else 0.0


# ---- the warm start ---------------------------------------------------------------------------------
def _encode_batch(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]


def _build_examples(
    tokenizer: Any, pairs: Sequence[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded (inputs, targets, loss mask), each [n_pairs, 3, L]: labels sum-1, sum, sum+1 per pair.

    Precomputing the three label variants once makes a noisy batch a pure tensor gather per step.
    """
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    if bos is None or eos is None:
        raise ValueError("the warm start needs a tokenizer with bos and eos tokens")
    pad = eos if pad is None else pad
    prompts = _encode_batch(tokenizer, [make_prompt(a, b) for a, b in pairs])
    answers = _encode_batch(tokenizer, [str(a + b + d) for a, b in pairs for d in (-1, 0, 1)])
    seqs, starts = [], []
    for i, prompt in enumerate(prompts):
        for j in range(3):
            seqs.append([bos, *prompt, *answers[3 * i + j], eos])
            starts.append(1 + len(prompt))  # index of the first answer token in seq
    width = max(map(len, seqs))
    ids = torch.tensor([seq + [pad] * (width - len(seq)) for seq in seqs])  # one tensor op, not 22k
    lengths, first = torch.tensor([len(s) for s in seqs]), torch.tensor(starts)
    pos = torch.arange(width - 1)
    # targets are seq[1:], so answer token t is predicted at position t-1; eos is included.
    mask = (pos >= first[:, None] - 1) & (pos < lengths[:, None] - 1)
    shape = (len(pairs), 3, width - 1)
    return ids[:, :-1].reshape(shape), ids[:, 1:].reshape(shape), mask.reshape(shape)


@torch.no_grad()
def generate_responses(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    temperature: float,
    max_new_tokens: int = 8,
    *,
    batch_size: int = 512,
    seed: int = 0,
) -> list[str]:
    """Generated text per prompt (``<bos>`` + prompt in, text before the first eos out), batched.

    Prompts are bucketed by token length so a batch needs no padding, masks or position ids; decoding
    uses the model's KV cache. ``temperature <= 0`` is greedy.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    encoded = [([bos] if bos is not None else []) + ids for ids in _encode_batch(tokenizer, prompts)]
    buckets: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        buckets.setdefault(len(ids), []).append(i)
    gen = torch.Generator(device=device).manual_seed(seed)
    # transformers 5.2x renamed `past_key_values` to `cache` (the old name warns); support both.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out: list[str] = [""] * len(prompts)
    for indices in buckets.values():
        for lo in range(0, len(indices), batch_size):
            chunk = indices[lo : lo + batch_size]
            ids = torch.tensor([encoded[i] for i in chunk], device=device)  # [b, prompt_len]
            done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
            new: list[torch.Tensor] = []
            step_in, past = ids, None
            for _ in range(max_new_tokens):
                res = model(input_ids=step_in, use_cache=True, **{cache_kw: past})
                past = getattr(res, cache_kw)
                logits = res.logits[:, -1, :].float()  # [b, vocab]
                if temperature <= 0:
                    nxt = logits.argmax(-1)
                else:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
                if eos is not None:
                    nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
                    done |= nxt == eos
                new.append(nxt)
                step_in = nxt[:, None]
                if eos is not None and bool(done.all()):  # one host sync per token: fine at this size
                    break
            rows = torch.stack(new, dim=1).tolist()  # [b, generated]
            for i, row in zip(chunk, rows, strict=True):
                if eos is not None and eos in row:
                    row = row[: row.index(eos)]
                out[i] = tokenizer.decode(row, skip_special_tokens=True)
    model.train(was_training)
    return out


def evaluate_accuracy(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    answers: Sequence[str],
    temperature: float,
    max_new_tokens: int = 8,
    *,
    batch_size: int = 512,
    seed: int = 0,
) -> float:
    """Fraction of prompts whose response scores 1.0 under `streamrl.tasks.reward`."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    if not prompts:
        return 0.0
    responses = generate_responses(
        model, tokenizer, prompts, temperature, max_new_tokens, batch_size=batch_size, seed=seed
    )
    hits = sum(reward(r, a) for r, a in zip(responses, answers, strict=True))
    return hits / len(prompts)


def warm_start(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    steps: int = 1000,
    batch_size: int = 128,
    lr: float = 1e-3,
    label_noise: float = 0.5,
    seed: int = 0,
    device: str = "cpu",
    progress: Callable[[int, float], None] | None = None,
    warmup_steps: int = 0,
    weight_decay: float = 0.01,
    split_seed: int | None = None,
    eval_samples: int | None = None,
) -> dict[str, Any]:
    """Train ``model_dir`` on the addition TRAIN split with a sloppy teacher; save an HF folder to ``out_dir``.

    Each label is the true sum with probability ``1 - label_noise``, else the sum +1 or -1 (equally
    likely). AdamW with a cosine schedule; loss is the mean cross-entropy over answer tokens and eos.
    ``progress(step, loss)`` is called after every step. Returns metrics, including greedy and sampled
    (T=1) accuracy on held-out prompts (``eval_samples`` caps how many), also written to
    ``out_dir/warm_start.json``. The train / held-out split uses ``split_seed``, by default ``seed``, so
    a run that draws its RL prompts with ``addition_prompts(..., seed=seed)`` never warm-starts on them.
    """
    if not 0.0 <= label_noise <= 1.0:
        raise ValueError(f"label_noise must be in [0, 1], got {label_noise}")
    if steps < 1 or batch_size < 1:
        raise ValueError("steps and batch_size must be positive")
    split_seed = seed if split_seed is None else split_seed
    split = split_pairs(split_seed)
    model, tokenizer, save_dtype = load_for_training(model_dir, device)
    inputs, targets, masks = (t.to(device) for t in _build_examples(tokenizer, split.train))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine(s, steps, warmup_steps))
    model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        # All randomness comes from one CPU generator, so a run is reproducible on any device.
        rows = torch.randint(len(split.train), (batch_size,), generator=gen)
        noisy = torch.rand(batch_size, generator=gen) < label_noise
        sign = torch.randint(0, 2, (batch_size,), generator=gen) * 2 - 1
        variant = (1 + torch.where(noisy, sign, torch.zeros_like(sign))).to(device)
        rows = rows.to(device)
        x, y, m = inputs[rows, variant], targets[rows, variant], masks[rows, variant]  # [B, L-1]
        logits = model(input_ids=x, use_cache=False).logits  # [B, L-1, V]
        loss = F.cross_entropy(logits[m].float(), y[m])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step, losses[-1])
    train_s = time.perf_counter() - t0

    held = to_records(split.held_out)[:eval_samples]
    prompts, answers = [r["prompt"] for r in held], [r["answer"] for r in held]
    t1 = time.perf_counter()
    greedy = evaluate_accuracy(model, tokenizer, prompts, answers, temperature=0.0, seed=seed)
    sampled = evaluate_accuracy(model, tokenizer, prompts, answers, temperature=1.0, seed=seed)
    eval_s = time.perf_counter() - t1

    metrics: dict[str, Any] = {
        "steps": steps, "batch_size": batch_size, "lr": lr, "label_noise": label_noise, "seed": seed,
        "split_seed": split_seed, **loss_window(losses), "train_seconds": train_s, "eval_seconds": eval_s,
        "greedy_accuracy": greedy, "sampled_accuracy": sampled, "held_out_size": len(prompts),
    }
    return save_trained(model.to(save_dtype), tokenizer, out_dir, metrics)
