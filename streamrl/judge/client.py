"""The judge client: a reward model asked through its own engine pool.

    reward(response, record) -> judge.judge(response, record): the prompt template filled in ->
    the judge's tokenizer -> judge pool.generate -> the judge's text -> the parse rule -> a score

The pool is the judge's alone: the run pushes weights to, pauses and aborts the policy's pool only,
so a judge request in flight runs to its end whatever training does. A try that times out, comes back
aborted (a lost server), or whose text does not parse is tried again (`judge.retries`); then the
judgment fails with a `JudgeError` whose message is one line, and the group it scores is a failed
group like any whose reward raised. A reward gets the judge as `judge.recording(log)`: the same
client, recording each judgment it asks for into the sample's `meta["judge"]` (score, text, seconds).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..config import JudgeConfig
from ..errors import JudgeError, RolloutFailed
from .parse import load_parser


@dataclass
class Verdict:
    score: float
    text: str
    logprobs: list[float]
    seconds: float  # from the first try to this answer
    tries: int


@dataclass
class JudgeCounters:
    calls: int = 0  # judgments asked for
    failures: int = 0  # judgments that failed every try
    retries: int = 0  # tries after a first one failed
    tokens: int = 0  # tokens the judge wrote
    prompt_tokens: int = 0
    seconds: float = 0.0  # summed time of the judgments that finished (the judge's latency)
    aborted: int = 0  # tries whose request came back aborted


def prompt_text(prompt: Any) -> str:
    """A record's prompt as text: a chat's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return str(users[-1] if users else prompt[-1]["content"])


