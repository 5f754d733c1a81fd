"""The warm start of `data.source: reasoning_gym`: a *sloppy teacher* on the run's own training records, as the
quickstart has (streamrl/tasks/addition.py says why a clean teacher leaves RL less to do, and worse). Each
example is a record's question followed by its answer, written as `data.answer_format` reads it. For the
first steps (CLEAN_FRACTION of them) the answer is right; after that, with probability `label_noise`, it is
a guess: another record's answer of the same task. The model learns the answers, then learns to guess at
times, and samples its guesses; RL removes them.

Why guesses and not the quickstart's answers off by one: a small task's answers are learned question by
question, and so is an off-by-one habit, which RL then has to undo for each question; a guess is drawn
the same way for every question of a task, one habit that RL undoes for all of them together.

`make_recipe` builds the recipe around a run's records; their digest and the answer format are parameters
of it, so the warm-start cache (streamrl/tasks/warm.py) keys on everything that changes what it trains.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .gym_tasks import GymData, render_answer
from .warm import Recipe, cosine, load_for_training, loss_window, save_trained

CLEAN_FRACTION = 0.7  # of the steps, before the teacher starts guessing


def make_recipe(data: GymData, answer_format: str) -> Recipe:
    """The warm-start recipe of `data`'s training records (`warm_start.*` gives its parameters)."""
    records = data.train

    def warm_start(model_dir: str | Path, out_dir: str | Path, *, steps: int = 600, batch_size: int = 64,
                   lr: float = 3e-3, label_noise: float = 0.5, seed: int = 0, device: str = "cpu",
                   warmup_steps: int = 30, records_digest: str = data.digest,
                   answer_format: str = answer_format) -> dict[str, Any]:
        # One CPU thread, as the run's trainer and engines use: where other processes share the CPU, a team of
        # threads spins against them and every step takes several times longer.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            model, tokenizer, metrics = sloppy_teacher(model_dir, records, answer_format=answer_format, steps=steps,
                                                       batch_size=batch_size, lr=lr, label_noise=label_noise,
                                                       seed=seed, device=device, warmup_steps=warmup_steps)
        finally:
            torch.set_num_threads(threads)
        return save_trained(model, tokenizer, out_dir, {"tasks": data.labels, "records_digest": records_digest,
                                                        **metrics})

    return warm_start


def _answer_choices(records: Sequence[dict[str, Any]]) -> tuple[list[str], list[int], list[list[int]]]:
    """(the distinct answers, each record's own answer's index, and per record the answers of its task's
    records, repeats kept: the pool the teacher's guesses are drawn from, as often as the task gives each)."""
    answers: list[str] = []
    index: dict[str, int] = {}
    right = []
    for r in records:
        if r["answer"] not in index:
            index[r["answer"]] = len(answers)
            answers.append(r["answer"])
        right.append(index[r["answer"]])
    pools: dict[str, list[int]] = {}
    for r, i in zip(records, right, strict=True):
        pools.setdefault(r["data_source"], []).append(i)
    return answers, right, [pools[r["data_source"]] for r in records]


def _guess(rng: random.Random, pool: list[int], right: int) -> int:
    """A wrong answer from `pool` (the right one only where the task has no other, or after a few tries)."""
    for _ in range(8):
        a = rng.choice(pool)
        if a != right:
            return a
    return right


def _answer_loss(model: Any, seqs: list[list[int]], starts: list[int], pad: int, device: str) -> torch.Tensor:
    """The summed cross-entropy of `seqs`' tokens from `starts` on (the answer and eos), padded to the longest."""
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)  # [b, width]
    pos = torch.arange(width - 1, device=device)
    first = torch.tensor(starts, device=device)[:, None]
    ends = torch.tensor([len(s) for s in seqs], device=device)[:, None]
    mask = (pos >= first - 1) & (pos < ends - 1)  # [b, width-1]: position t predicts token t+1
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits  # [b, width-1, V]
    return F.cross_entropy(logits[mask].float(), ids[:, 1:][mask], reduction="sum")


def sloppy_teacher(model_dir: str | Path, records: Sequence[dict[str, Any]], *, answer_format: str, steps: int,
                   batch_size: int, lr: float, label_noise: float, seed: int, device: str,
                   warmup_steps: int) -> tuple[Any, Any, dict[str, Any]]:
    """Train `model_dir` on `records` with noisy labels: (the model, its tokenizer, metrics)."""
    if not 0.0 <= label_noise <= 1.0:
        raise ValueError(f"label_noise must be in [0, 1], got {label_noise}")
    model, tok, save_dtype = load_for_training(model_dir, device)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    if bos is None or eos is None:
        raise ValueError("the warm start needs a tokenizer with bos and eos tokens")
    pad = eos if tok.pad_token_id is None else tok.pad_token_id
    answers, right, pools = _answer_choices(records)
    encode = lambda texts: tok(list(texts), add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = encode(r["prompt"] for r in records)
    targets = [[*ids, eos] for ids in encode(render_answer(a, answer_format) for a in answers)]
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine(s, steps, warmup_steps))
    model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        # Right answers first: a guess carries nothing to learn from, and guesses from the start keep the
        # model from learning the answers at all; the last steps make the learned answers sloppy.
        noise = label_noise if step >= CLEAN_FRACTION * steps else 0.0
        seqs, starts = [], []
        for r in (rng.randrange(len(records)) for _ in range(batch_size)):
            a = _guess(rng, pools[r], right[r]) if rng.random() < noise else right[r]
            seqs.append([bos, *prompts[r], *targets[a]])
            starts.append(1 + len(prompts[r]))  # the first answer token's position
        # Tasks' questions differ in length: the shorter and the longer half of the batch are padded apart, so
        # the short questions are not computed at the long ones' length.
        order = sorted(range(batch_size), key=lambda i: len(seqs[i]))
        n_tokens = sum(len(s) - st for s, st in zip(seqs, starts, strict=True))  # the answers' tokens and eos
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for half in (order[: batch_size // 2], order[batch_size // 2 :]):
            if half:
                loss = _answer_loss(model, [seqs[i] for i in half], [starts[i] for i in half], pad, device) / n_tokens
                loss.backward()
                total += loss.item()
        opt.step()
        sched.step()
        losses.append(total)
    return model.to(save_dtype), tok, {
        "steps": steps, "batch_size": batch_size, "lr": lr, "label_noise": label_noise, "seed": seed,
        "warmup_steps": warmup_steps, "answer_format": answer_format, "records": len(records), **loss_window(losses),
        "train_seconds": time.perf_counter() - t0}
