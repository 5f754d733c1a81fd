"""One engine step's tensors: a plan (prefill or decode of some requests) through the runner to sampled
tokens and their logprobs. TorchEngine calls `execute` in its worker thread; nothing here changes
engine state.

Per-slot runners (CPU) return logits and `sampling.sample` draws with per-request generators; the
paged runner (GPU) samples itself with counter-based noise — inside the captured decode graph, or
by its kernel after a prefill — and rows with top-k / top-p / min-p go through `sample_counter`,
the same draw in PyTorch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from .sampling import SamplingBatch, sample, sample_counter
from .scheduler import Plan, Request

log = logging.getLogger("streamrl.engine")


def execute(runner: Any, plan: Plan, shared_gen: torch.Generator, stream: Any = None) -> tuple[list[int], list[float]]:
    """(tokens, logprobs) of `plan`'s requests, in order. `stream`: the CUDA stream to compute on."""
    with torch.inference_mode(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        reqs = plan.requests
        batch = SamplingBatch(
            temperatures=[r.params.temperature for r in reqs],
            top_ps=[r.params.top_p for r in reqs],
            top_ks=[r.params.top_k for r in reqs],
            min_ps=[r.params.min_p for r in reqs],
            generators=[r.generator for r in reqs],
        )
        paged = getattr(runner, "paged", False)
        if plan.kind == "prefill":
            logits = runner.prefill([r.row for r in reqs], [r.seq for r in reqs], [r.reserved_tokens for r in reqs])
        elif paged and not batch.needs_filter:  # the whole step, sampling included, in one graph
            return runner.decode_sample([r.output_ids[-1] for r in reqs], [r.ctx_len for r in reqs],
                                        batch.temperatures, [r.seed for r in reqs], [len(r.output_ids) for r in reqs])
        else:
            logits = runner.decode([r.output_ids[-1] for r in reqs], [r.ctx_len for r in reqs])
        if not paged:
            tokens, logps = sample(logits, batch, shared_gen)
            return tokens.tolist(), logps.tolist()
        seeds, offsets = [r.seed for r in reqs], [len(r.output_ids) for r in reqs]
        if not batch.needs_filter:
            return runner.sample(logits, batch.temperatures, seeds, offsets)
        tokens, logps = sample_counter(logits, batch, seeds, offsets)
        return tokens.tolist(), logps.tolist()


async def isolate(plan: Plan, error: Exception, step: Callable[[Plan], Awaitable[tuple[list[int], list[float]]]],
                  abort: Callable[[Request, Exception], None]) -> tuple[Plan, list[int], list[float]]:
    """After a failed step: each of its requests alone, as a prefill of its whole sequence (which
    rewrites any KV the failed step left half-written and gives the same next token a decode
    would). Only the requests that fail alone are aborted; the rest keep going."""
    ok: list[Request] = []
    tokens: list[int] = []
    logps: list[float] = []
    for r in plan.requests:
        try:
            t, lp = await step(Plan("prefill", [r]))
        except Exception as e:  # noqa: BLE001 - this request's own failure
            abort(r, e)
            continue
        ok.append(r)
        tokens += t
        logps += lp
    if len(ok) == len(plan.requests) and len(ok) > 1:
        log.warning("a step of %d requests failed (%s); each alone succeeded", len(ok), error)
    return Plan(plan.kind, ok), tokens, logps
