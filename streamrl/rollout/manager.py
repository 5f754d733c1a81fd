"""RolloutManager: prompts in, scored groups out, into the buffer, while the trainer works.

One group = `group_size` samples of one prompt, generated concurrently through the pool. Admission is
the controller's (staleness); routing is the pool's. When a weight update interrupts generation
(pool paused with mode abort), every in-flight sample comes back with its partial tokens and
logprobs; the manager resubmits prompt + partial response with the remaining token budget at once:
the paused engines hold it and start it with the new weights when they resume. The new tokens carry
the new weight version. With `partial="discard"` the partial tokens are thrown away and the sample
restarts (for comparison). With `partial="retract"` / `"in_place"` the pool is paused so that
in-flight requests stay in the engines (their KV recomputed / kept): the manager sees each sample
once, with per-token versions.

Every group being generated is in `_generating`, each sample as of its last returned round, so
`snapshot()` is the whole rollout side of a checkpoint. The groups run as tasks of one TaskGroup
inside `run()`: when groups keep failing, `run()` raises `RolloutFailed` and takes them all down.

The manager knows nothing about torch or the trainer: it sees token ids, logprobs, versions and rewards.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from ..buffer import RolloutBuffer, StalenessController
from ..config import ConfigError, RolloutConfig, ToolsConfig
from ..judge import recording
from ..types import Group, Sample
from .episode import Episode, ToolGate
from .evaluation import evaluate_agreement
from .lockstep import make_deterministic
from .pools import EnginePool
from .tools import ToolBox
from .workflows import load_workflow

if TYPE_CHECKING:
    from ..tasks import Task
    from .capture import CaptureServer


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
    tool_s: float = 0.0  # seconds tools ran, summed over calls
    groups_filtered: int = 0  # rollout.dynamic_sampling: groups with equal rewards, not trained
    filtered_in_a_row: int = 0
    prefix_mismatch: int = 0  # OpenAI-endpoint calls whose history rendered unlike the tokens generated


class RolloutFailed(RuntimeError):
    """Groups keep failing (an engine rejecting every request, a reward function that raises): the
    manager stopped instead of retrying them forever."""


class RolloutManager:
    def __init__(
        self,
        cfg: RolloutConfig,
        *,
        pool: EnginePool,
        tokenizer: Any,
        task: Task,
        buffer: RolloutBuffer,
        controller: StalenessController,
        seed: int = 0,
        max_failed_in_a_row: int | None = -1,
        tools: ToolsConfig | None = None,
    ) -> None:
        """`task`: the prompts it draws from (`train`), the ones it evaluates on (`held_out`) and the
        reward. `max_failed_in_a_row`: after that many failed groups with none finishing in between,
        `run()` raises RolloutFailed instead of hanging (default: four batches' worth); None retries
        failed groups forever. `tools`: what a workflow's model may call (`rollout.workflow` other
        than single_turn)."""
        if not task.train:
            raise ValueError("RolloutManager needs at least one prompt")
        self.cfg = cfg
        self.pool = pool
        self.tokenizer = tokenizer
        self.task = task
        self.prompts = task.train
        self.buffer = buffer
        self.controller = controller
        self.counters = RolloutCounters()
        self.max_failed_in_a_row = 4 * controller.batch_groups if max_failed_in_a_row == -1 else max_failed_in_a_row
        self._rng = random.Random(seed)
        self._order = self._prompt_stream()
        self.prompts_drawn = 0  # records taken from the stream: a resumed run skips as many
        self._next_seed = seed * 1_000_003  # sampling seeds, one per request round
        self._generating: dict[str, Group] = {}  # groups admitted and not finished, samples as they stand
        self._restored: list[Group] = []
        self.workflow = load_workflow(cfg.workflow)
        self.tools = ToolBox(tools or ToolsConfig()) if self.workflow is not None else None
        self.tool_gate = ToolGate()  # a checkpoint shuts it: no tool call half in a snapshot
        self._capture: CaptureServer | None = None  # the OpenAI-compatible endpoint, once a workflow asks
        self._capture_lock = asyncio.Lock()
        self._seed = seed
        # controller.deterministic: scheduling by logical events (lockstep.py)
        self.lockstep = make_deterministic(self) if controller.cfg.deterministic else None

    async def capture(self) -> CaptureServer:
        """The OpenAI-compatible endpoint whose sessions are episodes, started on first use."""
        async with self._capture_lock:  # the group's episodes ask at once: one server for all
            if self._capture is None:
                from .capture import CaptureServer  # aiohttp: loaded only for workflows that ask

                server = CaptureServer()
                await server.start()
                self._capture = server
        return self._capture

    async def aclose(self) -> None:
        if self._capture is not None:
            await self._capture.aclose()

    def _prompt_stream(self) -> Iterator[dict[str, Any]]:
        """Endless shuffled epochs over the prompts."""
        while True:
            order = list(range(len(self.prompts)))
            self._rng.shuffle(order)
            for i in order:
                yield self.prompts[i]

    def encode(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check_context(self, model_dir: str) -> None:
        """The longest prompt plus `max_new_tokens` must fit the model's context (`max_position_embeddings`
        in its config.json): otherwise every long request fails inside the engines. A ConfigError
        naming the key, before any engine starts."""
        context_len = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
        records = self.task.train + self.task.held_out
        if not isinstance(context_len, int):
            return  # the model does not say; the engines will
        longest = max(len(self.encode(r["prompt"])) for r in records)
        n = self.cfg.max_new_tokens
        if longest + n > context_len:
            raise ConfigError("rollout.max_new_tokens", f"{n} new tokens after the longest prompt ({longest} tokens) "
                              f"exceed the model's context of {context_len} (max_position_embeddings); at most "
                              f"{context_len - longest}")

    # ---- checkpoints -----------------------------------------------------------------------------
    def snapshot(self) -> tuple[bytes, dict[str, int]]:
        """The groups being generated, as msgpack, and the counters a resumed run continues from.

        A sample object is only updated when its request round returns, so each stands as of its
        last round: finished, partial (tokens up to the last interruption) or not started. Resuming
        from this loses at most what the engines decoded since the last weight update, which is where
        the run loop takes checkpoints."""
        groups = list(self._generating.values())
        partial = [s for g in groups for s in g.samples if s.status == "partial"]
        return _groups_encoder.encode(groups), {"prompts_drawn": self.prompts_drawn, "next_seed": self._next_seed,
                                                "generating_groups": len(groups), "partials": len(partial)}

    def restore(self, generating: bytes, *, prompts_drawn: int, next_seed: int) -> list[Group]:
        """Before `run()`: continue the groups of a `snapshot` (their unfinished samples resubmitted
        with prompt + tokens so far) and the prompt stream where it was. The controller must count
        them already (`StalenessController.restore`). Returns the restored groups."""
        for _ in range(prompts_drawn - self.prompts_drawn):
            next(self._order)
        self.prompts_drawn = prompts_drawn
        self._next_seed = next_seed
        self._restored = _groups_decoder.decode(generating)
        return self._restored

    @property
    def pause_mode(self) -> str:
        """How the pool holds in-flight requests at a weight update, for `rollout.partial`: `resume` and
        `discard` abort them (they come back here partial); `retract` and `in_place` keep them in the
        engines."""
        return "abort" if self.cfg.partial in ("resume", "discard") else self.cfg.partial

    async def push_weights(self, weights: Any, version: int) -> float:
        """The trainer's weights to the engines, as `version`; returns seconds. In a deterministic run they
        land at their logical point (`Lockstep.publish`), and this returns then."""
        if self.lockstep is not None:
            return await self.lockstep.publish(weights, version)
        return await self.pool.push_weights(weights, version, self.pause_mode)

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
        try:
            async with asyncio.TaskGroup() as groups:
                for g in self._restored:
                    groups.create_task(self._run_group(g.meta, g.admitted_version, g))
                self._restored = []
                if self.lockstep is not None:
                    self.lockstep.start()
                while True:
                    version = await self.controller.acquire()
                    record = next(self._order)
                    self.prompts_drawn += 1
                    if self.lockstep is not None:
                        self.lockstep.enter()  # the group's task runs until it waits for the engine
                    groups.create_task(self._run_group(record, version, order=self.prompts_drawn))
        except* RolloutFailed as failed:
            raise failed.exceptions[0] from None
        finally:
            if self.lockstep is not None:
                self.lockstep.stop()

    async def _run_group(self, record: dict[str, Any], version: int, group: Group | None = None,
                         order: int = 0) -> None:
        """Generate, score and queue one group; `group`: one restored from a checkpoint, whose
        unfinished samples continue from their tokens. `order`: its place in the prompt stream."""
        try:
            await self._group(record, version, group, order)
        finally:
            if self.lockstep is not None:
                self.lockstep.leave()

    async def _group(self, record: dict[str, Any], version: int, group: Group | None, order: int) -> None:
        if group is None:
            # Reproducible runs name groups by their place in the stream (their requests are admitted in id order).
            gid = f"g{order}" if self.lockstep is not None else uuid.uuid4().hex[:12]
            prompt_ids = self.encode(record["prompt"])
            text = record["prompt"] if isinstance(record["prompt"], str) else self.tokenizer.decode(prompt_ids)
            samples = [
                Sample(group_id=gid, index=i, prompt_ids=prompt_ids, prompt_text=text,
                       meta={"answer": record.get("answer", "")})
                for i in range(self.cfg.group_size)
            ]
            group = Group(group_id=gid, samples=samples, admitted_version=version, meta=dict(record))
        self._generating[group.group_id] = group
        t0 = time.monotonic()
        try:
            if self.workflow is None:
                await self._generate(group.samples)
            else:
                await asyncio.gather(*[self._run_episode(s, record) for s in group.samples
                                       if s.status not in ("completed", "truncated")])
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
        if self.lockstep is None:  # a reproducible run's samples hold nothing of wall time
            for s in group.samples:
                s.timings["group_s"] = time.monotonic() - t0
        c = self.counters
        c.groups_done += 1
        c.failed_in_a_row = 0
        c.samples_done += len(group.samples)
        if self.cfg.dynamic_sampling and self._filtered(group):
            self.controller.release(version, returned=True)  # its slot goes to a fresh prompt
            return
        if self.lockstep is not None:
            self.lockstep.finished(order, group)
        else:
            await self.buffer.put(group)
        self.controller.release(version)

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

    async def _run_episode(self, s: Sample, record: dict[str, Any]) -> None:
        assert self.workflow is not None
        ep = Episode(self, s, record)
        try:
            await self.workflow(record, ep)
        finally:
            for url in ep.openai_urls:  # its OpenAI-endpoint sessions end with it
                assert self._capture is not None
                self._capture.close_session(url)
        last = next((t for t in reversed(s.turns) if t.kind == "model"), None)
        s.finish_reason = last.finish if last is not None else "length"
        s.status = "completed" if s.finish_reason == "stop" else "truncated"

    def take_seed(self, rid: str | None = None) -> int:
        if self.lockstep is not None and rid is not None:  # a function of the request, not of when it asks
            return int.from_bytes(hashlib.blake2b(f"{self._seed}:{rid}".encode(), digest_size=8).digest()) >> 1
        self._next_seed += 1
        return self._next_seed - 1

    def sampling_params(self, max_new_tokens: int, stop: list[str] | None = None,
                        seed: int | None = None, rid: str | None = None) -> dict[str, Any]:
        """One request's sampling parameters, with `seed` or the next sampling seed (of `rid`, in a
        deterministic run)."""
        cfg = self.cfg
        params = {"max_new_tokens": max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p,
                  "top_k": cfg.top_k, "sampling_seed": self.take_seed(rid) if seed is None else seed}
        if stop:
            params["stop"] = stop
        return params

    async def _generate(self, samples: list[Sample]) -> None:
        """Generate a group's samples to the end: one `generate_many` call per round (a single HTTP
        request where the server takes batches). A weight update ends a round early; interrupted
        samples keep their partial tokens (or drop them, `partial="discard"`) and go again at once
        with the remaining budget. The engines are paused then: they hold the request and start it
        with the new weights the moment they resume (the `EnginePool.pause` contract), so the
        recomputation is queued before the update lands instead of a round trip after it."""
        cfg = self.cfg
        pending = []
        for s in samples:  # a restored group may hold finished samples; they are not generated again
            if s.status in ("completed", "truncated"):
                continue
            if s.num_tokens >= cfg.max_new_tokens:  # restored under a smaller budget
                s.status, s.finish_reason = "truncated", "length"
                continue
            pending.append(s)
        while pending:
            rids = [f"{s.group_id}-{s.index}-{s.num_resumes}" for s in pending]
            params = [self.sampling_params(cfg.max_new_tokens - s.num_tokens, rid=r) for s, r in zip(pending, rids, strict=True)]
            results = await self.pool.generate_many([s.prompt_ids + s.response_ids for s in pending], params, rids)
            interrupted = []
            for s, res in zip(pending, results, strict=True):
                # A sample the engine kept across updates (retract / in_place) comes back with one
                # version span per update it lived through; an aborted round always has one.
                self.counters.partial_resumed += self.append_result(s, res) - 1
                finish = res["meta_info"]["finish_reason"]
                if finish["type"] != "abort":
                    s.finish_reason = finish["type"]
                    s.status = "completed" if finish["type"] == "stop" else "truncated"
                    continue
                # Interrupted (weight update or a lost replica): keep or drop what we have, then resume.
                s.status = "partial"
                s.num_resumes += 1
                self.counters.partial_resumed += 1
                if cfg.partial == "discard" and s.num_tokens:
                    self.counters.tokens_discarded += s.num_tokens
                    s.response_ids, s.logprobs, s.versions, s.loss_mask = [], [], [], []
                if s.num_tokens >= cfg.max_new_tokens:  # the update came just as the budget ran out
                    s.status, s.finish_reason = "truncated", "length"
                    continue
                interrupted.append(s)
            pending = interrupted

    def append_result(self, s: Sample, res: dict[str, Any]) -> int:
        """Add a round's tokens to `s`, each with the version that produced it; returns the versions seen."""
        meta = res["meta_info"]
        ids = res["output_ids"]
        lps = [lp for lp, _, _ in meta["output_token_logprobs"]]
        spans = meta.get("weight_versions") or [{"version": meta["weight_version"], "start": 0, "end": len(ids)}]
        for span in spans:
            a, b = span["start"], span["end"]
            s.append(ids[a:b], lps[a:b], _as_version(span["version"]))
        self.counters.tokens_generated += len(ids)
        return len(spans)

    async def _score(self, samples: list[Sample], record: dict[str, Any]) -> None:
        """Each sample's reward; async rewards (a judge) are awaited together. With a judge, each sample
        records its judgments (`meta["judge"]`) and the time its group waited for them (`judge_s`)."""
        for s in samples:  # multi-turn samples keep their special tokens: tool tags read as written
            s.response_text = self.tokenizer.decode(s.response_ids, skip_special_tokens=not s.turns)
        if self.task.judge is not None:
            t0 = time.monotonic()

            async def judged(s: Sample) -> float:
                s.meta["judge"] = []  # afresh: a group resumed from a checkpoint may have been half judged
                with recording(s.meta["judge"]):  # this task's judgments go on `s`
                    r = self.task.score(s.response_text, record)
                    return await r if inspect.isawaitable(r) else r

            for s, r in zip(samples, await asyncio.gather(*[judged(s) for s in samples]), strict=True):
                s.reward, s.timings["judge_s"] = float(r), time.monotonic() - t0
            return
        pending = []
        for s in samples:
            r = self.task.score(s.response_text, record)
            if inspect.isawaitable(r):
                pending.append((s, r))
            else:
                s.reward = float(r)
        if pending:
            for (s, _), r in zip(pending, await asyncio.gather(*[r for _, r in pending]), strict=True):
                s.reward = float(r)

    # ---- evaluation ------------------------------------------------------------------------------
    async def evaluate(self, *, temperature: float, seed: int = 12345, records: list[dict[str, Any]] | None = None,
                       ) -> float:
        """Mean reward (`data.eval_reward`'s) of one response per held-out record (default: the task's),
        through the engines (not the trainer): what a user of the weights would see. NaN without records."""
        return (await evaluate_agreement(self, temperature=temperature, seed=seed, records=records, compare=False))[0]

    async def evaluate_agreement(self, *, temperature: float, seed: int = 12345,
                                 records: list[dict[str, Any]] | None = None) -> tuple[float, float | None]:
        """`evaluate`'s mean, and where the evaluation's reward is not the training reward (a judge
        checked against exact match) how often the two agree (evaluation.py)."""
        return await evaluate_agreement(self, temperature=temperature, seed=seed, records=records)

    async def evaluate_held_out(self) -> dict[str, float]:
        """Held-out accuracy, greedy and at the rollout temperature (and the rewards' agreement, where
        the evaluation has its own reward)."""
        out: dict[str, float] = {}
        for name, temperature in (("greedy", 0.0), ("sampled", self.cfg.temperature)):
            score, agreement = await self.evaluate_agreement(temperature=temperature)
            out[name] = score
            if agreement is not None:
                out[f"agreement_{name}"] = agreement
        return out


_groups_encoder = msgspec.msgpack.Encoder()
_groups_decoder = msgspec.msgpack.Decoder(list[Group])


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]]) -> list[int]:
    """A prompt's token ids as the engines get them: a text as `<bos>` (if the tokenizer has one) and
    the text; a chat (a list of `{"role", "content"}` messages, as verl and slime data files hold
    them) rendered by the tokenizer's chat template, ready for the assistant's turn."""
    if isinstance(prompt, list):
        out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return [bos, *ids] if bos is not None else ids


def _as_version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0  # SGLang's "default" version: the initial weights
