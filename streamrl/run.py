"""`streamrl run`: the whole training loop, as actions on components.

    producer:  manager admits groups (controller) -> pool generates -> rewards -> buffer
    consumer:  buffer batch (in parts, as they may be trained) -> trainer step (own process)
               -> pause(abort) -> weights to every engine
               -> resume -> interrupted samples continue with the new version

Synchronous RL is the same loop with `controller.max_staleness = 0`: the controller then admits exactly
one batch per version, so the engines wait while the trainer works and nothing is ever in flight at
a weight update.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from .buffer import RolloutBuffer
from .buffer.controller import StalenessController
from .builders import TaskData, build_pool, check_context, load_task, prepare_model, vllm_python
from .checkpoint import Resume, continue_outputs, load_resume, save_checkpoint
from .config import Config, dump_config
from .engine.torch_engine import resolve_device
from .progress import RunProgress
from .rollout.manager import RolloutFailed, RolloutManager, RolloutSettings
from .rollout.pools import EnginePool
from .trainer.losses import LossConfig
from .trainer.process import TrainerProcess
from .trainer.trainer import Trainer, TrainerSettings
from .types import Group, encode_jsonl

T = TypeVar("T")


async def evaluate(manager: RolloutManager, pool: EnginePool, records: list[dict], temperature: float,
                   max_new_tokens: int, seed: int = 12345) -> float:
    """Held-out accuracy through the engines (not the trainer): what a user of the weights would see."""
    if not records:
        return float("nan")

    async def one(i: int, r: dict) -> float:
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "sampling_seed": seed + i}
        res = await pool.generate(manager.encode(r["prompt"]), params, f"eval-{seed}-{i}-{time.monotonic_ns()}")
        try:
            out = manager.reward_fn(manager.decode(res["output_ids"]), r.get("answer", ""))
            return float(await out) if asyncio.iscoroutine(out) else float(out)
        except Exception as e:  # noqa: BLE001 - a user's reward function: say so in one line
            raise RolloutFailed(f"held-out evaluation: the reward function raised {type(e).__name__}: {e}") from e

    scores = await asyncio.gather(*[one(i, r) for i, r in enumerate(records)])
    return sum(scores) / len(scores)


async def batch_parts(buffer: RolloutBuffer, ctl: StalenessController, size: int, *,
                      stream: bool = True) -> AsyncIterator[list[Group]]:
    """The next batch: `size` groups that satisfy the controller (within max_staleness or kept by
    policy, within the off-policy fraction cap), oldest first. Drops free admission slots, so the
    manager refills with fresh groups.

    With `stream`, the batch comes in parts: each part as soon as the controller allows it
    (`takeable`), so the trainer computes the finished groups while the batch's overdue ones (a long
    sample due at this version) still generate, instead of idling until they are done. Without it,
    the whole batch once none of it is missing.
    """
    if not stream:
        await ctl.wait_for_oldest()  # never train past a group that would then be too stale
    taken, offp, whole = 0, 0, []
    while taken < size:
        want = room = size - taken
        if stream:
            # Any group may fill one of the k places that no overdue group needs: take what is here.
            want = min(await ctl.wait_takeable(room), max(1, len(buffer)))
        got = await buffer.get_batch(want, accept=ctl.accept)
        kept, offp = ctl.compose(got, offpolicy_taken=offp)
        ctl.consumed(kept)
        await ctl.poke()
        taken += len(kept)
        if not stream:
            whole += kept
        elif kept:
            yield kept
    if not stream:
        yield whole


# How the pool is paused for a weight update, per `rollout.partial`: `resume`/`discard` abort every
# in-flight request (the manager resubmits it); `retract`/`in_place` keep it in the engine.
PAUSE_MODE = {"resume": "abort", "discard": "abort", "retract": "retract", "in_place": "in_place"}


async def sync_weights(pool: EnginePool, trainer: Trainer | TrainerProcess, version: int,
                       partial: str = "resume") -> float:
    """Interrupt generation, push the trainer's weights (those of `version`) to every replica, resume.
    Returns seconds."""
    t0 = time.perf_counter()
    weights = trainer.state_dict_for_engines()
    await pool.stage_weights(weights, version)  # engines keep generating meanwhile
    # Aborted samples come back partial; the manager resubmits them at once and the paused engines
    # hold them until they resume with the new weights. Retracted or frozen ones never leave.
    await pool.pause(PAUSE_MODE[partial])
    await pool.update_weights(weights, version)
    await pool.resume()
    return time.perf_counter() - t0


async def unless_push_failed(aw: Awaitable[T], push: asyncio.Task | None) -> T:
    """Await `aw` (the next part of a batch), unless the weight push running beside it fails first:
    then raise the push's error at once, instead of waiting on generation that will not come back."""
    task = asyncio.ensure_future(aw)
    if push is not None and not push.done():
        await asyncio.wait({task, push}, return_when=asyncio.FIRST_COMPLETED)
    if push is not None and push.done() and not push.cancelled() and (err := push.exception()) is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise err
    return await task


