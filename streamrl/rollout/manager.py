"""RolloutManager: prompts in, scored groups out, into the buffer, while the trainer works.

    run():  controller.acquire -> a record -> a group of `group_size` samples, each an `Episode` run
            by the workflow (runner.py: the sample's requests) -> rewards (judged where the reward
            asks) -> scheduling.deliver -> the buffer

Admission is the controller's (staleness); routing is the pool's; every request of a sample, its
partial resume across weight updates and its replay from a checkpoint, the runner's. How the rollout
is ordered in time is the strategy the manager is given (lockstep.py: `FreeRunning`, or `Lockstep`
for reproducible runs). With `partial="retract"` / `"in_place"` the pool is paused so that in-flight
requests stay in the engines (their KV recomputed / kept): the runner sees each request once, with
per-token versions.

Every group being generated is in `_generating`, each sample as of its last returned round, so
`snapshot()` is the whole rollout side of a checkpoint. The groups run as tasks of one TaskGroup
inside `run()`: when groups keep failing, `run()` raises `RolloutFailed` and takes them all down.

The manager knows nothing about torch or the trainer: it sees token ids, logprobs, versions and rewards.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from ..buffer import RolloutBuffer, StalenessController
from ..config import RolloutConfig
from ..errors import RolloutFailed
from ..types import Group, Sample
from .evaluation import evaluate_agreement
from .lockstep import FreeRunning, Lockstep
from .pools import EnginePool
from .runner import CaptureHost, Context, Episode, Runner, ToolGate, encode_prompt
from .tools import ToolBox
from .workflows import Workflow, is_group_workflow, load_workflow

if TYPE_CHECKING:
    from ..tasks import Task

__all__ = ["RolloutCounters", "RolloutFailed", "RolloutManager"]


@dataclass
class RolloutCounters:
    groups_done: int = 0
    samples_done: int = 0
    tokens_generated: int = 0
    tokens_discarded: int = 0
    partial_resumed: int = 0
    failed: int = 0
    failed_in_a_row: int = 0  # failed groups since the last one that finished
    last_error: str | None = None  # why the last failed group failed, for a user-facing message
    tool_calls: int = 0
    tool_errors: int = 0
    tool_error_causes: dict[str, int] = field(default_factory=dict)  # cause -> failed calls
    tool_s: float = 0.0  # seconds tools ran, summed over calls
    groups_filtered: int = 0  # rollout.dynamic_sampling: groups with equal rewards, not trained
    filtered_in_a_row: int = 0
    prefix_mismatch: int = 0  # capture-endpoint calls whose history rendered unlike the tokens generated
    tool_calls_parsed: int = 0  # tool calls the capture endpoint read from the model's answers
    tool_parse_errors: int = 0  # answers whose tool-call text could not be read (returned as text)


class RolloutManager:
    def __init__(self, cfg: RolloutConfig, *, pool: EnginePool, tokenizer: Any, task: Task, buffer: RolloutBuffer,
                 controller: StalenessController, seed: int = 0, max_failed_in_a_row: int | None = -1,
                 tools: ToolBox | None = None, judge: Any = None, scheduling: FreeRunning | Lockstep | None = None,
                 workflow: Workflow | None = None) -> None:
        """`task`: the prompts it draws from (`train`), the ones it evaluates on (`held_out`) and the
        reward. `max_failed_in_a_row`: after that many failed groups with none finishing in between,
        `run()` raises RolloutFailed instead of hanging (default: four batches' worth); None retries
        failed groups forever. `tools`: what a workflow's model may call. `judge`: the judge client
        (streamrl.judge), given to rewards that take one. `scheduling`: the strategy (default
        `FreeRunning`). `workflow`: an environment's own (rollout.environment), over `rollout.workflow`."""
        if not task.train:
            raise ValueError("RolloutManager needs at least one prompt")
        self.cfg, self.pool, self.tokenizer, self.task, self.judge = cfg, pool, tokenizer, task, judge
        self.buffer, self.controller = buffer, controller
        self.counters = RolloutCounters()
        self.max_failed_in_a_row = 4 * controller.batch_groups if max_failed_in_a_row == -1 else max_failed_in_a_row
        self._rng = random.Random(seed)
        self._order = self._prompt_stream()
        self.prompts_drawn = 0  # records taken from the stream: a resumed run skips as many
        self._generating: dict[str, Group] = {}  # groups admitted and not finished, samples as they stand
        self._restored: list[Group] = []
        self.scheduling = scheduling or FreeRunning(buffer=buffer, pool=pool, seed=seed)
        self.workflow = workflow or load_workflow(cfg.workflow)
        self.multi_turn = workflow is not None or cfg.workflow != "single_turn"
        self.runner = Runner(pool, cfg, self.counters, self.scheduling.seed)
        self.capture = CaptureHost()  # the OpenAI-compatible endpoint, started when an episode asks
        self.ctx = Context(self.runner, tokenizer, tools, self.capture)

    async def aclose(self) -> None:
        await self.capture.aclose()

    def _prompt_stream(self) -> Iterator[dict[str, Any]]:
        """Endless shuffled epochs over the prompts."""
        while True:
            order = list(range(len(self.task.train)))
            self._rng.shuffle(order)
            for i in order:
                yield self.task.train[i]

    def encode(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    @property
    def tool_gate(self) -> ToolGate:
        """The runner's gate: a checkpoint shuts it, so no tool call is half in a snapshot."""
        return self.runner.gate

    # ---- checkpoints -----------------------------------------------------------------------------
    def snapshot(self) -> tuple[bytes, dict[str, int]]:
        """The groups being generated, as msgpack, and the counters a resumed run continues from.

        A sample object is only updated when its request round returns, so each stands as of its
        last round: finished, partial (tokens up to the last interruption) or not started. Resuming
        from this loses at most what the engines decoded since the last weight update, which is where
        the run loop takes checkpoints."""
        groups = list(self._generating.values())
        partial = [s for g in groups for s in g.samples if s.status == "partial"]
        return _groups_encoder.encode(groups), {"prompts_drawn": self.prompts_drawn,
                                                "next_seed": self.scheduling.next_seed,
                                                "generating_groups": len(groups), "partials": len(partial)}

    def restore(self, generating: bytes, *, prompts_drawn: int, next_seed: int) -> list[Group]:
        """Before `run()`: continue the groups of a `snapshot` (their unfinished samples resubmitted
        with prompt + tokens so far) and the prompt stream where it was. The controller must count
        them already (`StalenessController.restore`). Returns the restored groups."""
        for _ in range(prompts_drawn - self.prompts_drawn):
            next(self._order)
        self.prompts_drawn = prompts_drawn
        self.scheduling.next_seed = next_seed
        self._restored = _groups_decoder.decode(generating)
        return self._restored

    @property
    def pause_mode(self) -> str:
        """How the pool holds in-flight requests at a weight update, for `rollout.partial`: `resume` and
        `discard` abort them (they come back to the runner partial); `retract` and `in_place` keep them
        in the engines."""
        return "abort" if self.cfg.partial in ("resume", "discard") else self.cfg.partial

    async def push_weights(self, weights: Any, version: int) -> float:
        """The trainer's weights to the engines, as `version`; returns seconds (in a deterministic run
        once they landed, at their logical point)."""
        return await self.scheduling.publish(weights, version, self.pause_mode, self.rollout_counters)

    def rollout_counters(self) -> dict[str, Any]:
        """What a metrics row reports of the rollout side, as differences between rows (a deterministic
        run's rows read them when the step's weights land)."""
        c, cs = self.counters, self.controller.stats
        return {"tokens": c.tokens_generated, "discarded": c.tokens_discarded + cs.dropped_tokens,
                "resumed": c.partial_resumed, "dropped": cs.dropped_stale, "filtered": c.groups_filtered,
                "drawn": self.prompts_drawn, "buffer_size": len(self.buffer)}

    @property
    def num_partial(self) -> int:
        """Interrupted samples waiting for their next round."""
        return sum(s.status == "partial" for g in self._generating.values() for s in g.samples)

    # ---- the producer loop -----------------------------------------------------------------------
    async def run(self) -> None:
        """Admit and launch groups until cancelled; each finished group goes into the buffer. Raises
        RolloutFailed once `max_failed_in_a_row` groups failed in a row."""
        sched = self.scheduling
        try:
            async with asyncio.TaskGroup() as groups:
                for g in self._restored:
                    groups.create_task(self._run_group(g.meta, g.admitted_version, g))
                self._restored = []
                sched.start()
                while True:
                    version = await self.controller.acquire()
                    record = next(self._order)
                    self.prompts_drawn += 1
                    sched.enter()  # the group's task runs until it waits for the engine
                    groups.create_task(self._run_group(record, version, order=self.prompts_drawn))
        except* RolloutFailed as failed:
            raise failed.exceptions[0] from None
        finally:
            sched.stop()

    async def _run_group(self, record: dict[str, Any], version: int, group: Group | None = None,
                         order: int = 0) -> None:
        """Generate, score and queue one group; `group`: one restored from a checkpoint, whose
        unfinished samples continue from their tokens. `order`: its place in the prompt stream."""
        try:
            await self._group(record, version, group, order)
        finally:
            self.scheduling.leave()

    def _new_group(self, record: dict[str, Any], version: int, order: int) -> Group:
        gid = self.scheduling.group_id(order)
        prompt_ids = self.encode(record["prompt"])
        text = record["prompt"] if isinstance(record["prompt"], str) else self.tokenizer.decode(prompt_ids)
        samples = [Sample(group_id=gid, index=i, prompt_ids=prompt_ids, prompt_text=text,
                          meta={"answer": record.get("answer", "")}) for i in range(self.cfg.group_size)]
        return Group(group_id=gid, samples=samples, admitted_version=version, meta=dict(record))

    async def _group(self, record: dict[str, Any], version: int, group: Group | None, order: int) -> None:
        group = group or self._new_group(record, version, order)
        self._generating[group.group_id] = group
        t0 = time.monotonic()
        try:
            # A restored group may hold finished samples: they are not generated again.
            await self.run_episodes([s for s in group.samples if s.status not in ("completed", "truncated")], record)
            await self._score(group.samples, group.meta)
        except (asyncio.CancelledError, RolloutFailed):  # RolloutFailed: the pool has no engine left
            self.controller.release(version, returned=True)
            raise
        except Exception as e:  # noqa: BLE001 - a failed group is counted and its slot given back
            self.controller.release(version, returned=True)
            self._count_failure(e)
            return
        finally:
            self._generating.pop(group.group_id, None)
        if self.scheduling.wall_clock:
            for s in group.samples:
                s.timings["group_s"] = time.monotonic() - t0
        c = self.counters
        c.groups_done += 1
        c.failed_in_a_row = 0
        c.samples_done += len(group.samples)
        if self.cfg.dynamic_sampling and self._filtered(group):
            self.controller.release(version, returned=True)  # its slot goes to a fresh prompt
            return
        await self.scheduling.deliver(order, group)
        self.controller.release(version)

    async def run_episodes(self, samples: list[Sample], record: dict[str, Any],
                           sampling: dict[str, Any] | None = None) -> None:
        """Samples of `record`, built by the workflow (a group workflow: in one call; else a task each);
        `sampling`: parameters over the rollout's."""
        episodes = [Episode(self.ctx, s, record, sampling) for s in samples]
        try:
            if is_group_workflow(self.workflow):
                await self.workflow(record, episodes)
            else:
                await asyncio.gather(*[self.workflow(record, ep) for ep in episodes])
        finally:
            for ep in episodes:
                ep.close()
        for ep in episodes:
            s = ep.sample
            s.finish_reason = ep.finish or "length"
            s.status = "completed" if s.finish_reason == "stop" else "truncated"

    def _filtered(self, group: Group) -> bool:
        """Dynamic sampling: equal rewards carry no GRPO signal. Raises RolloutFailed once
        `max_draws_per_batch` batches' worth of groups in a row had none."""
        c, rewards = self.counters, {s.reward for s in group.samples}
        if len(rewards) > 1:
            c.filtered_in_a_row = 0
            return False
        c.groups_filtered += 1
        c.filtered_in_a_row += 1
        limit = self.cfg.max_draws_per_batch * self.controller.batch_groups
        if c.filtered_in_a_row >= limit:
            raise RolloutFailed(
                f"dynamic sampling: the last {c.filtered_in_a_row} groups all had equal rewards (the last: "
                f"{rewards.pop()}); the data holds no signal for this policy (raise rollout.max_draws_per_batch, "
                f"now {self.cfg.max_draws_per_batch}, or turn rollout.dynamic_sampling off)")
        return True

    def _count_failure(self, e: Exception) -> None:
        c = self.counters
        c.failed += 1
        c.failed_in_a_row += 1
        c.last_error = f"{type(e).__name__}: {e}"
        if self.max_failed_in_a_row is not None and c.failed_in_a_row >= self.max_failed_in_a_row:
            raise RolloutFailed(f"{c.failed_in_a_row} groups in a row failed ({c.groups_done} finished before "
                                f"them); the last one: {c.last_error}")

    def response_text(self, s: Sample) -> str:
        """What a reward reads: multi-turn samples keep their special tokens (tool tags read as written)."""
        return self.tokenizer.decode(s.response_ids, skip_special_tokens=not s.turns)

    async def _score(self, samples: list[Sample], record: dict[str, Any]) -> None:
        """Each sample's reward; async rewards (a judge) are awaited together. With a judge, each sample
        records its judgments (`meta["judge"]`) and the time its group waited for them (`judge_s`)."""
        t0, pending = time.monotonic(), []
        for s in samples:
            s.response_text = self.response_text(s)
            judge = None
            if self.judge is not None:
                s.meta["judge"] = []  # afresh: a group resumed from a checkpoint may have been half judged
                judge = self.judge.recording(s.meta["judge"])
            # An environment that scores its own episodes (rollout.environment) left the score on the sample.
            r = s.meta["env_reward"] if "env_reward" in s.meta else self.task.score(s.response_text, record, judge)
            if inspect.isawaitable(r):
                pending.append((s, r))
            else:
                s.reward = float(r)
        if pending:
            for (s, _), r in zip(pending, await asyncio.gather(*[r for _, r in pending]), strict=True):
                s.reward = float(r)
        if self.judge is not None:
            for s in samples:
                s.timings["judge_s"] = time.monotonic() - t0

    # ---- evaluation ------------------------------------------------------------------------------
    async def evaluate(self, *, temperature: float, seed: int = 12345, records: list[dict[str, Any]] | None = None,
                       ) -> float:
        """Mean reward (`data.eval_reward`'s) of one response per held-out record (default: the task's),
        through the engines (not the trainer): what a user of the weights would see. NaN without records."""
        return (await evaluate_agreement(self, temperature=temperature, seed=seed, records=records, compare=False))[0]

    async def evaluate_row(self, *, temperature: float, seed: int) -> dict[str, float]:
        """`evaluate` as a metrics row's fields: `eval_sampled`, and `eval/<task>/accuracy` per held-out
        `data_source` (the tasks of a mixed dataset)."""
        score, _, by_source = await evaluate_agreement(self, temperature=temperature, seed=seed, compare=False)
        return {"eval_sampled": score, **{f"eval/{k}/accuracy": v for k, v in by_source.items()}}

    async def evaluate_held_out(self) -> dict[str, float]:
        """Held-out accuracy, greedy and at the rollout temperature (`greedy/<task>`, `sampled/<task>` per
        held-out `data_source`; and the rewards' agreement, where the evaluation has its own reward)."""
        out: dict[str, float] = {}
        for name, temperature in (("greedy", 0.0), ("sampled", self.cfg.temperature)):
            score, agreement, by_source = await evaluate_agreement(self, temperature=temperature)
            out[name] = score
            out |= {f"{name}/{k}": v for k, v in by_source.items()}
            if agreement is not None:
                out[f"agreement_{name}"] = agreement
        return out


_groups_encoder = msgspec.msgpack.Encoder()
_groups_decoder = msgspec.msgpack.Decoder(list[Group])
