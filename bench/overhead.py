"""The hall's own cost at scale: framework time per sample with 1, 64 and 1,024 simulated engines.

Everything of `streamrl run` but the model runs for real: `run.train` (the loop), the RolloutManager,
RolloutBuffer, StalenessController, `next_batch`, StepMetrics, LocalPool routing and `push_weights`
(pause with abort, load, resume) with partial resume of every interrupted sample. The engines are
simulated: a request sleeps for its response length times a per-token time (a long tail: ~4 % of
samples think for 60-280 tokens, the rest answer in 3-8), then returns synthesized token ids and
logprobs in SGLang's shape; a pause with mode abort returns each in-flight request's tokens so far.
The trainer is simulated too (a step is free). So every CPU second this process spends is the
framework's but the simulator's own: `cpu_us_per_sample` is the process's CPU time over the samples
trained, `engines_only_us` what the same requests cost the simulated engines driven by a bare loop,
and `framework_us_per_sample` the difference. `samples_per_s_one_core` is the inverse of the total:
the most one core carries, simulator included.

    python bench/overhead.py [--engines 1,64,1024] [--profile]

Writes bench/results/overhead.json; `--profile` adds the top functions by own time at the largest
scale (cProfile), for when the goal (<= 50 µs per sample) is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import math
import pstats
import random
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from _table import print_table

from streamrl.assemble import Rollout
from streamrl.buffer import RolloutBuffer, StalenessController
from streamrl.config import Config, config_from_dict
from streamrl.metrics import StepMetrics
from streamrl.rollout import LocalPool, RolloutManager
from streamrl.run import Run, train
from streamrl.tasks import Task, addition

RESULTS = Path(__file__).parent / "results"
# Simulated decode time per token of one request at 1,024 engines (a busy GPU engine's step). Fewer
# engines are made faster in proportion, so every scale offers the same ~40k samples/s: the framework,
# not the simulated engines, is what limits each run, and its cost per sample is what is measured.
TOKEN_S_1024 = 0.02


class SimEngine:
    """A request lasts its response length x `token_s`; no compute, no model. Pauses like TorchEngine:
    with `abort`, in-flight requests end now with their tokens so far; new ones wait for `resume`."""

    def __init__(self, seed: int, token_s: float) -> None:
        self.token_s = token_s
        self.rng = random.Random(seed)
        # Synthesized once: drawing tokens per request would make the simulator, not the framework,
        # the process's main cost.
        self.tokens = [self.rng.randrange(4, 20) for _ in range(512)]
        self.version = "0"
        self.paused = False
        self._resumed = asyncio.Event()
        self._inflight: dict[str, tuple[asyncio.Future[dict[str, Any]], asyncio.TimerHandle, float, list[int]]] = {}
        self.generated = 0

    async def __aenter__(self) -> SimEngine:
        self._resumed.set()
        return self

    async def aclose(self) -> None:
        await self.abort_all()

    def _length(self, budget: int) -> int:
        n = self.rng.randint(60, 280) if self.rng.random() < 0.04 else self.rng.randint(3, 8)
        return min(n, budget)

    async def generate(self, input_ids: list[int], params: dict[str, Any], rid: str) -> dict[str, Any]:
        return (await self.generate_many([input_ids], [params], [rid]))[0]

    async def generate_many(self, input_ids: list[list[int]], params: list[dict[str, Any]],
                            rids: list[str]) -> list[dict[str, Any]]:
        while self.paused:
            await self._resumed.wait()
        loop = asyncio.get_running_loop()
        futs = []
        for p, rid in zip(params, rids, strict=True):
            start = self.rng.randrange(200)
            ids = self.tokens[start:start + self._length(p["max_new_tokens"])]
            fut: asyncio.Future[dict[str, Any]] = loop.create_future()
            handle = loop.call_later(len(ids) * self.token_s, self._finish, rid, len(ids), "length")
            self._inflight[rid] = (fut, handle, loop.time(), ids)
            futs.append(fut)
        return list(await asyncio.gather(*futs))

    def _finish(self, rid: str, n: int, kind: str) -> None:
        fut, handle, _, ids = self._inflight.pop(rid)
        handle.cancel()
        out = ids[:n]
        self.generated += n
        fut.set_result({"output_ids": out, "meta_info": {
            "finish_reason": {"type": kind}, "weight_version": self.version,
            "output_token_logprobs": [(-0.5, 0, None)] * len(out)}})

    async def pause(self, mode: str = "abort") -> None:
        self.paused = True
        self._resumed.clear()
        if mode == "abort":
            await self.abort_all()

    async def abort_all(self) -> None:
        now = asyncio.get_running_loop().time()
        for rid, (_, _, t0, ids) in list(self._inflight.items()):
            self._finish(rid, min(len(ids), int((now - t0) / self.token_s)), "abort")

    async def resume(self) -> None:
        self.paused = False
        self._resumed.set()

    async def update_weights_from_state_dict(self, tensors: Any, version: str) -> None:
        self.version = version

    def stats(self) -> dict[str, Any]:
        return {"running": len(self._inflight), "waiting": 0, "generated_tokens": self.generated, "busy_s": 0.0,
                "prefill_s": 0.0}


def token_s(engines: int) -> float:
    return TOKEN_S_1024 * engines / 1024


class SimTrainer:
    """Takes batches and steps for free: what is left is the loop's own time."""

    def __init__(self) -> None:
        self.version = self.samples = 0
        self._n = 0
        self._rewards = 0.0

    async def accumulate(self, groups: list[Any]) -> None:
        self._n += sum(len(g.samples) for g in groups)
        self._rewards += sum(sum(g.rewards) for g in groups)

    async def finish_step(self) -> dict[str, Any]:
        self.version += 1
        self.samples += self._n
        stats = {"version": self.version, "samples_total": self.samples, "train_s": 0.0, "trained_samples": self._n,
                 "reward_mean": self._rewards / max(self._n, 1), "loss": 0.0, "logprob_mismatch": None,
                 "logprob_diff_all": None, "staleness_mean": 0.0, "staleness_max": 0.0, "grad_norm": 0.0,
                 "skipped_samples": 0}
        self._n, self._rewards = 0, 0.0
        return stats

    def weights(self) -> dict[str, Any]:
        return {}