async def poll_stats(pool: EnginePool) -> tuple[float, dict[str, Any]]:
    """The pool's stats and when they were read. A server answers between two engine steps (a large
    prefill right after a weight update takes tens of ms), so the run loop reads them off its path."""
    await pool.refresh_stats()
    return time.perf_counter(), pool.stats()


async def run(cfg: Config, *, show_progress: bool = True, log: Any = print) -> dict[str, Any]:
    task: TaskData = load_task(cfg)  # first: a bad dataset or reward spec stops before any work
    if cfg.engines.backend == "vllm" and not cfg.engines.urls:
        vllm_python(cfg)  # a missing vLLM install stops here too, not after the warm start
    resume = load_resume(cfg)  # a checkpoint that cannot continue this config stops here too
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    torch.manual_seed(cfg.seed)
    t_start = time.perf_counter()

    if resume is None:
        model_dir, warm = prepare_model(cfg, log)
        base_model = model_dir
    else:  # the checkpoint's policy, for engines and trainer alike; no warm start
        model_dir, warm, base_model = str(resume.path), None, resume.state.base_model
        log(f"resuming from {resume.path} (step {resume.state.step})")
    check_context(cfg, model_dir, task)
    tr = cfg.trainer
    settings = TrainerSettings(
        lr=tr.lr, weight_decay=tr.weight_decay, grad_clip=tr.grad_clip, device=resolve_device(tr.device),
        micro_batch_tokens=tr.micro_batch_tokens, micro_batch_padding=tr.micro_batch_padding,
        skip_zero_advantage=tr.skip_zero_advantage, ppo_minibatches=tr.ppo_minibatches, ref_model_path=base_model,
        # Engines report greedy logprobs at T=1, sampled ones at the rollout temperature.
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
        loss=LossConfig(kind=tr.loss, clip_eps=tr.clip_eps, clip_eps_high=tr.clip_eps_high,
                        behav_imp_weight_cap=tr.behav_imp_weight_cap, tis_cap=tr.tis_cap, kl_coef=tr.kl_coef),
    )
    # Its own process on CPU: beside the rollout manager's event loop a trainer thread loses time to
    # the GIL (docs/async.md). A GPU trainer stays in-process.
    version, opt = (0, None) if resume is None else (resume.state.version, resume.optimizer)
    trainer: Trainer | TrainerProcess = (
        TrainerProcess(model_dir, settings, threads=tr.threads, version=version, optimizer_state=opt)
        if tr.own_process and settings.device == "cpu"
        else Trainer(model_dir, settings, version=version, optimizer_state=opt)
    )
    try:
        return await _train(cfg, task, trainer, model_dir, base_model, warm, resume, run_dir, t_start, log,
                            show_progress)
    finally:
        if isinstance(trainer, TrainerProcess):
            trainer.close()


