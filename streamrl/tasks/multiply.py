"""The agentic quickstart's task: 3-digit × 2-digit multiplication with a calculator tool.

`"123*45="` -> `"5535"`. The tiny model cannot multiply in its head; with the `calculator` tool it only
has to copy: `<tool>123*45</tool>` (the one tool, its name left out), the observation
`<result>5535</result>` (masked out of the loss), then `5535<eos>`. The reward reads the answer after
the last observation (or the whole response when no tool was called).

The warm start is a *sloppy teacher* again: only `1 - label_noise` of its examples call the tool; the
others answer at once with the right product, which the model can only guess. So the warm-started
model calls the tool about as often (40 % in the quickstart) and is right about as often; RL makes the call
reliable.
This module owns the prompts, the split, the reward and that warm start; it knows nothing of engines.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .warm import loss_window, save_trained

RESULT_CLOSE, EOS_TEXT = "</result>", "<eos>"


def multiply_prompts(split: str = "train", *, seed: int = 0, n: int = 20_000) -> list[dict[str, str]]:
    """`n` records `{"prompt": "123*45=", "answer": "5535"}` (`held_out`: 400 others, never trained on)."""
    rng = random.Random(f"multiply-{seed}")
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < n + 400:
        pairs.add((rng.randint(100, 999), rng.randint(10, 99)))
    ordered = sorted(pairs)
    random.Random(seed).shuffle(ordered)
    chosen = ordered[:400] if split == "held_out" else ordered[400:]
    return [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in chosen]


def reward(response_text: str, answer: str) -> float:
    """1.0 iff the text after the last tool observation, cut at `<eos>`, is the answer."""
    text = response_text.rsplit(RESULT_CLOSE, 1)[-1].split(EOS_TEXT, 1)[0]
    return 1.0 if text.strip() == answer.strip() else 0.0


def _example(tok: Any, prompt: str, answer: str, use_tool: bool) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 on what the model writes, 0 on the prompt and the observation)."""
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids, mask = [tok.bos_token_id, *enc(prompt)], [0] * (1 + len(enc(prompt)))
    if use_tool:
        call, result = enc(f"<tool>{prompt[:-1]}</tool>"), enc(f"<result>{answer}</result>")
        ids, mask = ids + call + result, mask + [1] * len(call) + [0] * len(result)
    tail = [*enc(answer), tok.eos_token_id]
    return ids + tail, mask + [1] * len(tail)


def warm_start(model_dir: str | Path, out_dir: str | Path, *, steps: int = 300, batch_size: int = 128,
               lr: float = 3e-3, label_noise: float = 0.5, seed: int = 0, device: str = "cpu") -> dict[str, Any]:
    """Supervised steps on the sloppy teacher's trajectories; the result saved as an HF folder."""
    return supervised(model_dir, out_dir, _example, task="multiply", steps=steps, batch_size=batch_size, lr=lr,
                      label_noise=label_noise, seed=seed, device=device)


def supervised(model_dir: str | Path, out_dir: str | Path, example: Any, *, task: str, steps: int,
               batch_size: int, lr: float, label_noise: float, seed: int, device: str,
               records: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """The sloppy teacher's loop: `example(tokenizer, prompt, answer, use_tool) -> (ids, loss mask)`
    on `records` (default: the training products), the tool used with probability `1 - label_noise`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    records = records if records is not None else multiply_prompts("train", seed=seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    losses, t0 = [], time.perf_counter()
    rendered: dict[tuple[str, bool], tuple[list[int], list[int]]] = {}  # a chat template renders slowly

    def row(r: dict[str, str], use_tool: bool) -> tuple[list[int], list[int]]:
        key = (r["prompt"], use_tool)
        if key not in rendered:
            rendered[key] = example(tok, r["prompt"], r["answer"], use_tool)
        return rendered[key]

    for _ in range(steps):
        rows = [row(r, rng.random() >= label_noise) for r in rng.sample(records, batch_size)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i, _ in rows], device=device)
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], device=device).bool()
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits  # [B, L-1, V]; position t predicts t+1
        target_mask = mask[:, 1:]
        loss = F.cross_entropy(logits[target_mask].float(), ids[:, 1:][target_mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    metrics = {"task": task, "steps": steps, "batch_size": batch_size, "lr": lr, "label_noise": label_noise,
               "seed": seed, **loss_window(losses),
               "train_seconds": time.perf_counter() - t0}
    return save_trained(model, tok, out_dir, metrics)
