"""Continuous-batching decisions for TorchEngine: which requests run, which wait, which row each holds.

Pure Python: no torch, no asyncio. Every engine step is either a *prefill* of newly admitted requests
(or of running requests whose KV must be recomputed after a weight update) or a *decode* of every
running request. Requests join and leave the running batch at every step; nobody waits for the longest
one. Rows 0..B-1 are kept dense: when a request leaves, the last row moves into its place, and the
scheduler reports the move so the runner can copy the KV.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    params: Any  # SamplingParams; kept opaque here so the scheduler stays free of engine types
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version_spans: list[dict[str, Any]] = field(default_factory=list)  # SGLang's weight_versions
    row: int | None = None
    needs_prefill: bool = True  # no valid KV yet (new, or flushed by a weight update)
    finished: bool = False
    created: float = field(default_factory=time.monotonic)
    sink: Any = None  # engine-owned delivery object (future / queue)
    generator: Any = None  # per-request torch.Generator when sampling_seed is set
    seed: int = 0  # the paged runner's counter-based noise: sampling_seed, or one drawn for the request
    on_finish: Any = None  # called when it ends, before its sink hears (controller.deterministic)

    @property
    def reserved_tokens(self) -> int:
        return len(self.input_ids) + self.params.max_new_tokens

    @property
    def seq(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def ctx_len(self) -> int:
        """Tokens whose KV is cached: everything but the last sampled token, which is fed next."""
        return len(self.input_ids) + len(self.output_ids) - 1


@dataclass
class Plan:
    kind: str  # "prefill" | "decode"
    requests: list[Request]


class Scheduler:
    def __init__(self, max_running: int, max_total_tokens: int, max_prefill_tokens: int, page_size: int = 1) -> None:
        """`page_size`: the KV cache's unit of allocation; a request reserves whole pages."""
        self.max_running = max_running
        self.max_total_tokens = max_total_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.page_size = page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # index == KV row
        self.paused = False
        self.order_key: Any = None  # admit waiting requests in this order instead of arrival order

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return not self.paused and bool(self.waiting or self.running)

    def schedule(self) -> Plan | None:
        if self.paused:
            return None
        # Requests whose KV was flushed (weight update) are recomputed before anybody decodes.
        stale = [r for r in self.running if r.needs_prefill]
        if stale:
            return Plan("prefill", self._fit_prefill(stale))
        admitted = self._admit()
        if admitted:
            return Plan("prefill", admitted)
        if self.running:
            return Plan("decode", list(self.running))
        return None

    def _fit_prefill(self, reqs: list[Request]) -> list[Request]:
        out, budget = [], self.max_prefill_tokens
        for r in reqs:
            n = len(r.seq)
            if out and n * (len(out) + 1) > budget:
                break
            out.append(r)
        return out

    def reservation(self, tokens: int) -> int:
        """KV slots a request of `tokens` (prompt + max_new_tokens) holds: whole pages."""
        return -(-tokens // self.page_size) * self.page_size

    def _admit(self) -> list[Request]:
        if self.order_key is not None and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=self.order_key))
        reserved = sum(self.reservation(r.reserved_tokens) for r in self.running)
        admitted: list[Request] = []
        longest = 0
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting[0]
            need = self.reservation(r.reserved_tokens)
            if reserved + need > self.max_total_tokens and self.running:
                break
            longest = max(longest, len(r.seq))
            # Prefill pads to the longest prompt: budget the padded size, always admitting one.
            if admitted and longest * (len(admitted) + 1) > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            r.row = len(self.running)
            self.running.append(r)
            reserved += need
            admitted.append(r)
        return admitted

    def remove(self, req: Request) -> tuple[int, int] | None:
        """Take `req` out of the queue or the batch. Returns (src_row, dst_row) if a row moved."""
        if req.row is None:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
            return None
        row, last = req.row, len(self.running) - 1
        req.row = None
        moved = self.running.pop()
        if row == last:
            return None
        self.running[row] = moved
        moved.row = row
        return (last, row)

    def all_requests(self) -> list[Request]:
        return list(self.running) + list(self.waiting)

    def flush(self) -> None:
        """KV is invalid (new weights): every running request is prefilled again before decoding."""
        for r in self.running:
            r.needs_prefill = True
