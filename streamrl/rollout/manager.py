"""RolloutManager: prompts in, scored groups out, into the buffer, while the trainer works.

One group = `group_size` samples of one prompt, generated concurrently through the pool. Admission is
the controller's (staleness); routing is the pool's. When a weight update interrupts generation
(pool paused with mode abort), every in-flight sample comes back with its partial tokens and
logprobs; the manager parks it in the buffer's partial area (so a checkpoint includes it) and
resubmits prompt + partial response with the remaining token budget at once: the paused engines hold
it and start it with the new weights when they resume. The new tokens carry the new weight version.
With `partial="discard"` the partial tokens are thrown away and the sample restarts (for comparison).
With `partial="retract"` / `"in_place"` the pool is paused so that in-flight requests stay in the
engines (their KV recomputed / kept): the manager sees each sample once, with per-token versions.

The manager knows nothing about torch or the trainer: it sees token ids, logprobs, versions and rewards.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from ..buffer import RolloutBuffer
from ..buffer.controller import StalenessController
from ..types import Group, Sample
from .pools import EnginePool


@dataclass(kw_only=True)
class RolloutSettings:
    group_size: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    partial: str = "resume"  # resume | discard | retract | in_place


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


class RolloutFailed(RuntimeError):
    """Groups keep failing (an engine rejecting every request, a reward function that raises): the
    manager stopped instead of retrying them forever."""


T = TypeVar("T")


RewardFn = Callable[[str, str], Any]


class RolloutManager:
    def __init__(
        self,
        *,
        pool: EnginePool,
        tokenizer: Any,
        prompts: list[dict[str, Any]],
        reward_fn: RewardFn,
        buffer: RolloutBuffer,
        controller: StalenessController,
        settings: RolloutSettings,
        seed: int = 0,
        max_failed_in_a_row: int | None = None,
    ) -> None:
        """`max_failed_in_a_row`: after that many failed groups with none finishing in between, stop
        and set `failure` (see `or_failure`); None retries failed groups forever."""
        if not prompts:
            raise ValueError("RolloutManager needs at least one prompt")
        self.pool = pool
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.reward_fn = reward_fn
        self.buffer = buffer
        self.controller = controller
        self.settings = settings
        self.counters = RolloutCounters()
        self._rng = random.Random(seed)
        self._order = self._prompt_stream()
        self.prompts_drawn = 0  # records taken from the stream: a resumed run skips as many
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._next_seed = seed * 1_000_003  # sampling seeds, one per request round
        self._generating: dict[str, Group] = {}  # groups admitted and not finished, samples as they stand
        self._restored: list[Group] = []
        self.max_failed_in_a_row = max_failed_in_a_row
        self.failure: RolloutFailed | None = None
        self._failed = asyncio.Event()

    def _prompt_stream(self) -> Iterator[dict[str, Any]]:
        """Endless shuffled epochs over the prompts."""
        while True:
            order = list(range(len(self.prompts)))
            self._rng.shuffle(order)
            for i in order:
                yield self.prompts[i]

    # ---- checkpoints -----------------------------------------------------------------------------
    def snapshot(self) -> tuple[bytes, dict[str, int]]:
        """The groups being generated, as msgpack, and the counters a resumed run continues from.

        A sample object is only updated when its request round returns, so each stands as of its
        last round: finished, partial (tokens up to the last interruption, as parked in the buffer)
        or not started. Resuming from this loses at most what the engines decoded since the last
        weight update, which is where the run loop takes checkpoints."""
        groups = list(self._generating.values())
        return _groups_encoder.encode(groups), {"prompts_drawn": self.prompts_drawn, "next_seed": self._next_seed,
                                                "generating_groups": len(groups)}

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

    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- the producer loop -----------------------------------------------------------------------
    async def run(self) -> None:
        """Admit and launch groups until `stop()`; each finished group goes into the buffer."""
        try:
            for g in self._restored:
                self._launch(g.meta, g.admitted_version, g)
            self._restored = []
            while not self._stopping:
                version = await self.controller.acquire()
                if self._stopping:
                    await self.controller.release(version, returned=True)
                    break
                record = next(self._order)
                self.prompts_drawn += 1
                self._launch(record, version)
        except asyncio.CancelledError:
            pass

    def _launch(self, record: dict[str, Any], version: int, group: Group | None = None) -> None:
        task = asyncio.create_task(self._run_group(record, version, group))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        self._stopping = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _fail(self, error: RolloutFailed) -> None:
        if self.failure is None:
            self.failure = error
            self._stopping = True
            self._failed.set()

    async def or_failure(self, aw: Awaitable[T]) -> T:
        """Await `aw` (e.g. the next batch from the buffer), unless the manager gives up on failing
        groups first: then cancel it and raise `RolloutFailed`, so a consumer never waits forever."""
        task = asyncio.ensure_future(aw)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            failed.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert self.failure is not None
            raise self.failure
        return task.result()

    @property
    def num_running_groups(self) -> int:
        return len(self._tasks)

    async def _run_group(self, record: dict[str, Any], version: int, group: Group | None = None) -> None:
        """Generate, score and queue one group; `group`: one restored from a checkpoint, whose
        unfinished samples continue from their tokens."""
        if group is None:
            gid = uuid.uuid4().hex[:12]
            prompt_ids = self.encode(record["prompt"])
            samples = [
                Sample(group_id=gid, index=i, prompt_ids=prompt_ids, prompt_text=record["prompt"],
                       meta={"answer": record.get("answer", "")})
                for i in range(self.settings.group_size)
            ]
            group = Group(group_id=gid, samples=samples, admitted_version=version, meta=dict(record))
        gid, samples = group.group_id, group.samples
        self._generating[gid] = group
        t0 = time.monotonic()
        try:
            await self._generate(samples)
            await asyncio.gather(*[self._score(s) for s in samples])
        except asyncio.CancelledError:
            await self.controller.release(version, returned=True)
            raise
        except Exception as e:  # noqa: BLE001 - a failed group is counted and its slot given back
            c = self.counters
            c.failed += 1
            c.failed_in_a_row += 1
            c.last_error = f"{type(e).__name__}: {e}"
            if self.max_failed_in_a_row is not None and c.failed_in_a_row >= self.max_failed_in_a_row:
                self._fail(RolloutFailed(f"{c.failed_in_a_row} groups in a row failed ({c.groups_done} finished "
                                         f"before them); the last one: {c.last_error}"))
            await self.controller.release(version, returned=True)
            return
        finally:
            self._generating.pop(gid, None)
        for s in samples:
            s.timings["group_s"] = time.monotonic() - t0
        self.counters.groups_done += 1
        self.counters.failed_in_a_row = 0
        self.counters.samples_done += len(samples)
        await self.buffer.put(group)
        await self.controller.release(version)

    async def _generate(self, samples: list[Sample]) -> None:
        """Generate a group's samples to the end: one `generate_many` call per round (a single HTTP
        request where the server takes batches). A weight update ends a round early; interrupted
        samples keep their partial tokens (or drop them, `partial="discard"`) and go again at once
        with the remaining budget. The engines are paused then: they hold the request and start it
        with the new weights the moment they resume (the `EnginePool.pause` contract), so the
        recomputation is queued before the update lands instead of a round trip after it. Until its
        next round comes back, an interrupted sample also sits in the buffer's partial area, so a
        checkpoint taken meanwhile includes it."""
        st = self.settings
        pending = []
        for s in samples:  # a restored group may hold finished samples; they are not generated again
            if s.status in ("completed", "truncated"):
                continue
            if s.num_tokens >= st.max_new_tokens:  # restored under a smaller budget
                s.status, s.finish_reason = "truncated", "length"
                continue
            if s.status == "partial":  # restored: parked until its next round returns, as before
                self.buffer.park_partial(s)
            pending.append(s)
        while pending:
            params = []
            for s in pending:
                params.append({
                    "max_new_tokens": st.max_new_tokens - s.num_tokens, "temperature": st.temperature,
                    "top_p": st.top_p, "top_k": st.top_k, "sampling_seed": self._next_seed,
                })
                self._next_seed += 1
            rids = [f"{s.group_id}-{s.index}-{s.num_resumes}" for s in pending]
            results = await self.pool.generate_many([s.prompt_ids + s.response_ids for s in pending], params, rids)
            interrupted = []
            for s, res in zip(pending, results, strict=True):
                if s.status == "partial":
                    self.buffer.unpark_partial(s)
                # A sample the engine kept across updates (retract / in_place) comes back with one
                # version span per update it lived through; an aborted round always has one.
                self.counters.partial_resumed += self._append(s, res) - 1
                finish = res["meta_info"]["finish_reason"]
                if finish["type"] != "abort":
                    s.finish_reason = finish["type"]
                    s.status = "completed" if finish["type"] == "stop" else "truncated"
                    continue
                # Interrupted (weight update or a lost replica): keep or drop what we have, then resume.
                s.status = "partial"
                s.num_resumes += 1
                self.counters.partial_resumed += 1
                if st.partial == "discard" and s.num_tokens:
                    self.counters.tokens_discarded += s.num_tokens
                    s.response_ids, s.logprobs, s.versions, s.loss_mask = [], [], [], []
                if s.num_tokens >= st.max_new_tokens:  # the update came just as the budget ran out
                    s.status, s.finish_reason = "truncated", "length"
                    continue
                self.buffer.park_partial(s)
                interrupted.append(s)
            pending = interrupted

    def _append(self, s: Sample, res: dict[str, Any]) -> int:
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

    async def _score(self, s: Sample) -> None:
        s.response_text = self.decode(s.response_ids)
        r = self.reward_fn(s.response_text, s.meta.get("answer", ""))
        if inspect.isawaitable(r):
            r = await r
        s.reward = float(r)


_groups_encoder = msgspec.msgpack.Encoder()
_groups_decoder = msgspec.msgpack.Decoder(list[Group])


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A prompt's token ids as the engines get them: `<bos>` (if the tokenizer has one), then the text."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return [bos, *ids] if bos is not None else ids


def _as_version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0  # SGLang's "default" version: the initial weights
