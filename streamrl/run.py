"""`streamrl run`: the training loop, as actions on components.

    producer:  manager.run: controller admits a group -> pool generates -> reward -> buffer
    consumer:  next_batch (parts, as the controller allows) -> trainer.accumulate ... finish_step
               -> pool.push_weights (pause, load, resume) -> controller.set_version -> metrics row

Synchronous RL is the same loop with `controller.max_staleness = 0`: the controller admits one batch
per version, so the engines wait while the trainer works and nothing is in flight at an update.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .assemble import Prepared, Rollout, assemble, check, check_agreement, prepare
from .buffer import RolloutBuffer, StalenessController, next_batch
from .checkpoint import Resume, load_resume, save_checkpoint
from .colocate import TrainerHandle, colocated
from .config import Config, dump_config
from .metrics import StepMetrics
from .plot import plot_run
from .procs import quiet_gc
from .rollout import EnginePool, RolloutManager
from .trainer import start_trainer


@dataclass
class Run:
    """One run's components, each built from its own config section."""

    cfg: Config
    trainer: TrainerHandle
    pool: EnginePool
    controller: StalenessController
    buffer: RolloutBuffer
    manager: RolloutManager
    metrics: StepMetrics
    base_model: str  # the policy RL started from: the KL reference, also of a resumed run
    rollout: Rollout


