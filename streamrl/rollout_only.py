"""`streamrl rollout`: the rollout half of a run, with no trainer, to debug prompts, rewards and engines.

    manager admits N groups -> pool generates -> rewards -> buffer -> samples.jsonl + a summary

The same components as `streamrl run` (task, model preparation, pool, manager, buffer), built from
the same config, so what a rollout shows is what training would see: the same prompts, sampling
settings, reward function and engines. Nothing is trained and no weights are pushed, so every token
carries weight version 0 (for user-run servers: whatever weights they serve).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import msgspec
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .assemble import assemble, check, prepare
from .buffer import RolloutBuffer, StalenessController
from .config import BufferConfig, Config, dump_config
from .types import Group, encode_jsonl


async def rollout_only(cfg: Config, *, groups: int, out: Path | None = None, show_progress: bool = True,
                       log: Any = print) -> dict[str, Any]:
    """Generate and score `groups` groups of `rollout.group_size` samples; write them as JSONL (one
    `Group` per line, the format of `save_samples`) to `out` (default `run_dir/rollouts.jsonl`) and
    return a summary, also written to `run_dir/rollout_summary.json`."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    from transformers import AutoTokenizer

    task = check(cfg)  # first: a bad dataset or reward stops here
    run_dir = Path(cfg.run_dir)
    dump_config(cfg, run_dir / "config.yaml")
    out = out or run_dir / "rollouts.jsonl"
    prepared = prepare(cfg, task, log=log)
    model_dir = prepared.model_dir
    bg = cfg.schedule.batch_groups
    # The version never moves, so admission is bounded by the budget alone: a staleness bound of
    # ceil(groups / batch_groups) versions lets all of them start (still capped by max_concurrent_groups).
    # No trainer, no weight landings: nothing for controller.deterministic to order.
    ctl = StalenessController(msgspec.structs.replace(cfg.controller, max_staleness=-(-groups // bg), deterministic=False),
                              batch_groups=bg, max_groups=groups)
    buffer = RolloutBuffer(BufferConfig(priority="fifo"))
    done: list[Group] = []
    async with AsyncExitStack() as stack:
        r = await assemble(cfg, stack, prepared, model_dir=model_dir, tokenizer=AutoTokenizer.from_pretrained(model_dir),
                           controller=ctl, buffer=buffer, max_failed_in_a_row=groups)
        manager = r.manager
        t0 = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as tg:
                producer = tg.create_task(manager.run(), name="rollout-manager")
                with out.open("wb") as f, _progress(groups, show_progress) as advance:
                    while len(done) < groups:
                        # Failed groups give their slot back and are retried, until `groups` fail in a row.
                        got = await buffer.get_batch(1)
                        f.write(encode_jsonl(got))  # as they finish: a long rollout can be read while it runs
                        f.flush()
                        done += got
                        ctl.consumed(got)
                        advance(len(got))
                producer.cancel()
        except* Exception as failed:
            raise failed.exceptions[0] from None
        wall = time.perf_counter() - t0
    summary = {"run_dir": str(run_dir), "model_dir": model_dir, "out": str(out), "wall_s": wall,
               "failed_groups": manager.counters.failed, "last_error": manager.counters.last_error,
               **summarize(done, wall)}
    if r.judge is not None:
        summary["judge"] = r.judge.summary()
    (run_dir / "rollout_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def summarize(groups: list[Group], wall_s: float) -> dict[str, Any]:
    """What a rollout looks like: rewards, how many groups carry a learning signal, response lengths."""
    samples = [s for g in groups for s in g.samples]
    lens = sorted(s.num_tokens for s in samples)
    rewards = [s.reward if s.reward is not None else 0.0 for s in samples]
    tokens = sum(lens)

    def pct(q: float) -> int:
        return lens[min(len(lens) - 1, int(q * len(lens)))]

    return {
        "groups": len(groups), "samples": len(samples), "tokens": tokens,
        "reward_mean": statistics.fmean(rewards),
        # GRPO learns only from groups whose samples disagree: all-equal rewards give zero advantage.
        "groups_with_signal": sum(len(set(g.rewards)) > 1 for g in groups),
        "length_mean": statistics.fmean(lens), "length_p50": pct(0.5), "length_p90": pct(0.9),
        "length_max": lens[-1],
        "finish_reasons": dict(Counter(s.finish_reason or "none" for s in samples)),
        "samples_per_s": len(samples) / wall_s if wall_s > 0 else 0.0,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        **_turn_stats(samples), **_judge_examples(samples),
    }


def _judge_examples(samples: list, n: int = 8) -> dict[str, Any]:
    """With a judge: a few samples as the judge saw them (response, its text, its score)."""
    judged = [s for s in samples if s.meta.get("judge")]
    return {"judged_examples": [{"prompt": s.prompt_text, "response": s.response_text, "reward": s.reward,
                                 "judge": s.meta["judge"][-1]} for s in judged[:n]]} if judged else {}


def _turn_stats(samples: list) -> dict[str, Any]:
    """Multi-turn samples: model turns per sample, tool calls (and errors), tokens masked out of the loss."""
    if not any(s.turns for s in samples):
        return {}
    tools = [t for s in samples for t in s.turns if t.kind == "tool" and t.tool is not None]
    return {"turns_mean": statistics.fmean(sum(t.kind == "model" for t in s.turns) for s in samples),
            "tool_calls": len(tools), "tool_errors": sum(t.error is not None for t in tools),
            "tool_calls_per_sample": len(tools) / len(samples),
            "masked_token_frac": sum(s.num_tokens - sum(s.loss_mask) for s in samples) / max(1, sum(
                s.num_tokens for s in samples))}


class _progress:
    """A groups bar on a terminal; nothing otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._p = Progress(TextColumn("[bold]groups"), MofNCompleteColumn(), BarColumn(),
                           TimeElapsedColumn()) if enabled else None
        self._total = total

    def __enter__(self):  # noqa: ANN204
        if self._p is None:
            return lambda n: None
        self._p.__enter__()
        task = self._p.add_task("", total=self._total)
        return lambda n: self._p.advance(task, n)  # type: ignore[union-attr]

    def __exit__(self, *exc: object) -> None:
        if self._p is not None:
            self._p.__exit__(None, None, None)
