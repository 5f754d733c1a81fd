"""The supervised warm start that makes the quickstart's RL run learn: a "sloppy teacher" on addition.

This module owns the warm-start recipe, a small batched evaluator, and a content-addressed cache of
warm-started folders, and `prepare_model`, which builds the run's starting folder from `model.*` and
`warm_start.*`. Why a sloppy teacher: a clean supervised run caught mid-transition gets worse under
GRPO, while labels that are off by one half of the time give a model that knows the sum but samples it
inconsistently, which is what RL then fixes (docs/benchmarks.md has the figures).
It knows nothing about the RL trainer, engines or buffers; it only reads and writes HF folders.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..config import ConfigError, ModelConfig, WarmStartConfig
from . import addition

# Bump when the recipe's code changes meaning, so cached folders from older code are not reused.
RECIPE_VERSION = 1
MARKER = "WARM_START_COMPLETE"
METRICS_FILE = "warm_start.json"


def _load(model_dir: str | Path, device: str) -> tuple[Any, Any, torch.dtype]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Eager attention: at ~10 tokens per row it measured ~10% faster than sdpa per CPU training step.
    attn = "eager" if torch.device(device).type == "cpu" else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    saved = getattr(model.config, "dtype", None)
    save_dtype = saved if isinstance(saved, torch.dtype) else torch.float32
    return model.to(device), tokenizer, save_dtype


def save_trained(model: Any, tokenizer: Any, out_dir: str | Path, metrics: dict[str, Any]) -> dict[str, Any]:
    """A warm start's result: the model and tokenizer as an HF folder at `out_dir`, its metrics in
    `warm_start.json` beside them. Returns `metrics`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    return metrics


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
    prompts = _encode_batch(tokenizer, [addition.make_prompt(a, b) for a, b in pairs])
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