async def run(cfg: Config, *, show_progress: bool = True, log: Any = print) -> dict[str, Any]:
    task = check(cfg)  # a bad dataset, reward, workflow, tool or engine install stops here,
    resume = load_resume(cfg)  # as does a checkpoint that cannot continue this config
    t_start, run_dir = time.perf_counter(), Path(cfg.run_dir)
    dump_config(cfg, run_dir / "config.yaml")
    prepared = prepare(cfg, task, log=log, start=resume.model_dir if resume else None)  # models, warm starts
    if resume is None:
        base_model, summary = prepared.model_dir, {"run_dir": str(run_dir), "model_dir": prepared.model_dir,
                                                   "warm_start": prepared.warm_start}
    else:  # the checkpoint's policy, for engines and trainer alike; no warm start
        _, base_model, summary = resume.start(run_dir, log)
    async with AsyncExitStack() as stack:  # torn down in reverse: metrics files, engines, judge, trainer
        r = await build(cfg, stack, prepared, base_model, resume, show_progress)
        summary |= {"resumed_from": resume.restore(r.buffer, r.controller, r.manager)} if resume else {}
        summary |= await train(r, log=log)
        summary |= {"final_model": str(await r.trainer.save(run_dir / "final", merged=cfg.trainer.lora.merge_final))}
        summary |= {"judge": r.rollout.judge.summary()} if r.rollout.judge else {}
    summary |= {"total_wall_s": time.perf_counter() - t_start, "plot": plot_run(run_dir, log)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


async def build(cfg: Config, stack: AsyncExitStack, prepared: Prepared, base_model: str, resume: Resume | None,
                show_progress: bool) -> Run:
    sched, run_dir, model_dir = cfg.schedule, Path(cfg.run_dir), prepared.model_dir
    trainer = start_trainer(cfg.trainer, model_dir, temperature=cfg.rollout.temperature, ref_model_path=base_model,
                            **(resume.trainer_state() if resume else {}))
    stack.push_async_callback(trainer.aclose)
    # Every admitted group is trained (a dropped one gives its slot back): an async run generates the
    # same sample budget as a sync one, not η batches more that it never trains.
    controller = StalenessController(cfg.controller, batch_groups=sched.batch_groups,
                                     max_groups=sched.steps * sched.batch_groups)
    buffer = RolloutBuffer(cfg.buffer, on_drop=controller.dropped)
    rollout = await assemble(cfg, stack, prepared, model_dir=model_dir, tokenizer=trainer.tokenizer,
                             controller=controller, buffer=buffer)
    trainer = colocated(trainer, rollout.pool, cfg.engines)  # engines.colocate: one GPU, taken in turns
    if cfg.engines.urls or resume is not None:
        # user-run servers may hold other weights, a resumed run's engines need the checkpoint's version
        await rollout.pool.push_weights(trainer.weights(), trainer.version, pause=None)
    metrics = StepMetrics(run_dir, sched.steps, manager=rollout.manager, save_samples=cfg.save_samples,
                          append=resume is not None, progress=show_progress, logging=cfg.logging, run_config=cfg)
    stack.push_async_callback(metrics.aclose)
    return Run(cfg, trainer, rollout.pool, controller, buffer, rollout.manager, metrics, base_model, rollout)


async def train(r: Run, *, log: Any) -> dict[str, Any]:
    sched, before = r.cfg.schedule, await r.manager.evaluate_held_out()
    log(f"held-out accuracy before RL: greedy {before['greedy']:.3f}, sampled {before['sampled']:.3f}")
    if "agreement_sampled" in before and r.rollout.judge is not None:
        check_agreement(r.cfg, min(before["agreement_sampled"], before["agreement_greedy"]),
                        "the held-out responses before RL")
    await r.metrics.start()
    quiet_gc()  # before the loop: startup's objects leave the collector's walks
    try:
        async with asyncio.TaskGroup() as tg:  # a failed producer or push stops the loop at once
            producer = tg.create_task(r.manager.run(), name="rollout-manager")
            push: asyncio.Task[None] = tg.create_task(asyncio.sleep(0))  # a step's weight push (none yet)
            for step in range(r.trainer.version + 1, sched.steps + 1):  # one version per step
                stats = await train_step(r, push)
                push = tg.create_task(publish(r, step, stats), name="publish")
                if sched.save_every and step % sched.save_every == 0:
                    await push  # the checkpoint holds the rollout side as of this step
                    await save_checkpoint(r, step)
            await push
            producer.cancel()
    except* Exception as failed:  # the first error, as the user should see it
        raise failed.exceptions[0] from None
    await r.pool.abort_all()
    return {"eval_before": before, "train_wall_s": time.perf_counter() - r.metrics.t0, "steps": sched.steps,
            "eval_after": await r.manager.evaluate_held_out(), "samples": r.trainer.samples,
            "groups_admitted": r.controller.stats.admitted, "groups_generated": r.manager.counters.groups_done,
            "requests_lost_with_a_replica": r.pool.stats().get("lost_requests", 0),
            **{k: v for k, v in r.pool.stats().items() if k.startswith("servers_")}}


async def train_step(r: Run, push: asyncio.Task[None]) -> dict[str, Any]:
    """One optimizer step: the batch's parts go to the trainer as the controller lets them be trained
    (it computes while the rest still generates); the step itself waits for the last step's push."""
    t0, groups, parts = time.perf_counter(), [], 0
    async for part in next_batch(r.buffer, r.controller, r.cfg.schedule.batch_groups, whole=r.manager.scheduling.whole_batches):
        await r.trainer.accumulate(part)
        groups, parts = groups + part, parts + 1
    await push  # the optimizer must not write weights the push still reads
    stats = await r.trainer.finish_step()
    r.metrics.write_groups(groups)
    r.controller.trainer_stepped(r.trainer.version)  # the next batch is composed against it
    return stats | {"batch_parts": parts, "trainer_wait_s": time.perf_counter() - t0 - stats["train_s"]}


async def publish(r: Run, step: int, stats: dict[str, Any]) -> None:
    """The step's weights to every engine (every `push_every`-th step, the last, and before an
    evaluation: between pushes the engines lag, and every token carries its version), then its row."""
    sched, version = r.cfg.schedule, stats["version"]
    evaluating = bool(sched.eval_every) and step % sched.eval_every == 0
    extra: dict[str, Any] = {"weight_sync_s": 0.0}
    if step % sched.push_every == 0 or step == sched.steps or evaluating:
        extra["weight_sync_s"] = await r.manager.push_weights(r.trainer.weights(), version)
        r.controller.set_version(version)  # admission goes on at the new version
    if evaluating:
        extra |= await r.manager.evaluate_row(temperature=r.cfg.rollout.temperature, seed=step)  # and per task
    await r.metrics.write(step, stats, **extra)
