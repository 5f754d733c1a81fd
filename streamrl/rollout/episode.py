"""Episode: one sample of one record, built turn by turn by a workflow: its token-level handle on the
engines and its tools.

    await episode.generate()                  a model turn: trainable tokens, behaviour logprobs, versions
    await episode.call_tool(name, args)       a tool turn: the observation, masked out of the loss
    episode.observe(text)                     environment text, masked

Every turn is appended to the sample as it comes (so a checkpoint holds it) and recorded in
`sample.turns`. A weight update in the middle of a model turn ends the engine's request early; the
episode resubmits everything so far with the remaining budget (`rollout.partial` decides whether the
turn's tokens are kept) and the workflow sees one turn. A sample continued from a checkpoint replays
its recorded turns: `generate` and `call_tool` return them in order, without generating or calling
again, and the first unfinished model turn goes on from its tokens. So a tool whose result is in a
checkpoint never runs twice; and a checkpoint waits for the tool calls in flight (`ToolGate`), so no
call is half in one.

Nothing here knows torch or the trainer: token ids, logprobs, versions and text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from ..buffer.waiters import Waiters
from ..types import Sample, Turn

if TYPE_CHECKING:
    from .manager import RolloutManager


class ToolGate:
    """Tool calls run side by side; a checkpoint waits until none is in flight and lets none start
    until it has taken its snapshot."""

    def __init__(self) -> None:
        self.running = 0
        self.closed = False
        self._changed = Waiters()

    @asynccontextmanager
    async def call(self) -> AsyncIterator[None]:
        while self.closed:
            await self._changed.wait()
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._changed.wake()

    @asynccontextmanager
    async def shut(self) -> AsyncIterator[None]:
        self.closed = True
        try:
            while self.running:
                await self._changed.wait()
            yield
        finally:
            self.closed = False
            self._changed.wake()


class ReplayError(RuntimeError):
    """A workflow continued from a checkpoint asked for another turn than the one it recorded there."""


class Episode:
    def __init__(self, manager: RolloutManager, sample: Sample, record: dict[str, Any],
                 sampling: dict[str, Any] | None = None) -> None:
        """`sampling`: parameters over the rollout's for every turn (held-out evaluation: greedy, seeded)."""
        self.manager = manager
        self.sample = sample
        self.record = record
        self.cfg = manager.cfg
        self._sampling = dict(sampling or {})
        # Each turn's seed follows from the episode's and the turn's place, not from when the turn
        # was asked for: samples whose turns interleave differently still draw the same tokens.
        self._seed = self._sampling.pop("sampling_seed", None)
        if self._seed is None:
            self._seed = manager.take_seed()
        self._cursor = 0  # recorded turns replayed so far
        self.openai_urls: list[str] = []  # sessions of the OpenAI-compatible endpoint it opened

    # ---- what a workflow reads --------------------------------------------------------------------
    @property
    def prompt(self) -> str:
        return self.sample.prompt_text

    @property
    def remaining(self) -> int:
        """Response tokens left in the sample's budget (`rollout.max_new_tokens`, every turn together)."""
        return self.cfg.max_new_tokens - self.sample.num_tokens

    def text(self, turn: Turn | None = None) -> str:
        """A turn's text (the whole response without one), special tokens kept: tool tags read as written."""
        ids = self.sample.response_ids if turn is None else self.sample.response_ids[turn.start:turn.end]
        return self.manager.tokenizer.decode(ids, skip_special_tokens=False)

    # ---- turns -------------------------------------------------------------------------------------
    def _replayed(self, kind: str) -> Turn | None:
        turns = self.sample.turns
        if self._cursor >= len(turns):
            return None
        turn = turns[self._cursor]
        if turn.kind != kind:
            raise ReplayError(f"the workflow asked for a {kind} turn where its journal has a {turn.kind} turn "
                              f"(turn {self._cursor}): a workflow must take the same turns given the same results")
        self._cursor += 1
        return turn

    async def generate(self, *, max_new_tokens: int | None = None, stop: list[str] | None = None,
                       **sampling: Any) -> Turn:
        """One model turn from everything so far, up to `max_new_tokens` (default: the sample's
        remaining budget) or a `stop` string; `sampling`: other SGLang sampling parameters for this
        turn (`ignore_eos`, `stop_token_ids`, ...) over the rollout's."""
        s = self.sample
        turn = self._replayed("model")
        if turn is not None and turn.finish is not None:
            return turn
        if turn is None:
            turn = Turn(kind="model", start=s.num_tokens, end=s.num_tokens)
            s.turns.append(turn)
            self._cursor += 1
        limit = min(self.remaining, max_new_tokens or self.remaining)
        want = turn.start + limit  # where the turn ends at the latest
        while True:
            budget = want - s.num_tokens
            if budget <= 0:
                turn.finish = "length"
                return turn
            seed = (self._seed * 1_000_003 + len(s.turns) * 1009 + s.num_resumes) % (1 << 63)
            params = self.manager.sampling_params(budget, stop=stop, seed=seed) | self._sampling | sampling
            rid = f"{s.group_id}-{s.index}-t{len(s.turns)}-{s.num_resumes}"
            res = await self.manager.pool.generate(s.prompt_ids + s.response_ids, params, rid)
            self.manager.counters.partial_resumed += self.manager.append_result(s, res) - 1
            turn.end = s.num_tokens
            kind = res["meta_info"]["finish_reason"]["type"]
            if kind != "abort":
                turn.finish = kind
                return turn
            # Interrupted (a weight update, a lost replica): keep the turn's tokens or drop them, go on.
            s.status = "partial"
            s.num_resumes += 1
            self.manager.counters.partial_resumed += 1
            if self.cfg.partial == "discard" and turn.end > turn.start:
                self.manager.counters.tokens_discarded += turn.end - turn.start
                for field in (s.response_ids, s.logprobs, s.versions, s.loss_mask):
                    del field[turn.start:]
                turn.end = turn.start

    async def call_tool(self, name: str, args: str) -> str:
        """Run a tool (or replay its recorded result) and append `result_open + observation +
        result_close` as masked tokens. Returns the observation."""
        tools = self.manager.tools
        if tools is None:
            raise RuntimeError("this run has no tools (rollout.workflow: multi_turn_tools, tools.functions)")
        recorded = self._replayed("tool")
        if recorded is not None:
            return self.text(recorded).removeprefix(tools.cfg.result_open).removesuffix(tools.cfg.result_close)
        async with self.manager.tool_gate.call():
            result = await tools.call(name, args)
            # From here to the end, no await: the observation and its turn are recorded together.
            self._append_masked(tools.cfg.result_open + result.observation + tools.cfg.result_close, Turn(
                kind="tool", start=0, end=0, tool=name, call=args, error=result.error, seconds=result.seconds))
        c = self.manager.counters
        c.tool_calls += 1
        c.tool_errors += result.error is not None
        c.tool_s += result.seconds
        return result.observation

    def observe(self, text: str) -> None:
        """Environment text the model reads and is not trained on."""
        self.observe_ids(self.manager.tokenizer(text, add_special_tokens=False)["input_ids"])

    def observe_ids(self, ids: list[int]) -> None:
        """Environment tokens, as ids (a chat template's rendering of new messages)."""
        if self._replayed("tool") is None:
            self._append_masked(ids, Turn(kind="tool", start=0, end=0))

    async def openai_url(self) -> str:
        """The base URL of an OpenAI-compatible endpoint whose calls are this episode's turns
        (rollout/capture.py): for agents written against the `openai` SDK."""
        url = (await self.manager.capture()).open(self)
        self.openai_urls.append(url)
        return url

    def _append_masked(self, text_or_ids: str | list[int], turn: Turn) -> None:
        s = self.sample
        ids = (self.manager.tokenizer(text_or_ids, add_special_tokens=False)["input_ids"]
               if isinstance(text_or_ids, str) else list(text_or_ids))
        turn.start = s.num_tokens
        s.append(ids, [0.0] * len(ids), s.versions[-1] if s.versions else 0, trainable=False)
        turn.end = s.num_tokens
        s.turns.append(turn)
        self._cursor += 1
