"""A sample's requests, in one place: request rounds, partial resume across weight updates, replay of a
sample continued from a checkpoint, and the gate that keeps tool calls whole in a checkpoint.

    runner = Runner(pool, cfg.rollout, counters, seeds)        the manager's, one per run
    episode = Episode(Context(runner, tokenizer, tools), sample, record)
    await workflow(record, episode)        a turn: runner.extend(Span(sample, ...))
    await single_turn(record, episodes)    a group's samples at once: runner.extend(*spans)

`Runner.extend` is the only code that sends a sample to the engines. A weight update (or a lost
server) ends a request early, with the tokens generated so far; `extend` keeps them (or drops them,
`rollout.partial: discard`) and asks again at once with the remaining budget: the paused engines hold
the request and start it with the new weights when they resume (the `EnginePool.pause` contract), so
no generated token is lost and each carries the version that produced it. The spans of one call go
to the engines together each round (one `generate_many`: one HTTP request where the server takes
batches), as a group's single-turn samples do.

An `Episode` is one sample's handle for a workflow (rollout/workflows.py): model turns, tool turns,
environment text. Its turns are the sample's journal: a sample continued from a checkpoint replays
them in order, without generating or calling a tool again, and its first unfinished model turn goes on
from its tokens. A single-turn sample (`respond`) has no journal: its tokens are its journal.

Nothing here knows torch or the trainer: token ids, logprobs, versions and text.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..buffer.waiters import Waiters
from ..config import RolloutConfig
from ..types import Sample, Turn
from .tools import ToolError, ToolResult

if TYPE_CHECKING:
    from .capture import CaptureServer
    from .manager import RolloutCounters
    from .pools import EnginePool
    from .tools import ToolBox


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


@dataclass
class Span:
    """Tokens to generate into a sample: from its prompt and every token so far, until the engine
    ends the span that began at token `start` (`stop`, `length`) or it holds `limit` tokens.
    `sampling`: parameters over the rollout's; `turn`: the journal entry the span fills, kept as far
    as it got after every round (a checkpoint goes on from there)."""

    sample: Sample
    start: int
    limit: int
    seed: int
    rid: str
    stop: list[str] | None = None
    sampling: dict[str, Any] | None = None
    turn: Turn | None = None


class Runner:
    """Every request of every sample goes through `extend`. `seeds(key)`: an episode's sampling seed
    (the scheduling strategy's: a counter, or a function of the key in a reproducible run)."""

    def __init__(self, pool: EnginePool, cfg: RolloutConfig, counters: RolloutCounters,
                 seeds: Callable[[str], int]) -> None:
        self.pool, self.cfg, self.counters, self.seeds = pool, cfg, counters, seeds
        self.gate = ToolGate()  # a checkpoint shuts it: no tool call half in a snapshot

    def params(self, budget: int, *, seed: int, stop: list[str] | None = None) -> dict[str, Any]:
        """A request's sampling parameters, as the rollout samples: the one place they are assembled
        (training, held-out evaluation and every workflow turn alike)."""
        cfg = self.cfg
        params: dict[str, Any] = {"max_new_tokens": budget, "temperature": cfg.temperature, "top_p": cfg.top_p,
                                  "top_k": cfg.top_k, "sampling_seed": seed}
        if stop:
            params["stop"] = stop
        return params

    async def extend(self, *spans: Span) -> list[str]:
        """Generate every span to its end, resuming across interruptions; the spans still going are
        sent together each round (one `generate_many`: one HTTP request where the server takes
        batches). Returns each span's finish reason."""
        finish: dict[int, str] = {}
        pending = list(range(len(spans)))
        while pending:
            going = []
            for i in pending:
                sp = spans[i]
                if sp.start + sp.limit - sp.sample.num_tokens <= 0:
                    finish[i] = "length"
                else:
                    going.append(i)
            if not going:
                break
            results = await self.pool.generate_many(*map(list, zip(*(self._request(spans[i]) for i in going),
                                                                      strict=True)))
            pending = []
            for i, res in zip(going, results, strict=True):
                kind = self._took(spans[i], res)
                if kind == "abort":
                    pending.append(i)
                else:
                    finish[i] = kind
        return [finish[i] for i in range(len(spans))]

    def _request(self, sp: Span) -> tuple[list[int], dict[str, Any], str]:
        s = sp.sample
        # A request's seed follows from the span's and its place in the sample, not from when it is
        # asked for: samples whose rounds interleave differently still draw the same tokens.
        params = self.params(sp.start + sp.limit - s.num_tokens, seed=(sp.seed * 1_000_003 + s.num_resumes) % (1 << 63),
                             stop=sp.stop)
        return s.prompt_ids + s.response_ids, params | (sp.sampling or {}), f"{sp.rid}-{s.num_resumes}"

    def _took(self, sp: Span, res: dict[str, Any]) -> str:
        """A round's result into the span's sample; returns its finish reason (`abort`: it goes again)."""
        s = sp.sample
        # A sample the engine kept across updates (retract / in_place) comes back with one version
        # span per update it lived through; an aborted round always has one.
        self.counters.partial_resumed += self.append_result(s, res) - 1
        kind = res["meta_info"]["finish_reason"]["type"]
        if kind == "abort":  # interrupted (a weight update, a lost server): keep or drop, then go on
            s.status = "partial"
            s.num_resumes += 1
            self.counters.partial_resumed += 1
            if self.cfg.partial == "discard" and s.num_tokens > sp.start:
                self.counters.tokens_discarded += s.num_tokens - sp.start
                for field in (s.response_ids, s.logprobs, s.versions, s.loss_mask):
                    del field[sp.start:]
        if sp.turn is not None:
            sp.turn.end = s.num_tokens
        return kind

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


class CaptureHost:
    """The capture endpoint (rollout/capture/) of a run's episodes, started when the first one asks
    (aiohttp is loaded then)."""

    def __init__(self) -> None:
        self._server: CaptureServer | None = None
        self._lock = asyncio.Lock()

    async def open(self, episode: Episode) -> str:
        async with self._lock:  # a group's episodes ask at once: one server for all
            if self._server is None:
                from .capture import CaptureServer

                server = CaptureServer()
                await server.start()
                self._server = server
        return self._server.open(episode)

    def close(self, url: str) -> None:
        if self._server is not None:
            self._server.close_session(url)

    async def aclose(self) -> None:
        if self._server is not None:
            await self._server.aclose()


@dataclass
class Context:
    """What an episode may use: the runner (its requests), the tokenizer, the tools and the OpenAI
    capture endpoint (started on first use)."""

    runner: Runner
    tokenizer: Any
    tools: ToolBox | None = None
    capture: CaptureHost | None = None


class Episode:
    def __init__(self, ctx: Context, sample: Sample, record: dict[str, Any],
                 sampling: dict[str, Any] | None = None) -> None:
        """`sampling`: parameters over the rollout's for every turn (held-out evaluation: greedy, seeded)."""
        self.ctx = ctx
        self.sample = sample
        self.record = record
        self.cfg = ctx.runner.cfg
        self._sampling = dict(sampling or {})
        seed = self._sampling.pop("sampling_seed", None)
        self._seed = ctx.runner.seeds(f"{sample.group_id}-{sample.index}") if seed is None else seed
        self._cursor = 0  # recorded turns replayed so far
        self.finish: str | None = None  # how the last model turn ended
        self.openai_urls: list[str] = []  # sessions of the OpenAI-compatible endpoint it opened

    # ---- what a workflow reads --------------------------------------------------------------------
    @property
    def prompt(self) -> str:
        return self.sample.prompt_text

    @property
    def tokenizer(self) -> Any:
        return self.ctx.tokenizer

    @property
    def tools(self) -> ToolBox | None:
        return self.ctx.tools

    @property
    def remaining(self) -> int:
        """Response tokens left in the sample's budget (`rollout.max_new_tokens`, every turn together)."""
        return self.cfg.max_new_tokens - self.sample.num_tokens

    def text(self, turn: Turn | None = None) -> str:
        """A turn's text (the whole response without one), special tokens kept: tool tags read as written."""
        ids = self.sample.response_ids if turn is None else self.sample.response_ids[turn.start:turn.end]
        return self.ctx.tokenizer.decode(ids, skip_special_tokens=False)

    def encode(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        return encode_prompt(self.ctx.tokenizer, prompt)

    # ---- turns -------------------------------------------------------------------------------------
    async def respond(self) -> str:
        """The sample's whole response as one completion (single-turn): no journal, a sample continued
        from a checkpoint goes on from its tokens. Returns the finish reason."""
        [self.finish] = await self.ctx.runner.extend(self._response())
        return self.finish

    @staticmethod
    async def respond_all(episodes: list[Episode]) -> None:
        """`respond` for every episode at once: a group's samples go to the engines together."""
        if episodes:
            finishes = await episodes[0].ctx.runner.extend(*(ep._response() for ep in episodes))
            for ep, finish in zip(episodes, finishes, strict=True):
                ep.finish = finish

    def _response(self) -> Span:
        s = self.sample
        return Span(s, start=0, limit=self.cfg.max_new_tokens, seed=self._seed, rid=f"{s.group_id}-{s.index}",
                    sampling=self._sampling)

    async def generate(self, *, max_new_tokens: int | None = None, stop: list[str] | None = None,
                       **sampling: Any) -> Turn:
        """One model turn from everything so far, up to `max_new_tokens` (default: the sample's
        remaining budget) or a `stop` string; `sampling`: other SGLang sampling parameters for this
        turn (`ignore_eos`, `stop_token_ids`, ...) over the rollout's."""
        s = self.sample
        turn = self._replayed("model")
        if turn is not None and turn.finish is not None:
            self.finish = turn.finish
            return turn
        if turn is None:
            turn = Turn(kind="model", start=s.num_tokens, end=s.num_tokens)
            s.turns.append(turn)
            self._cursor += 1
        limit = self.remaining + (s.num_tokens - turn.start)  # a turn continued from a checkpoint has tokens
        if max_new_tokens:
            limit = min(limit, max_new_tokens)
        n = len(s.turns)
        [turn.finish] = await self.ctx.runner.extend(Span(
            s, start=turn.start, limit=limit, seed=self._seed * 1_000_003 + n * 1009, rid=f"{s.group_id}-{s.index}-t{n}",
            stop=stop, sampling=self._sampling | sampling, turn=turn))
        self.finish = turn.finish
        return turn

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

    async def call_tool(self, name: str, args: str) -> str:
        """Run a tool (or replay its recorded result) and append `result_open + observation +
        result_close` as masked tokens. Returns the observation."""
        tools = self.ctx.tools
        if tools is None:
            raise RuntimeError("this run has no tools (rollout.workflow: multi_turn_tools, tools.functions)")
        recorded = self._replayed("tool")
        if recorded is not None:
            return self.text(recorded).removeprefix(tools.cfg.result_open).removesuffix(tools.cfg.result_close)
        async with self.ctx.runner.gate.call():
            result = await tools.call(name, args)
            # From here to the end, no await: the observation and its turn are recorded together.
            self._append_masked(tools.cfg.result_open + result.observation + tools.cfg.result_close, Turn(
                kind="tool", start=0, end=0, tool=name, call=args, error=result.error, seconds=result.seconds))
        c = self.ctx.runner.counters
        c.tool_calls += 1
        c.tool_errors += result.error is not None
        if result.error is not None:
            cause = result.cause or "exception"
            c.tool_error_causes[cause] = c.tool_error_causes.get(cause, 0) + 1
        c.tool_s += result.seconds
        return result.observation

    async def run_tool(self, name: str, args: str, fn: Callable[[str], Any]) -> str:
        """Run a tool the agent calls itself (an SDK's function tool) once: `fn(args)`'s result is
        journaled, so an episode resumed from a checkpoint gets it back instead of running it again.
        Nothing is appended to the tokens (the agent sends the result back in its next call).
        Exceptions propagate, as they would without the journal. `fn` may be `ToolBox.call` (its name
        given): its ToolResult comes back as the observation, an error one too (counted by cause)."""
        recorded = self._replayed("tool")
        if recorded is not None:
            if recorded.tool != name or recorded.call != args:
                raise ReplayError(f"the agent called {name}({args!r}) where its journal has "
                                  f"{recorded.tool}({recorded.call!r}) (turn {self._cursor - 1})")
            if recorded.error is not None:
                raise RuntimeError(recorded.error)
            return recorded.result or ""
        result, error, cause = None, None, None
        async with self.ctx.runner.gate.call():
            t0 = time.perf_counter()
            try:
                out = fn(args)
                out = await out if inspect.isawaitable(out) else out
                if isinstance(out, ToolResult):
                    cause = (out.cause or "exception") if out.error is not None else None
                    out = out.observation
                result = str(out)
            except Exception as e:  # journaled too: a resumed episode sees the same failure
                error = f"{type(e).__name__}: {e}"
                cause = e.cause if isinstance(e, ToolError) else "exception"
                raise
            finally:
                seconds = time.perf_counter() - t0
                s = self.sample  # no await from here: the result and its turn are recorded together
                s.turns.append(Turn(kind="tool", start=s.num_tokens, end=s.num_tokens, tool=name, call=args,
                                    result=result, error=error, seconds=seconds))
                self._cursor += 1
                c = self.ctx.runner.counters
                c.tool_calls += 1
                c.tool_errors += cause is not None
                if cause is not None:
                    c.tool_error_causes[cause] = c.tool_error_causes.get(cause, 0) + 1
                c.tool_s += seconds
        return result

    def observe(self, text: str) -> None:
        """Environment text the model reads and is not trained on."""
        self.observe_ids(self.ctx.tokenizer(text, add_special_tokens=False)["input_ids"])

    def observe_ids(self, ids: list[int]) -> None:
        """Environment tokens, as ids (a chat template's rendering of new messages)."""
        if self._replayed("tool") is None:
            self._append_masked(ids, Turn(kind="tool", start=0, end=0))

    async def openai_url(self) -> str:
        """The base URL of an OpenAI-compatible endpoint (Chat Completions, Responses) whose calls are
        this episode's turns (rollout/capture/): for agents written against the `openai` or
        `openai-agents` SDK."""
        return await self._capture_root() + "/v1"

    async def anthropic_url(self) -> str:
        """The base URL of an Anthropic-compatible endpoint (Messages) whose calls are this episode's
        turns: for agents written against the `anthropic` SDK (it adds `/v1/messages`)."""
        return await self._capture_root()

    async def _capture_root(self) -> str:
        if self.ctx.capture is None:
            raise RuntimeError("this run has no capture endpoint (a workflow other than single_turn opens one)")
        url = await self.ctx.capture.open(self)
        self.openai_urls.append(url)
        return url

    @property
    def answered(self) -> int:
        """Response tokens up to the end of the last journal entry made or replayed so far: what the
        agent has seen (an agent that starts again on a resumed sample sees its turns replayed)."""
        return self.sample.turns[self._cursor - 1].end if self._cursor else 0

    def adopt_prompt(self, ids: list[int]) -> None:
        """The agent's first call brought its own prompt (instructions, tools): it becomes the sample's."""
        assert not self.sample.response_ids and not self.sample.turns
        self.sample.prompt_ids = list(ids)
        self.sample.prompt_text = self.ctx.tokenizer.decode(ids, skip_special_tokens=False)

    def close(self) -> None:
        """The episode's OpenAI-endpoint sessions end with it."""
        for url in self.openai_urls:
            if self.ctx.capture is not None:
                self.ctx.capture.close(url)
        self.openai_urls.clear()

    def _append_masked(self, text_or_ids: str | list[int], turn: Turn) -> None:
        s = self.sample
        ids = (self.ctx.tokenizer(text_or_ids, add_special_tokens=False)["input_ids"]
               if isinstance(text_or_ids, str) else list(text_or_ids))
        turn.start = s.num_tokens
        s.append(ids, [0.0] * len(ids), s.versions[-1] if s.versions else 0, trainable=False)
        turn.end = s.num_tokens
        s.turns.append(turn)
        self._cursor += 1


def _as_version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0  # SGLang's "default" version: the initial weights
