"""The engine contract: what every generation engine (embedded TorchEngine, SGLang, a remote server)
promises the rest of streamrl.

Names, defaults and result shapes follow SGLang's native API (`/generate`), so that the same rollout
code drives an embedded engine, `streamrl serve`, or a real SGLang server. This module owns the request
and result types; it knows nothing about torch, HTTP or Ray.
"""

from __future__ import annotations

import enum
import math
from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

FinishType = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "in_place", "retract"]


class EngineState(enum.Enum):
    """The engine's lifecycle. Only SERVING runs steps; a paused engine queues new requests.

        SERVING --pause(mode)--> PAUSED_<mode> --resume--> SERVING
        SERVING | PAUSED_* --release_memory--> RELEASED --resume_memory--> the state it left
        any --aclose--> CLOSED
    """

    SERVING = "serving"
    PAUSED_ABORT = "paused_abort"  # in-flight requests were ended with their partial output
    PAUSED_RETRACT = "paused_retract"  # frozen; a weight update recomputes their KV
    PAUSED_IN_PLACE = "paused_in_place"  # frozen; their KV is kept across a weight update
    RELEASED = "released"  # KV cache freed and weights off the accelerator (colocated training)
    CLOSED = "closed"


PAUSED_STATES: dict[str, EngineState] = {"abort": EngineState.PAUSED_ABORT, "retract": EngineState.PAUSED_RETRACT,
           "in_place": EngineState.PAUSED_IN_PLACE}


class EngineError(Exception):
    """A request the engine cannot serve; HTTP front-ends map it to 400."""


_I64 = (-(2**63), 2**63 - 1)
MAX_STOPS, MAX_STOP_CHARS = 64, 1024  # stop strings are matched on every new token


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's sampling parameters (same names, defaults and ranges)."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # < 1e-6 means greedy, as in SGLang
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    # Accepted for SGLang compatibility; streamrl's engine does not apply penalties and rejects
    # non-default values rather than silently ignoring them.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-6

    def validate(self, vocab_size: int) -> None:
        """Raise EngineError naming the first out-of-range field. Ranges are the engine's own limits
        (int64 for integers, finite floats, the vocabulary), so no value can fail later inside a
        batched step, where it would take its batch-mates down with it."""
        ints = {"max_new_tokens": self.max_new_tokens, "top_k": self.top_k, "min_new_tokens": self.min_new_tokens,
                "n": self.n}
        for name, v in ints.items():
            if not _I64[0] <= v <= _I64[1]:
                raise EngineError(f"{name} must fit in a signed 64-bit integer, got {v}")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise EngineError(f"{name} must be a finite number, got {getattr(self, name)}")
        checks: list[tuple[bool, str]] = [
            (self.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {self.max_new_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 or >= 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.frequency_penalty == 0, "frequency_penalty is not supported by TorchEngine"),
            (self.presence_penalty == 0, "presence_penalty is not supported by TorchEngine"),
            (self.repetition_penalty == 1, "repetition_penalty is not supported by TorchEngine"),
            (self.min_new_tokens >= 0, f"min_new_tokens must be >= 0, got {self.min_new_tokens}"),
            (self.n == 1, "n > 1 is expanded by the HTTP layer, not the engine"),
            (self.sampling_seed is None or -(2**63) <= self.sampling_seed < 2**64,
             f"sampling_seed must be a 64-bit integer, got {self.sampling_seed}"),
            (len(self.stop_token_ids or []) <= MAX_STOPS, f"at most {MAX_STOPS} stop_token_ids"),
        ]
        for ok, msg in checks:
            if not ok:
                raise EngineError(msg)
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(len(x) > MAX_STOP_CHARS for x in stops):
            raise EngineError(f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
        for t in self.stop_token_ids or []:
            if not 0 <= t < vocab_size:
                raise EngineError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        try:
            return msgspec.convert(d or {}, cls)
        except msgspec.ValidationError as e:
            raise EngineError(f"sampling_params: {e}") from None


class GenerateChunk(msgspec.Struct, kw_only=True):
    """Incremental output of one request: the tokens produced since the previous chunk.

    The last chunk of a request has ``finished=True`` and carries the SGLang-shaped ``result``.
    """

    rid: str
    token_ids: list[int]
    logprobs: list[float]
    weight_version: str
    finished: bool = False
    result: dict[str, Any] | None = None


def check_prompt(input_ids: Any, sp: SamplingParams, vocab_size: int, context_len: int) -> None:
    """A request's prompt: token ids in the vocabulary, and room for it and its new tokens."""
    if not isinstance(input_ids, list) or not input_ids:
        raise EngineError("input_ids must be a non-empty list of token ids")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in input_ids):
        bad = next(t for t in input_ids if not (isinstance(t, int) and 0 <= t < vocab_size))
        raise EngineError(f"input_ids: token {bad!r} is outside the vocabulary [0, {vocab_size})")
    n = len(input_ids)
    if n >= context_len:
        raise EngineError(f"prompt has {n} tokens; the model's context is {context_len}")
    if n + sp.max_new_tokens > context_len:
        raise EngineError(f"prompt ({n}) + max_new_tokens ({sp.max_new_tokens}) exceeds the context length {context_len}")


def extend_version_spans(spans: list[dict[str, Any]], version: str, end: int, n: int) -> None:
    """Record that the `n` tokens ending at `end` came from `version` (SGLang's `weight_versions`)."""
    if spans and spans[-1]["version"] == version:
        spans[-1]["end"] = end
    else:
        spans.append({"version": version, "start": end - n, "end": end})


def finish_reason(kind: FinishType, **extra: Any) -> dict[str, Any]:
    return {"type": kind, **extra}


def build_result(
    *,
    rid: str,
    text: str,
    output_ids: list[int],
    logprobs: list[float],
    finish: dict[str, Any],
    prompt_tokens: int,
    weight_version: str,
    weight_versions: list[dict[str, Any]] | None = None,
    e2e_latency: float = 0.0,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    """The exact shape of SGLang's non-streaming `/generate` response."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(output_ids),
        "cached_tokens": cached_tokens,
        "weight_version": weight_version,
        "e2e_latency": e2e_latency,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, output_ids, strict=True)],
    }
    if weight_versions:
        meta["weight_versions"] = weight_versions
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}


@runtime_checkable
class Engine(Protocol):
    """What the rollout manager, the HTTP server and the Ray deployment rely on."""

    @property
    def weight_version(self) -> str: ...

    def generate_stream(
        self, input_ids: list[int], sampling_params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
    ) -> AsyncIterator[GenerateChunk]: ...

    async def generate(
        self, input_ids: list[int], sampling_params: SamplingParams | dict[str, Any] | None = None,
        rid: str | None = None,
    ) -> dict[str, Any]: ...

    async def abort(self, rid: str) -> bool: ...

    async def abort_all(self) -> int: ...

    async def pause(self, mode: PauseMode = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> None: ...

    async def update_weights_from_state_dict(
        self, named_tensors: Any, weight_version: str | None = None
    ) -> None: ...

    async def release_memory(self) -> None: ...

    async def resume_memory(self) -> None: ...

    async def health(self) -> bool: ...

    def stats(self) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...