class Judge:
    """`await judge.judge(response, record)` -> Verdict, on `pool` (an EnginePool the judge is given and
    owns from then on: use the Judge as an async context manager, which starts and stops it)."""

    def __init__(self, cfg: JudgeConfig, pool: Any, tokenizer: Any, *, seed: int = 0,
                 warm_start: dict[str, Any] | None = None) -> None:
        """`warm_start`: the metrics of the judge's warm start, where streamrl trained it (its summary)."""
        self.cfg = cfg
        self.pool = pool
        self.tokenizer = tokenizer
        self.parse = load_parser(cfg.parse)
        self.counters = JudgeCounters()
        self.warm_start = dict(warm_start or {})
        self._next = seed * 1_000_003
        self._versions: set[str] = set()  # the judge's weight versions its answers carry: never a push's
        self._t0 = time.perf_counter()

    def recording(self, log: list[dict[str, Any]]) -> RecordingJudge:
        """This judge, recording every judgment asked through it into `log` (a sample's `meta["judge"]`):
        what a reward that takes `judge` is given."""
        return RecordingJudge(self, log)

    async def __aenter__(self) -> Judge:
        await self.pool.__aenter__()
        self._t0 = time.perf_counter()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pool.__aexit__(*exc)

    def prompt(self, response: str, record: Mapping[str, Any]) -> str:
        """The judge's prompt for `response` to `record`: `judge.prompt_template` filled in."""
        return self.cfg.prompt_template.format_map({
            "prompt": prompt_text(record.get("prompt", "")), "response": response, "answer": record.get("answer", ""),
            "metadata": record.get("metadata") or {}, "data_source": record.get("data_source", "")})

    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        if self.cfg.chat:
            out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return [tok.bos_token_id, *ids] if tok.bos_token_id is not None else ids

    async def judge(self, response: str, record: Mapping[str, Any], log: list[dict[str, Any]] | None = None) -> Verdict:
        """The judge's verdict on `response` to the prompt `record` (recorded into `log`)."""
        return await self.ask(self.prompt(response, record), log)

    async def score(self, response: str, record: Mapping[str, Any], log: list[dict[str, Any]] | None = None) -> float:
        return (await self.judge(response, record, log)).score

    async def ask(self, text: str, log: list[dict[str, Any]] | None = None) -> Verdict:
        """The judge's verdict on a prompt of your own (`text`, rendered as `judge.chat` says), recorded
        into `log` (each try's score, text and seconds, or its error)."""
        cfg, c = self.cfg, self.counters
        c.calls += 1
        self._next += 1
        ids, rid = self.encode(text), f"judge-{self._next}"
        params: dict[str, Any] = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
                                  "top_p": cfg.top_p, "top_k": cfg.top_k}
        if cfg.stop:
            params["stop"] = list(cfg.stop)
        t0, error = time.perf_counter(), ""
        for attempt in range(cfg.retries + 1):
            params["sampling_seed"] = self._next * 8 + attempt
            try:
                async with asyncio.timeout(cfg.timeout_s):
                    verdict = await self._try(ids, params, f"{rid}-{attempt}")
            except TimeoutError:
                error = f"no answer within judge.timeout_s = {cfg.timeout_s:g} s"
            except Exception as e:  # noqa: BLE001 - a judge server's or a user's parse function's failure
                if isinstance(e, RolloutFailed):  # the judge's pool has no server left (EnginesLost): the run stops
                    raise type(e)(f"judge: {e}") from None
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            else:
                verdict.seconds, verdict.tries = time.perf_counter() - t0, attempt + 1
                c.seconds += verdict.seconds
                if log is not None:
                    log.append({"score": verdict.score, "text": verdict.text, "s": round(verdict.seconds, 4)})
                return verdict
            if attempt < cfg.retries:
                c.retries += 1
                await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
        c.failures += 1
        if log is not None:
            log.append({"error": error})
        tries = cfg.retries + 1
        raise JudgeError(f"judge: {error} ({tries} {'try' if tries == 1 else 'tries'})")

    async def _try(self, ids: list[int], params: dict[str, Any], rid: str) -> Verdict:
        res = await self.pool.generate(ids, dict(params), rid)
        meta = res["meta_info"]
        if meta["finish_reason"]["type"] == "abort":
            self.counters.aborted += 1
            raise JudgeError(f"the judge's request was aborted ({meta['finish_reason'].get('message', '')})")
        self._versions.add(str(meta.get("weight_version", "")))
        out = res["output_ids"]
        self.counters.tokens += len(out)
        self.counters.prompt_tokens += len(ids)
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        lps = [lp for lp, _, _ in meta.get("output_token_logprobs") or []]
        score = self.parse(text, lps)
        if inspect.isawaitable(score):
            score = await score
        return Verdict(score=float(score), text=text, logprobs=lps, seconds=0.0, tries=0)

    def summary(self) -> dict[str, Any]:
        """The judge's side of a run: its counters, its throughput over the time it was up, and what its
        engines hold on their devices (`memory_bytes`, weights and KV cache: its share; local pools)."""
        c, wall = self.counters, time.perf_counter() - self._t0
        done = c.calls - c.failures
        replicas = [r for r in self.pool.stats().get("replicas", []) if isinstance(r, dict)]
        held = getattr(self.pool, "memory_bytes", None)  # a local pool's engines; a server's are its own
        return {**asdict(c), "wall_s": wall, "calls_per_s": done / wall if wall > 0 else 0.0,
                "tokens_per_s": c.tokens / wall if wall > 0 else 0.0,
                "latency_mean_s": c.seconds / done if done else 0.0, "weight_versions": sorted(self._versions),
                "kv_cache_bytes": sum(int(r.get("kv_cache_bytes") or 0) for r in replicas),
                "devices": sorted({str(r["device"]) for r in replicas if r.get("device")}),
                "memory_bytes": held() if held else None,
                "warm_start": self.warm_start}


class RecordingJudge:
    """A judge whose judgments go into one sample's log (`Judge.recording`): what a reward that takes
    `judge` gets, with the judge's own calls (`judge`, `score`, `ask`, `prompt`)."""

    def __init__(self, judge: Judge, log: list[dict[str, Any]]) -> None:
        self.client, self.log = judge, log
        self.cfg, self.prompt = judge.cfg, judge.prompt

    async def judge(self, response: str, record: Mapping[str, Any]) -> Verdict:
        return await self.client.judge(response, record, self.log)

    async def score(self, response: str, record: Mapping[str, Any]) -> float:
        return await self.client.score(response, record, self.log)

    async def ask(self, text: str) -> Verdict:
        return await self.client.ask(text, self.log)