async def _train(cfg: Config, task: TaskData, trainer: Trainer | TrainerProcess, model_dir: str, base_model: str,
                 warm: Any, resume: Resume | None, run_dir: Path, t_start: float, log: Any,
                 show_progress: bool) -> dict[str, Any]:
    tr = cfg.trainer
    train_exec = ThreadPoolExecutor(1, "trainer", initializer=lambda: torch.set_num_threads(tr.threads))
    pool = build_pool(cfg, model_dir)
    ctl = StalenessController(
        batch_groups=tr.batch_groups, max_staleness=cfg.controller.max_staleness,
        max_offpolicy_fraction=cfg.controller.max_offpolicy_fraction, stale_policy=cfg.controller.stale_policy,
        max_concurrent_groups=cfg.rollout.max_concurrent_groups,
        # Every admitted group is trained (a dropped one gives its slot back): async runs generate
        # the same sample budget as sync ones, not η batches more that the run never trains.
        max_groups=tr.steps * tr.batch_groups,
    )
    # A group dropped for staleness frees an admission slot: wake the manager so a fresh group
    # replaces it even if the trainer is still waiting inside get_batch.
    pokes: set[asyncio.Task] = set()

    def on_reject(_: object) -> None:
        t = asyncio.get_running_loop().create_task(ctl.poke())
        pokes.add(t)
        t.add_done_callback(pokes.discard)

    buffer = RolloutBuffer(priority=cfg.buffer.priority, capacity=cfg.buffer.capacity, on_reject=on_reject)
    ro = cfg.rollout
    manager = RolloutManager(
        pool=pool, tokenizer=trainer.tokenizer, prompts=task.train, reward_fn=task.reward_fn, buffer=buffer,
        controller=ctl, seed=cfg.seed,
        # Four batches' worth of groups failing with none finishing: stop with the reason, not hang.
        max_failed_in_a_row=4 * tr.batch_groups,
        settings=RolloutSettings(group_size=ro.group_size, max_new_tokens=ro.max_new_tokens,
                                 temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k, partial=ro.partial),
    )
    summary: dict[str, Any] = {"run_dir": str(run_dir), "model_dir": model_dir, "warm_start": warm}
    first_step, samples_total = 1, 0
    if resume is not None:
        summary["resumed_from"] = resume.restore(buffer, ctl, manager)
        first_step, samples_total = resume.state.step + 1, resume.state.samples
        continue_outputs(run_dir, resume.state.step, tr.batch_groups)
    mode = "w" if resume is None else "a"
    metrics_file = (run_dir / "metrics.jsonl").open(mode)
    samples_file = (run_dir / "samples.jsonl").open(mode + "b") if cfg.save_samples else None
    poll: asyncio.Task | None = None
    pushing: asyncio.Task | None = None  # a step's weight push and metrics row, beside the next step's parts
    try:
        await pool.start()  # inside try: servers already launched are stopped if this fails
        if cfg.engines.urls or resume is not None:
            # Servers the user runs may hold other weights (a previous run's policy): start them from
            # the trainer's, so version 0 means the same weights everywhere. A resumed run's engines
            # loaded the checkpoint's policy; this gives them its version too.
            await pool.update_weights(trainer.state_dict_for_engines(), trainer.version)
        summary["eval_before"] = {
            "greedy": await evaluate(manager, pool, task.held_out, 0.0, ro.max_new_tokens),
            "sampled": await evaluate(manager, pool, task.held_out, ro.temperature, ro.max_new_tokens),
        }
        log(f"held-out accuracy before RL: greedy {summary['eval_before']['greedy']:.3f}, "
            f"sampled {summary['eval_before']['sampled']:.3f}")
        t_ps, ps = await poll_stats(pool)  # the held-out evaluation's engine time is not the first step's
        producer = asyncio.create_task(manager.run(), name="rollout-manager")
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        last = {"t": t0, "t_ps": t_ps, "busy": ps["busy_s"], "prefill": ps.get("prefill_s", 0.0), "tokens": 0,
                "discarded": 0, "resumed": 0, "dropped": 0}

        def row_of(step: int, stats: dict[str, Any], sync_s: float, wait_s: float, train_s: float, n_parts: int,
                   t_ps: float, ps: dict[str, Any], now: float) -> dict[str, Any]:
            nonlocal last
            dt, dt_ps = now - last["t"], t_ps - last["t_ps"]
            c = manager.counters
            row = {
                "step": step, "version": stats["version"], "wall_s": round(now - t0, 4),
                "samples": stats["samples_total"], "reward_mean": stats["reward_mean"],
                "tokens_generated": c.tokens_generated - last["tokens"],
                "gen_tps": (c.tokens_generated - last["tokens"]) / dt if dt > 0 else 0.0,
                "loss": stats["loss"], "logprob_mismatch": stats["logprob_mismatch"],
                "logprob_diff": stats["logprob_diff_all"],
                "staleness_mean": stats["staleness_mean"], "staleness_max": stats["staleness_max"],
                "partial_resumed": c.partial_resumed - last["resumed"],
                "tokens_discarded": (c.tokens_discarded + ctl.stats.dropped_tokens) - last["discarded"],
                "dropped_stale": ctl.stats.dropped_stale - last["dropped"],
                # Over the interval between the last two stats reads: up to one step behind.
                "engine_idle_frac": max(0.0, 1 - (ps["busy_s"] - last["busy"]) / (dt_ps * pool.num_replicas)),
                # Engine seconds spent in prefill: prompts, plus partials recomputed after an update.
                "engine_prefill_s": ps.get("prefill_s", 0.0) - last["prefill"],
                "trainer_wait_s": wait_s, "train_s": train_s, "weight_sync_s": sync_s, "batch_parts": n_parts,
                "clip_frac": stats.get("clip_frac", 0.0), "grad_norm": stats["grad_norm"],
                "skipped_samples": stats["skipped_samples"],
                "buffer_size": len(buffer),
            }
            if ctl.stats.decisions:
                row["controller"] = ctl.drain_decisions()[-5:]
            last = {"t": now, "t_ps": t_ps, "busy": ps["busy_s"], "prefill": ps.get("prefill_s", 0.0),
                    "tokens": c.tokens_generated, "discarded": c.tokens_discarded + ctl.stats.dropped_tokens,
                    "resumed": c.partial_resumed, "dropped": ctl.stats.dropped_stale}
            return row

        async def publish(step: int, stats: dict[str, Any], wait_s: float, train_s: float, n_parts: int) -> None:
            """The step's weights to every engine, then its metrics row. Runs while the trainer already
            computes on the next batch's finished groups (the trainer only reads the weights there, as
            the push does; its next optimizer step waits for this)."""
            nonlocal poll
            evaluating = bool(tr.eval_every) and step % tr.eval_every == 0
            sync_s = 0.0
            # Between pushes the engines keep generating with older weights: fewer interruptions,
            # and the controller counts the lag in every token's version.
            if step % tr.push_every == 0 or step == tr.steps or evaluating:
                sync_s = await sync_weights(pool, trainer, stats["version"], ro.partial)
                await ctl.set_version(stats["version"])  # admission goes on at the new version
            # The stats read at the end of the previous step (done long since): never a wait here.
            t_ps, ps = await (poll or poll_stats(pool))
            poll = asyncio.create_task(poll_stats(pool))
            row = row_of(step, stats, sync_s, wait_s, train_s, n_parts, t_ps, ps, time.perf_counter())
            if evaluating:
                row["eval_sampled"] = await evaluate(manager, pool, task.held_out, ro.temperature,
                                                     ro.max_new_tokens, seed=step)
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            bar.update(step, row)

        with RunProgress(tr.steps, enabled=show_progress) as bar:
            for step in range(first_step, tr.steps + 1):
                # The batch's parts as they may be trained; the trainer computes one while the next
                # is still generating (and while the last step's weights go out), and only the
                # optimizer step waits for the whole batch.
                groups, wait_s, train_s, n_parts = [], 0.0, 0.0, 0
                parts = batch_parts(buffer, ctl, tr.batch_groups, stream=tr.stream_batch)
                tw = time.perf_counter()
                while (part := await unless_push_failed(manager.or_failure(anext(parts, None)), pushing)) is not None:
                    t_train = time.perf_counter()
                    wait_s += t_train - tw
                    groups += part
                    n_parts += 1
                    await loop.run_in_executor(train_exec, trainer.accumulate, part)
                    tw = time.perf_counter()
                    train_s += tw - t_train
                if pushing is not None:  # the optimizer must not write weights the push still reads
                    await pushing
                    pushing = None
                wait_s += time.perf_counter() - tw
                if samples_file is not None:
                    samples_file.write(encode_jsonl(groups))
                t_train = time.perf_counter()
                stats = await loop.run_in_executor(train_exec, trainer.finish_step)
                train_s += time.perf_counter() - t_train
                samples_total += stats["trained_samples"]
                stats.update(version=trainer.version, samples_total=samples_total)
                await ctl.trainer_stepped(trainer.version)  # the next batch is composed at the new version
                pushing = asyncio.create_task(publish(step, stats, wait_s, train_s, n_parts), name="publish")
                if tr.save_every and step % tr.save_every == 0:
                    # The checkpoint holds the buffer as of this step: nothing of the next batch taken yet.
                    await pushing
                    pushing = None
                    await save_checkpoint(run_dir / "checkpoints" / f"step-{step}", trainer=trainer, buffer=buffer,
                                          manager=manager, step=step, samples=samples_total, base_model=base_model,
                                          executor=train_exec)
            if pushing is not None:
                await pushing
                pushing = None
        await manager.stop()
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await pool.abort_all()
        summary["train_wall_s"] = time.perf_counter() - t0
        summary["eval_after"] = {
            "greedy": await evaluate(manager, pool, task.held_out, 0.0, ro.max_new_tokens),
            "sampled": await evaluate(manager, pool, task.held_out, ro.temperature, ro.max_new_tokens),
        }
        summary["requests_lost_with_a_replica"] = pool.stats().get("lost_requests", 0)
        summary["groups_admitted"] = ctl.stats.admitted
        summary["groups_generated"] = manager.counters.groups_done
    finally:
        for t in (pushing, poll):
            if t is not None:
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
        metrics_file.close()
        if samples_file is not None:
            samples_file.close()
        await manager.stop()
        await pool.aclose()
        train_exec.shutdown(wait=True)
    summary["final_model"] = str(trainer.save(run_dir / "final"))
    summary["total_wall_s"] = time.perf_counter() - t_start
    summary["steps"] = tr.steps
    summary["samples"] = samples_total
    summary["plot"] = _plot(run_dir, log)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _plot(run_dir: Path, log: Any) -> str | None:
    """`RUN_DIR/metrics.png`; a plot that cannot be drawn is a warning, never a failed run."""
    from .plot import plot_runs

    try:
        return str(plot_runs({run_dir.name: run_dir}, run_dir / "metrics.png", title=f"streamrl run: {run_dir}"))
    except Exception as e:  # noqa: BLE001 - the run's results are already written
        log(f"warning: no metrics.png ({type(e).__name__}: {e})")
        return None
