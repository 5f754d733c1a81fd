"""The components of a run, built from the config, in one place for `streamrl run` and `streamrl rollout`.

    check(cfg)      before any work: the task, and every check that can be made of the config
    prepare(...)    before any engine or trainer: the policy's starting model (built, the prompts
                    checked against its tokenizer, warm-started) and the judge's (warm-started, its
                    agreement checked against judge.min_agreement)
    assemble(...)   the rollout side inside an AsyncExitStack: the judge on its own pool, the policy's
                    pool, the tools, the scheduling strategy and the RolloutManager that uses them all

Each component is built from its own config section; nothing here decides anything at run time.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .buffer import RolloutBuffer, StalenessController
from .config import Config, ConfigError
from .errors import JudgeRejected
from .judge import Judge, load_parser
from .plugins import PluginError
from .rollout import FreeRunning, Lockstep, RolloutManager, ToolBox, build_pool, check_prompts, preflight
from .tasks import Task, load_task
from .tasks.warm import build_model, prepare_model


@dataclass
class Prepared:
    """What `prepare` made: the task, the policy's starting folder and the judge's (when enabled)."""

    task: Task
    model_dir: str
    warm_start: dict[str, Any] = field(default_factory=dict)
    judge_dir: str | None = None
    judge_warm_start: dict[str, Any] = field(default_factory=dict)


@dataclass
class Rollout:
    """The rollout side of a run, started (its teardown is on the stack it was assembled in)."""

    manager: RolloutManager
    judge: Judge | None

    @property
    def pool(self) -> Any:
        return self.manager.pool


def check(cfg: Config) -> Task:
    """Everything that can be checked before any work: the task and its rewards, the workflow, tools and
    engine installs, the judge's parse rule. A ConfigError naming the key otherwise."""
    preflight(cfg)
    if cfg.rollout.environment == "verifiers":
        return _verifiers_task(cfg)
    task = load_task(cfg.data, seed=cfg.seed, judge=cfg.judge.enabled)
    if cfg.judge.enabled:
        try:
            load_parser(cfg.judge.parse)
        except PluginError as err:
            raise ConfigError("judge.parse", str(err)) from None
    return task


def _verifiers_task(cfg: Config) -> Task:
    """The prompts of a verifiers environment, its process started and holding them (rollout/verifiers_env.py)."""
    from .rollout.verifiers_env import VerifiersEnv

    if cfg.rollout.workflow != "single_turn":
        raise ConfigError("rollout.workflow", "rollout.environment: verifiers runs the environment's own turns; "
                                              "leave rollout.workflow unset")
    env = VerifiersEnv.open(cfg.rollout.verifiers, Path(cfg.run_dir) / "verifiers.log")
    task = env.task(cfg.data.eval_size)
    task.environment = env
    return task


def prepare(cfg: Config, task: Task, *, log: Any = print, start: str | None = None) -> Prepared:
    """The starting models of a run of `task` (`check`ed): the policy's (`start` instead where given: a
    resumed run's checkpoint) and the judge's. The prompts are checked against the policy's tokenizer before its
    warm start; a judge warm-started below `judge.min_agreement` stops here (JudgeRejected)."""
    from transformers import AutoTokenizer

    from .trainer.lora import check_targets

    base = start or build_model(cfg.model, log=log)
    tokenizer = AutoTokenizer.from_pretrained(base)
    check_prompts(task.train + task.held_out, tokenizer, base, cfg.rollout.max_new_tokens)
    if cfg.data.source == "reasoning_gym":
        from .tasks.gym_tasks import check_vocabulary

        check_vocabulary(task.train + task.held_out, tokenizer)
    check_targets(base, cfg.trainer.lora)  # LoRA's target modules are the model's
    out = Prepared(task, base)
    if start is None:
        out.model_dir, out.warm_start = prepare_model(cfg.model, cfg.warm_start, seed=cfg.seed, recipe=task.warm_start,
                                                      log=log)
    j = cfg.judge
    if j.enabled:
        out.judge_dir, out.judge_warm_start = prepare_model(j.model, j.warm_start, seed=cfg.seed,
                                                            recipe=task.judge_warm_start, section="judge.",
                                                            log=lambda m: log(f"judge: {m}"))
        agreement = out.judge_warm_start.get("held_out_agreement")
        if agreement is not None:
            log(f"judge: agrees with exact match on {agreement:.1%} of its warm start's held-out examples")
            check_agreement(cfg, agreement, "its warm start's held-out examples")
    return out


def check_agreement(cfg: Config, agreement: float, where: str) -> None:
    """JudgeRejected when the judge agrees less often than `judge.min_agreement` (where one is set)."""
    least = cfg.judge.min_agreement
    if least is not None and agreement < least:
        raise JudgeRejected(f"the judge agrees with exact match on {agreement:.1%} of {where}, below "
                            f"judge.min_agreement ({least:.0%}): RL on its scores would learn its mistakes")


async def assemble(cfg: Config, stack: AsyncExitStack, prepared: Prepared, *, model_dir: str, tokenizer: Any,
                   controller: StalenessController, buffer: RolloutBuffer, max_failed_in_a_row: int | None = -1,
                   ) -> Rollout:
    """The rollout side over `model_dir`, started inside `stack` (torn down in reverse): the judge first
    up and last down, then the policy's engines and the manager. The tools' MCP servers (tools.mcp) start
    before them all: one that does not start stops the run before any engine does."""
    run_dir = Path(cfg.run_dir)
    tools = ToolBox(cfg.tools) if cfg.rollout.workflow != "single_turn" else None
    if tools is not None:
        stack.push_async_callback(tools.aclose)  # also a start cut short: the servers already up stop
        await tools.start(log_dir=run_dir)
    judge = None
    if prepared.judge_dir is not None:
        from transformers import AutoTokenizer

        judge_pool = build_pool(cfg.judge.engines, prepared.judge_dir, run_dir=run_dir / "judge", seed=cfg.seed)
        judge = await stack.enter_async_context(Judge(cfg.judge, judge_pool, AutoTokenizer.from_pretrained(prepared.judge_dir),
                                                      seed=cfg.seed, warm_start=prepared.judge_warm_start))
    pool = build_pool(cfg.engines, model_dir, run_dir=run_dir, seed=cfg.seed, lora_rank=cfg.trainer.lora.rank)
    if controller.cfg.deterministic:
        steps = (controller.max_groups or 0) // controller.batch_groups
        scheduling: FreeRunning | Lockstep = Lockstep(controller=controller, buffer=buffer, pool=pool, steps=steps,
                                                      seed=cfg.seed)
    else:
        scheduling = FreeRunning(buffer=buffer, pool=pool, seed=cfg.seed)
    workflow = None
    if prepared.task.environment is not None:
        from .rollout.verifiers_env import VerifiersWorkflow

        stack.push_async_callback(prepared.task.environment.aclose)
        workflow = VerifiersWorkflow(prepared.task.environment)
    manager = RolloutManager(cfg.rollout, pool=pool, tokenizer=tokenizer, task=prepared.task, buffer=buffer,
                             controller=controller, seed=cfg.seed, max_failed_in_a_row=max_failed_in_a_row, tools=tools,
                             judge=judge, scheduling=scheduling, workflow=workflow)
    stack.push_async_callback(manager.aclose)
    await stack.enter_async_context(pool)
    return Rollout(manager, judge)