def _cosine(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


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
    """Fraction of prompts whose response scores 1.0 under `streamrl.tasks.addition.reward`."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    if not prompts:
        return 0.0
    responses = generate_responses(
        model, tokenizer, prompts, temperature, max_new_tokens, batch_size=batch_size, seed=seed
    )
    hits = sum(addition.reward(r, a) for r, a in zip(responses, answers, strict=True))
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
    split = addition.split_pairs(split_seed)
    model, tokenizer, save_dtype = _load(model_dir, device)
    inputs, targets, masks = (t.to(device) for t in _build_examples(tokenizer, split.train))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine(s, steps, warmup_steps))
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

    held = addition.to_records(split.held_out)[:eval_samples]
    prompts, answers = [r["prompt"] for r in held], [r["answer"] for r in held]
    t1 = time.perf_counter()
    greedy = evaluate_accuracy(model, tokenizer, prompts, answers, temperature=0.0, seed=seed)
    sampled = evaluate_accuracy(model, tokenizer, prompts, answers, temperature=1.0, seed=seed)
    eval_s = time.perf_counter() - t1

    window = max(1, min(20, steps // 5))
    metrics: dict[str, Any] = {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "label_noise": label_noise,
        "seed": seed,
        "split_seed": split_seed,
        "loss_first": sum(losses[:window]) / window,
        "loss_last": sum(losses[-window:]) / window,
        "train_seconds": train_s,
        "eval_seconds": eval_s,
        "greedy_accuracy": greedy,
        "sampled_accuracy": sampled,
        "held_out_size": len(prompts),
    }
    return save_trained(model.to(save_dtype), tokenizer, out_dir, metrics)


# Captured once so the cache key does not depend on what `warm_start` is later patched or wrapped with.
_WARM_START_SIGNATURE = inspect.signature(warm_start)


def _hash_model_dir(model_dir: Path) -> str:
    """Hash of the base model's weights and config; the tokenizer follows from the config's vocab."""
    files = sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json"]
    h = hashlib.sha256()
    for f in files:
        if not f.is_file():
            raise ValueError(f"{model_dir} has no {f.name}; is it a Hugging Face model folder?")
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _recipe(task: str) -> Callable[..., dict[str, Any]]:
    """The warm start of a built-in task: addition's here, multiplication's in `multiply.py`."""
    if task == "multiply":
        from .multiply import warm_start as multiply_warm_start

        return multiply_warm_start
    if task == "addition_judge":
        from .addition_judge import warm_start as judge_warm_start

        return judge_warm_start
    return warm_start


def warm_start_key(model_dir: str | Path, task: str = "addition", **recipe: Any) -> str:
    """The cache key of a warm start: recipe (defaults filled in) + base model hash + RECIPE_VERSION
    (+ the task, for another task than addition, whose keys stay what they were)."""
    fn = _recipe(task)
    params = (_WARM_START_SIGNATURE if fn is warm_start else inspect.signature(fn)).bind("model", "out", **recipe)
    params.apply_defaults()
    full = {k: v for k, v in params.arguments.items() if k not in ("model_dir", "out_dir", "progress")}
    body: dict[str, Any] = {"recipe": full, "base": _hash_model_dir(Path(model_dir)), "version": RECIPE_VERSION}
    if task != "addition":
        body["task"] = task
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cached_warm_start(model_dir: str | Path, cache_root: str | Path, task: str = "addition", **recipe: Any) -> Path:
    """`warm_start` into ``cache_root/warm-<key>``, or reuse that folder if a finished run left it there.

    A run trains into a temporary sibling, writes ``MARKER`` last and then renames the folder into
    place, so a killed run is never reused and two concurrent runs cannot interleave files.
    """
    root = Path(cache_root)
    final = root / f"warm-{warm_start_key(model_dir, task, **recipe)}"
    if (final / MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        _recipe(task)(model_dir, tmp, **recipe)
        (tmp / MARKER).write_text("ok\n")
        if final.exists() and not (final / MARKER).is_file():
            shutil.rmtree(final)  # a folder without the marker is an interrupted run: not trusted
        try:
            tmp.rename(final)
        except OSError:
            if not (final / MARKER).is_file():  # lost a race only if the winner actually finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_warm_start_metrics(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / METRICS_FILE).read_text())


def prepare_model(model: ModelConfig, warm: WarmStartConfig, *, seed: int, task: str | None = None,
                  log: Any = print) -> tuple[str, dict[str, Any]]:
    """The policy's starting folder: the tiny model built if `model.init` asks and it is missing, then
    the (cached) warm start of `task` (`multiply`, `addition_judge`; else addition's) if enabled. Returns (folder,
    warm-start metrics)."""
    path = Path(model.path)
    if not (path / "config.json").is_file():
        if model.init == "none":
            raise ConfigError("model.path", f"folder '{path}' has no config.json")
        from .tiny_model import build_tiny_model

        log(f"building tiny model at {path}")
        build_tiny_model(path, preset=model.preset, seed=model.init_seed, agent=model.init == "tiny_agent")
    if not warm.enabled:
        return str(path), {}
    from ..devices import resolve_device

    recipe = dict(steps=warm.steps, batch_size=warm.batch_size, lr=warm.lr, label_noise=warm.label_noise, seed=seed,
                  device=resolve_device(warm.device))
    which = task if task in ("multiply", "addition_judge") else "addition"
    if warm.warmup_steps:
        if which != "addition":
            raise ConfigError("warm_start.warmup_steps", f"the {which} warm start has its own schedule; leave it 0")
        recipe["warmup_steps"] = warm.warmup_steps
    target = Path(warm.cache_dir) / f"warm-{warm_start_key(path, which, **recipe)}"
    cached = (target / MARKER).is_file()
    log("warm start: reusing cache " + str(target) if cached else f"warm start: {warm.steps} supervised steps")
    out = cached_warm_start(path, warm.cache_dir, which, **recipe)
    return str(out), {**load_warm_start_metrics(out), "cached": cached}
