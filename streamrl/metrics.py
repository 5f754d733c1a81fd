"""`RUN_DIR/metrics.jsonl`: one row per trainer step, from the trainer's stats and the counters of the
rollout side (manager, controller, buffer, pool), each as the difference since the previous row; and,
with `save_samples`, every trained group in `RUN_DIR/samples.jsonl`. Every row also goes to the
sinks `logging.*` turns on (TensorBoard, wandb: streamrl/logging_sinks.py).

The engines' busy time is read off the run loop's path: a server answers between two engine steps
(a large prefill right after a weight update takes tens of ms), so each row uses the stats read when
the previous row was written, and starts the next read. The idle fraction is therefore up to one
step behind. This module only reads counters; it decides nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from .buffer import RolloutBuffer, StalenessController
from .config import LoggingConfig
from .logging_sinks import MetricSinks
from .progress import RunProgress
from .rollout import EnginePool, RolloutManager
from .types import Group, encode_jsonl

# engines.colocate: the engines' memory yielded around the step (streamrl/colocate.py).
_COLOCATED = ("engine_release_s", "engine_restore_s", "engine_bytes_during_step")
# Fields that measure time: the only ones two runs of a deterministic config may differ in.
WALL_CLOCK_FIELDS = frozenset({"wall_s", "gen_tps", "engine_idle_frac", "engine_prefill_s", "trainer_wait_s",
                               "train_s", "weight_sync_s", "judge_s", *_COLOCATED})


async def _read_pool(pool: EnginePool) -> tuple[float, dict[str, Any]]:
    await pool.refresh_stats()
    return time.perf_counter(), pool.stats()


class StepMetrics:
    def __init__(self, run_dir: Path, steps: int, *, manager: RolloutManager, controller: StalenessController | None = None,
                 buffer: RolloutBuffer | None = None, pool: EnginePool | None = None, save_samples: bool = False,
                 append: bool = False, progress: bool = False, logging: LoggingConfig | None = None,
                 run_config: Any = None) -> None:
        """`controller`, `buffer`, `pool`: the manager's unless given. `progress`: a live bar of the run's
        `steps` on the terminal, updated with every row. `logging`: the sinks every row goes to as well;
        `run_config` (the run's Config, or a dict) is wandb's run config."""
        self.manager = manager
        self.controller = manager.controller if controller is None else controller
        self.buffer = manager.buffer if buffer is None else buffer  # (an empty buffer is falsy)
        self.pool = manager.pool if pool is None else pool
        self.bar = RunProgress(steps, enabled=progress)
        mode = "a" if append else "w"
        self._file = (run_dir / "metrics.jsonl").open(mode)
        self._samples = (run_dir / "samples.jsonl").open(mode + "b") if save_samples else None
        self.sinks = MetricSinks(logging, run_dir, run_config)
        self._poll: asyncio.Task[tuple[float, dict[str, Any]]] | None = None
        self._turns: dict[str, float] = {}
        self._by_source: dict[str, float] = {}
        self._judge_s = 0.0
        self._last: dict[str, float] = {}
        self.t0 = time.perf_counter()

    async def start(self) -> None:
        """The clock starts now, and the engines' counters are read as they stand (the held-out
        evaluation before the run is not the first step's)."""
        self.bar.__enter__()
        t_pool, ps = await _read_pool(self.pool)
        self.t0 = time.perf_counter()
        self._last = {"t": self.t0, **self._counters(t_pool, ps)}

    def _counters(self, t_pool: float, ps: dict[str, Any]) -> dict[str, float]:
        c, judge = self.manager.counters, self.manager.judge
        return {"t_pool": t_pool, "busy": ps["busy_s"], "prefill": ps.get("prefill_s", 0.0), "tool_calls": c.tool_calls,
                "tool_errors": c.tool_errors, "tool_s": c.tool_s, "prefix_mismatch": c.prefix_mismatch,
                "tool_calls_parsed": c.tool_calls_parsed, "tool_parse_errors": c.tool_parse_errors,
                **{f"tool_errors/{cause}": n for cause, n in c.tool_error_causes.items()},
                **({"judge_calls": judge.counters.calls, "judge_failures": judge.counters.failures} if judge else {}),
                **self.manager.rollout_counters()}

    async def write(self, step: int, stats: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """The step's row (trainer `stats` plus `extra` fields), appended and flushed."""
        t_pool, ps = await (self._poll or _read_pool(self.pool))  # read at the previous row: done long since
        self._poll = asyncio.create_task(_read_pool(self.pool))
        now = time.perf_counter()
        cur, last = self._counters(t_pool, ps), self._last
        landed = self.manager.scheduling.landed(stats["version"])
        if landed is not None:  # a reproducible run's: as they stood when the step's weights landed
            cur |= landed
        dt, dt_pool = now - last["t"], t_pool - last["t_pool"]
        tokens = cur["tokens"] - last["tokens"]
        row = {
            "step": step, "version": stats["version"], "wall_s": round(now - self.t0, 4),
            "samples": stats["samples_total"], "reward_mean": stats["reward_mean"],
            "tokens_generated": tokens, "gen_tps": tokens / dt if dt > 0 else 0.0,
            "loss": stats["loss"], "logprob_mismatch": stats["logprob_mismatch"],
            "logprob_diff": stats["logprob_diff_all"],
            "staleness_mean": stats["staleness_mean"], "staleness_max": stats["staleness_max"],
            "partial_resumed": cur["resumed"] - last["resumed"],
            "tokens_discarded": cur["discarded"] - last["discarded"],
            "dropped_stale": cur["dropped"] - last["dropped"],
            "groups_filtered": cur["filtered"] - last["filtered"], "prompts_drawn": cur["drawn"] - last["drawn"],
            "engine_idle_frac": max(0.0, 1 - (cur["busy"] - last["busy"]) / (dt_pool * self.pool.num_replicas))
            if dt_pool > 0 else 0.0,
            # Engine seconds spent in prefill: prompts, plus partials recomputed after an update.
            "engine_prefill_s": cur["prefill"] - last["prefill"],
            "trainer_wait_s": stats["trainer_wait_s"], "train_s": stats["train_s"],
            "batch_parts": stats["batch_parts"], "clip_frac": stats.get("clip_frac", 0.0),
            "grad_norm": stats["grad_norm"], "skipped_samples": stats["skipped_samples"],
            "buffer_size": cur["buffer_size"], **self._by_source, **extra,
            **{k: stats[k] for k in _COLOCATED if k in stats},
        }
        if self.manager.multi_turn:  # multi-turn: the step's turns and the tools since the last row
            row |= self._turns | {k: cur[k] - last[k] for k in ("tool_calls", "tool_errors", "tool_s", "prefix_mismatch",
                                                            "tool_calls_parsed", "tool_parse_errors")}
            row |= {k: v - last.get(k, 0) for k, v in cur.items() if k.startswith("tool_errors/")}
        if self.manager.judge is not None:  # judge_s: per trained group, the wait for its judgments
            row |= {"judge_s": self._judge_s} | {k: cur[k] - last[k] for k in ("judge_calls", "judge_failures")}
        decisions = cur.pop("decisions", None)
        if decisions is None:
            decisions = self.controller.drain_decisions()
        if decisions:
            row["controller"] = decisions[-5:]
        self._last = {"t": now, **cur}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self.sinks.write(row)
        self.bar.update(step, row)
        return row

    def write_groups(self, groups: list[Group]) -> None:
        """A step's trained groups (with `save_samples`), and what its row says of their turns."""
        if self._samples is not None:
            self._samples.write(encode_jsonl(groups))
        samples = [s for g in groups for s in g.samples]
        tokens = sum(s.num_tokens for s in samples)
        waits = [g.samples[0].timings.get("judge_s", 0.0) for g in groups if g.samples]
        self._judge_s = sum(waits) / len(waits) if waits else 0.0
        self._turns = {"turns_mean": sum(t.kind == "model" for s in samples for t in s.turns) / max(len(samples), 1),
                       "masked_token_frac": sum(s.num_tokens - sum(s.loss_mask) for s in samples) / max(tokens, 1)}
        by_source: dict[str, list[float]] = {}  # a mixed dataset's tasks (data.tasks), each its own curve
        for g in groups:
            if g.meta.get("data_source") is not None:
                by_source.setdefault(str(g.meta["data_source"]), []).extend(g.rewards)
        self._by_source = {f"reward/{k}": sum(v) / len(v) for k, v in sorted(by_source.items()) if v}

    async def aclose(self) -> None:
        self.bar.__exit__(None, None, None)
        if self._poll is not None:
            self._poll.cancel()
            await asyncio.gather(self._poll, return_exceptions=True)
        self._file.close()
        if self._samples is not None:
            self._samples.close()
        self.sinks.close()