class CharTokenizer:
    """The tiny model's character vocabulary, without loading transformers' tokenizer machinery."""

    bos_token_id = 1

    def __init__(self) -> None:
        from streamrl.tasks import TOKENS

        self.ids = {t: i for i, t in enumerate(TOKENS)}
        self.tokens = list(TOKENS)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [self.ids.get(c, 3) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.tokens[i] for i in ids if i >= 4)


def config(engines: int, steps: int, run_dir: str) -> Config:
    return config_from_dict({
        "run_dir": run_dir, "model": {"init": "none"}, "data": {"eval_size": 0},
        "rollout": {"group_size": 8, "max_new_tokens": 280},
        "controller": {"max_staleness": 4},
        # A batch per step that keeps every engine busy: ~8 groups of 8 per engine in flight.
        "schedule": {"steps": steps, "batch_groups": max(8, 2 * engines)},
    }, check_paths=False)


async def one_scale(engines: int, steps: int, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = config(engines, steps, str(run_dir))
    sched = cfg.schedule
    task = Task(train=addition.addition_prompts("train"), held_out=[], reward_fn=addition.reward)
    controller = StalenessController(cfg.controller, batch_groups=sched.batch_groups,
                                     max_groups=sched.steps * sched.batch_groups)
    buffer = RolloutBuffer(cfg.buffer, on_drop=controller.dropped)
    pool = LocalPool([SimEngine(i, token_s(engines)) for i in range(engines)])  # type: ignore[list-item]
    manager = RolloutManager(cfg.rollout, pool=pool, tokenizer=CharTokenizer(), task=task, buffer=buffer,
                             controller=controller, max_failed_in_a_row=4 * sched.batch_groups)
    trainer = SimTrainer()
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(pool)
        metrics = StepMetrics(run_dir, sched.steps, manager=manager, controller=controller, buffer=buffer, pool=pool)
        stack.push_async_callback(metrics.aclose)
        r = Run(cfg, trainer, pool, controller, buffer, manager, metrics, "sim", Rollout(manager, None))  # type: ignore[arg-type]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await train(r, log=lambda *_: None)  # as `streamrl run` trains, GC policy included (quiet_gc)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    n = trainer.samples
    rounds = n + manager.counters.partial_resumed  # requests: one per sample, one more per interruption
    floor = await engines_only(engines, rounds, in_flight=(cfg.controller.max_staleness + 1) * sched.batch_groups)
    total_us = cpu / n * 1e6
    return {"engines": engines, "batch_groups": sched.batch_groups, "steps": steps, "samples": n,
            "resumed_per_sample": round(manager.counters.partial_resumed / n, 2),
            "cpu_us_per_sample": round(total_us, 1), "engines_only_us": round(floor * rounds / n, 1),
            "framework_us_per_sample": round(total_us - floor * rounds / n, 1),
            "samples_per_s_one_core": round(n / cpu), "samples_per_s": round(n / wall), "wall_s": round(wall, 2)}


async def engines_only(engines: int, requests: int, in_flight: int) -> float:
    """CPU µs per request of the simulated engines alone (the same requests, in groups of 8, driven by
    a bare loop with as many groups in flight): the part of `cpu_us_per_sample` that is not streamrl's."""
    sims = [SimEngine(i, token_s(engines)) for i in range(engines)]
    for e in sims:
        await e.__aenter__()
    groups = -(-requests // 8)
    workers = min(in_flight, groups)

    async def worker(w: int) -> None:  # as many groups in flight as the run had
        for k in range(w, groups, workers):
            await sims[k % engines].generate_many([[1, 2, 3]] * 8, [{"max_new_tokens": 280}] * 8,
                                                  [f"{k}-{i}" for i in range(8)])

    cpu0 = time.process_time()
    await asyncio.gather(*[worker(w) for w in range(workers)])
    return (time.process_time() - cpu0) / (groups * 8) * 1e6


def _run(coro: Any) -> Any:
    """On uvloop, as `streamrl run` does."""
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="1,64,1024")
    ap.add_argument("--samples", type=int, default=60_000, help="about this many samples per scale (min 10 steps)")
    ap.add_argument("--profile", action="store_true", help="cProfile the largest scale")
    ap.add_argument("--out", default=str(RESULTS / "overhead.json"))
    args = ap.parse_args(argv)
    scales = [int(x) for x in args.engines.split(",")]
    rows, profile = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for e in scales:
            steps = max(10, math.ceil(args.samples / (8 * max(8, 2 * e))))
            prof = cProfile.Profile() if args.profile and e == max(scales) else None
            if prof is not None:
                prof.enable()
            rows.append(_run(one_scale(e, steps, Path(tmp) / f"e{e}")))
            if prof is not None:
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(20)
                profile = buf.getvalue()
            print(rows[-1], flush=True)
    cols = ["engines", "batch_groups", "samples", "resumed_per_sample", "cpu_us_per_sample", "engines_only_us",
            "framework_us_per_sample", "samples_per_s_one_core", "samples_per_s"]
    print_table("framework cost per sample, simulated engines (one process, one core)", cols,
                ([r[c] for c in cols] for r in rows))
    meta = {"token_s_at_1024": TOKEN_S_1024, "group_size": 8, "max_staleness": 4, "goal_us_per_sample": 50,
            "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M")}
    out = {"meta": meta, "results": rows, **({"profile": profile} if profile else {})}
    Path(args.out).write_text(json.dumps(out, indent=2))
    if profile:
        print(profile)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
