"""The judged quickstart's judge: a tiny reference-guided verifier trained offline to grade addition,
``"37+48=86;85>"`` -> ``"n"`` (the prompt, the response, ``;``, the reference answer; then its verdict,
``y`` or ``n``).

Like the model-based verifiers used for math RL, it is given the reference answer and judges whether
the response says the same thing, so it needs no arithmetic of its own. The responses it learns to
grade are what a policy writes on the way to learning addition (the right sum, padded with spaces,
sums off by one or more, other numbers, broken and empty answers), and its verdict is the addition
task's exact match (`addition.reward`), so where the judge is right it agrees with the rule reward.
The train / held-out split is the policy's: the judge never sees a held-out prompt either. This
module owns those examples, the warm start and its metrics; it knows nothing of engines or of how the
judge is served (streamrl/judge).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .addition import make_prompt, split_pairs
from .addition import reward as exact_match
from .tiny_model import BOS_ID, CHARS, EOS_ID, PAD_ID, char_tokenizer_ids
from .warm import cosine, loss_window, save_trained

TEMPLATE = "{prompt}{response};{answer}>"  # the judge's prompt: configs/judge.yaml's judge.prompt_template
_JUNK = [c for c in CHARS if c != ">"] + [">"]


def judge_text(a: int, b: int, response: str) -> str:
    """What the judge should write for `response` to ``a+b=``: ``y`` or ``n``, the exact match."""
    return "y" if exact_match(response, str(a + b)) == 1.0 else "n"


def sample_response(rng: random.Random, a: int, b: int) -> str:
    """A response a learning policy might write for ``a+b=``: right about a third of the time."""
    s, u = a + b, rng.random()
    if u < 0.35:
        pad = rng.random()
        return f" {s}" if pad < 0.05 else f"{s} " if pad < 0.1 else str(s)
    if u < 0.6:
        return str(s + rng.choice((-1, 1)))
    if u < 0.7:
        return str(max(0, s + rng.choice((-1, 1)) * rng.randint(2, 20)))
    if u < 0.8:
        return str(rng.randint(0, 199))
    if u < 0.9:  # the right digits, broken
        t = str(s)
        return rng.choice((t[1:], t + str(rng.randint(0, 9)), "0" + t, t + rng.choice("+-*=,:;") + str(rng.randint(0, 9)),
                           t[:-1] + " " + t[-1]))
    return "".join(rng.choice(_JUNK) for _ in range(rng.randint(0, 8)))


def examples(pairs: list[tuple[int, int]], n: int, rng: random.Random) -> list[tuple[str, str]]:
    """`n` (judge prompt, judge text) pairs on operand pairs drawn from `pairs`."""
    out = []
    for _ in range(n):
        a, b = rng.choice(pairs)
        response = sample_response(rng, a, b)
        out.append((TEMPLATE.format(prompt=make_prompt(a, b), response=response, answer=a + b), judge_text(a, b, response)))
    return out


def _batch(batch: list[tuple[str, str]], device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seqs, starts = [], []
    for prompt, text in batch:
        p = [BOS_ID, *char_tokenizer_ids(prompt)]
        seqs.append([*p, *char_tokenizer_ids(text), EOS_ID])
        starts.append(len(p))
    width = max(map(len, seqs))
    ids = torch.tensor([s + [PAD_ID] * (width - len(s)) for s in seqs], device=device)
    pos = torch.arange(width - 1, device=device)
    first, lengths = torch.tensor(starts, device=device), torch.tensor([len(s) for s in seqs], device=device)
    mask = (pos >= first[:, None] - 1) & (pos < lengths[:, None] - 1)  # the judge's text and its eos
    return ids[:, :-1], ids[:, 1:], mask


@torch.no_grad()
def _grade(model: Any, tokenizer: Any, batch: list[tuple[str, str]], device: str, max_new_tokens: int = 2) -> list[str]:
    """Greedy judge texts, the prompts of one length at a time (no padding needed)."""
    model.eval()
    out = [""] * len(batch)
    by_len: dict[int, list[int]] = {}
    enc = [[BOS_ID, *char_tokenizer_ids(p)] for p, _ in batch]
    for i, e in enumerate(enc):
        by_len.setdefault(len(e), []).append(i)
    for idx in by_len.values():
        ids = torch.tensor([enc[i] for i in idx], device=device)
        done = torch.zeros(len(idx), dtype=torch.bool, device=device)
        new = []
        for _ in range(max_new_tokens):
            nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, EOS_ID), nxt)
            done |= nxt == EOS_ID
            new.append(nxt)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if bool(done.all()):
                break
        for i, row in zip(idx, torch.stack(new, 1).tolist(), strict=True):
            row = row[: row.index(EOS_ID)] if EOS_ID in row else row
            out[i] = tokenizer.decode(row, skip_special_tokens=True)
    model.train()
    return out


def verdict(text: str) -> float | None:
    """1.0 / 0.0 for a text ending in the word ``y`` / ``n``; None otherwise."""
    last = text.strip().rsplit(" ", 1)[-1].lower() if text.strip() else ""
    return 1.0 if last in ("y", "yes") else 0.0 if last in ("n", "no") else None


def warm_start(model_dir: str | Path, out_dir: str | Path, *, steps: int = 1500, batch_size: int = 128,
               lr: float = 1e-3, label_noise: float = 0.0, seed: int = 0, device: str = "cpu",
               eval_examples: int = 2000, warmup_steps: int = 100) -> dict[str, Any]:
    """Supervised steps on judge examples of the train pairs (a fraction `label_noise` of verdicts
    flipped), then the judge's agreement with exact match on examples of the held-out pairs; the
    model saved as an HF folder at `out_dir` with its metrics in `warm_start.json`. The learning rate
    warms up over `warmup_steps`: started at full rate, the comparison it must learn stalls well below
    the rule's agreement (docs/judge.md)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    split = split_pairs(seed)
    train, held = list(split.train), list(split.held_out)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").to(device)
    if model.config.vocab_size <= max(char_tokenizer_ids("yn")):
        raise ValueError(f"{model_dir}: the judge writes y / n; build it with model.init: tiny_agent")
    rng = random.Random(f"judge-{seed}")
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine(s, steps, warmup_steps))
    model.train()
    t0, losses = time.perf_counter(), []
    for _ in range(steps):
        batch = examples(train, batch_size, rng)
        if label_noise:
            batch = [(p, t[:-1] + ("n" if t[-1] == "y" else "y")) if rng.random() < label_noise else (p, t) for p, t in batch]
        x, y, m = _batch(batch, device)
        loss = F.cross_entropy(model(input_ids=x, use_cache=False).logits[m].float(), y[m])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    train_s = time.perf_counter() - t0
    test = examples(held, eval_examples, random.Random(f"judge-eval-{seed}"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = _grade(model, tokenizer, test, device)
    agree = sum(verdict(g) == verdict(t) for g, (_, t) in zip(texts, test, strict=True)) / len(test)
    false_yes = sum(verdict(g) == 1.0 and t == "n" for g, (_, t) in zip(texts, test, strict=True)) / len(test)
    false_no = sum(verdict(g) != 1.0 and t == "y" for g, (_, t) in zip(texts, test, strict=True)) / len(test)
    metrics = {"steps": steps, "batch_size": batch_size, "lr": lr, "label_noise": label_noise, "seed": seed,
               "warmup_steps": warmup_steps, **loss_window(losses), "train_seconds": train_s,
               "held_out_agreement": agree, "held_out_false_yes": false_yes,
               "held_out_false_no": false_no, "held_out_examples": len(test)}
    return save_trained(model, tokenizer, out_dir, metrics)
