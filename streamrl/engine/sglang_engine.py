"""SGLangEngine: an in-process `sglang.Engine` behind streamrl's `Engine` protocol (see protocol.py).

UNVERIFIED HERE: sglang needs a CUDA build and is not installed on the machines this was written on.
The calls below were matched against SGLang's source (sgl-project/sglang, 0.5.x-era names; each call
cites the file it mirrors); `tests/test_sglang_contract.py` runs the behavioural contract wherever
sglang and a GPU are available, and skips elsewhere.

Data path: `generate()` validates the request with the same rules and messages as TorchEngine, then
calls `sglang.Engine.async_generate(input_ids=..., return_logprob=True, rid=...)`, whose result is
already SGLang's `/generate` dict (returned unchanged). `generate_stream()` calls it with `stream=True`;
SGLang's stream chunks are cumulative (whole `output_ids` and `output_token_logprobs` so far), so
`cumulative_to_delta` turns each into a `GenerateChunk` of the tokens since the previous chunk.

Control calls go straight to SGLang's `TokenizerManager` coroutines with its request structs, as verl's
async SGLang server does (`await engine.tokenizer_manager.<method>(ReqInput, None)`): `sglang.Engine`'s
own control methods are synchronous (`loop.run_until_complete`) and cannot run inside a running loop.

Differences from TorchEngine (SGLang's semantics, not this adapter's):
- A weight update while *not* paused waits until in-flight requests finish (SGLang's model-update
  writer lock). Under `pause("in_place")` it applies at once and running requests keep their old KV
  cache (stale keys/values, as SGLang documents); `pause("retract")` drops the KV cache so it is
  recomputed with the new weights on `resume()`, which is TorchEngine's behaviour.
- Logprobs are SGLang's: log-softmax of logits / T (T = 1 for greedy) by default; with the environment
  variable SGLANG_RETURN_ORIGINAL_LOGPROB=1 they are taken before temperature.
- `sampling_seed` is forwarded but only makes sampling reproducible when SGLang runs with
  deterministic inference enabled.
- `release_memory()` / `resume_memory()` need the engine started with `enable_memory_saver=True`.
- `aclose()` calls `sglang.Engine.shutdown()`, which kills every child process of this process
  (SGLang's `kill_process_tree(os.getpid(), include_parent=False)`).
- `update_weights_from_state_dict` ships tensors through `MultiprocessingSerializer` (torch's
  multiprocessing reductions: CUDA IPC handles for GPU tensors, shared memory for CPU ones), so the
  trainer and the engine must be on the same node.
"""

from __future__ import annotations

import importlib
import inspect
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from .protocol import EngineError, GenerateChunk, PauseMode, SamplingParams

_INSTALL_HINT = (
    "SGLangEngine needs the `sglang` package (a CUDA build, e.g. `pip install \"sglang[all]\"` on a GPU "
    "machine); it could not be imported here"
)
_SAMPLING_DEFAULTS = msgspec.structs.asdict(SamplingParams())


def _import(name: str) -> Any:
    """Import an sglang module lazily; a missing sglang becomes an EngineError that says so."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise EngineError(f"{_INSTALL_HINT}: {e}") from e


# ---- pure helpers (tested without sglang) ------------------------------------------------------------
def cumulative_to_delta(
    prev_len: int, chunk: dict[str, Any], *, rid: str | None = None, weight_version: str | None = None
) -> GenerateChunk:
    """One SGLang stream chunk (cumulative: every output token so far) -> the `GenerateChunk` of the
    tokens after the first `prev_len`.

    Shape read (tokenizer_manager.py `_handle_batch_output`, non-incremental streaming):
    ``{"text": str | None, "output_ids": [...all so far], "meta_info": {"id", "finish_reason": None |
    {...}, "weight_version", "output_token_logprobs": [[logprob, token_id, text | None], ...all so far],
    ...}}``. The last chunk (``finish_reason`` set) is the complete `/generate` result and is carried as
    ``result`` unchanged. Raises EngineError when the chunk is not cumulative (a server started with
    ``--incremental-streaming-output``) or carries no logprobs aligned with its tokens.
    """
    meta = chunk.get("meta_info") or {}
    ids = list(chunk.get("output_ids") or [])
    if len(ids) < prev_len:
        raise EngineError(
            f"SGLang stream chunk has {len(ids)} output_ids after {prev_len} were seen: chunks are not "
            "cumulative (was the engine started with incremental streaming output?)"
        )
    lps = meta.get("output_token_logprobs")
    if lps is None:
        raise EngineError("SGLang stream chunk has no meta_info.output_token_logprobs (return_logprob off?)")
    if len(lps) != len(ids):
        raise EngineError(
            f"SGLang stream chunk: {len(lps)} output_token_logprobs for {len(ids)} output_ids"
        )
    new_ids = ids[prev_len:]
    new_lps = [float(entry[0]) for entry in lps[prev_len:]]
    if any(int(entry[1]) != t for entry, t in zip(lps[prev_len:], new_ids, strict=True)):
        raise EngineError("SGLang stream chunk: output_token_logprobs token ids differ from output_ids")
    finished = meta.get("finish_reason") is not None
    version = meta.get("weight_version", weight_version if weight_version is not None else "default")
    return GenerateChunk(
        rid=str(rid if rid is not None else meta.get("id", "")),
        token_ids=new_ids,
        logprobs=new_lps,
        weight_version=str(version),
        finished=finished,
        result=chunk if finished else None,
    )


def sglang_sampling_params(sp: SamplingParams) -> dict[str, Any]:
    """The sampling_params dict sent to SGLang: only the fields that differ from the defaults (which
    are SGLang's own), so fields an older SGLang lacks are sent only when actually used."""
    d = msgspec.structs.asdict(sp)
    return {k: v for k, v in d.items() if v != _SAMPLING_DEFAULTS[k] and k != "n"}


def validate_request(
    input_ids: Any, sp: SamplingParams, *, vocab_size: int, context_len: int
) -> None:
    """TorchEngine's request checks and messages, with SGLang's penalty ranges instead of TorchEngine's
    refusal (SGLang applies penalties)."""
    neutral = msgspec.structs.replace(sp, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0)
    neutral.validate(vocab_size)
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(sp, name)
        if not -2.0 <= v <= 2.0:
            raise EngineError(f"{name} must be in [-2, 2], got {v}")
    if not 0.0 < sp.repetition_penalty <= 2.0:
        raise EngineError(f"repetition_penalty must be in (0, 2], got {sp.repetition_penalty}")
    if not isinstance(input_ids, list) or not input_ids:
        raise EngineError("input_ids must be a non-empty list of token ids")
    for t in input_ids:
        if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size):
            raise EngineError(f"input_ids: token {t!r} is outside the vocabulary [0, {vocab_size})")
    n = len(input_ids)
    if n >= context_len:
        raise EngineError(f"prompt has {n} tokens; the model's context is {context_len}")
    if n + sp.max_new_tokens > context_len:
        raise EngineError(
            f"prompt ({n}) + max_new_tokens ({sp.max_new_tokens}) exceeds the context length {context_len}"
        )


def bump_version(version: str) -> str:
    """TorchEngine's rule: a numeric version goes up by one, anything else becomes "1"."""
    return str(int(version) + 1) if version.isdigit() else "1"


def _is_bad_request_abort(result: dict[str, Any]) -> str | None:
    """SGLang reports a request it refuses after tokenization (too long, bad sampling values) as an
    abort with status_code 400 (tokenizer_manager.py `_handle_abort_finish_reason`): return its message."""
    fr = (result.get("meta_info") or {}).get("finish_reason") or {}
    if fr.get("type") == "abort" and fr.get("status_code") == 400:
        return str(fr.get("message", "bad request"))
    return None


# ---- the adapter --------------------------------------------------------------------------------------
class SGLangEngine:
    """`sglang.Engine` in this process, behind streamrl's async Engine contract.

    ``SGLangEngine(model_path, dtype="bfloat16", mem_fraction_static=0.5, ...)``: keyword arguments are
    SGLang `ServerArgs` fields, passed to `sglang.Engine` as they are. ``engine=`` wraps an
    `sglang.Engine` built elsewhere instead. Use as an async context manager, or call `aclose()`.
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        weight_version: str = "default",
        engine: Any = None,
        **server_args: Any,
    ) -> None:
        if engine is None:
            if model_path is None:
                raise EngineError("SGLangEngine needs a model_path (or an existing sglang.Engine as engine=)")
            sglang = _import("sglang")
            if weight_version != "default":
                server_args.setdefault("weight_version", weight_version)
            # python/sglang/srt/entrypoints/engine.py: Engine(**kwargs) builds ServerArgs(**kwargs) and
            # launches the scheduler / detokenizer processes; it blocks until the model is loaded.
            engine = sglang.Engine(model_path=model_path, **server_args)
            try:
                self._setup(engine, model_path, weight_version)
            except BaseException:
                engine.shutdown()  # ours: do not leave its scheduler processes behind
                raise
        else:
            self._setup(engine, model_path, weight_version)

    def _setup(self, engine: Any, model_path: str | None, weight_version: str) -> None:
        self._engine = engine
        self.model_path = model_path
        self._version = weight_version
        args = self._server_args
        if getattr(args, "incremental_streaming_output", False) or getattr(args, "stream_output", False):
            raise EngineError(
                "SGLangEngine needs SGLang's default cumulative stream chunks; "
                "start it without incremental streaming output"
            )
        tm = self._tm
        cfg = getattr(tm, "model_config", None)
        self.vocab_size = int(getattr(cfg, "vocab_size", 0) or 0) or self._hf_vocab_size()
        self.context_len = int(getattr(tm, "context_len", 0) or getattr(cfg, "context_len", 0) or 0)
        if not self.context_len:
            raise EngineError("SGLangEngine: could not read the context length from SGLang's TokenizerManager")
        self._inflight: set[str] = set()
        self._paused = False
        self._closed = False
        self._stats = {"generated_tokens": 0, "num_requests": 0, "busy_s": 0.0}
        self._busy_since: float | None = None
        self._tps_window: list[tuple[float, int]] = []

    # ---- plumbing ---------------------------------------------------------------------------------
    @property
    def _tm(self) -> Any:
        return self._engine.tokenizer_manager

    @property
    def _server_args(self) -> Any:
        # The tokenizer manager's ServerArgs is the object SGLang updates (weight_version) at runtime.
        return getattr(self._tm, "server_args", None) or getattr(self._engine, "server_args", None)

    @property
    def tokenizer(self) -> Any:
        return getattr(self._tm, "tokenizer", None)

    def _hf_vocab_size(self) -> int:
        from transformers import AutoConfig

        if self.model_path is None:
            raise EngineError("SGLangEngine: could not read the vocabulary size from SGLang's TokenizerManager")
        return int(AutoConfig.from_pretrained(self.model_path).vocab_size)

    @staticmethod
    def _io() -> Any:
        return _import("sglang.srt.managers.io_struct")

    async def __aenter__(self) -> SGLangEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def weight_version(self) -> str:
        """SGLang's own record (the value it stamps into meta_info.weight_version)."""
        tm = self._tm
        config_value = getattr(tm, "config_value", None)  # newer tokenizer_manager: config_value(name)
        if callable(config_value):
            try:
                return str(config_value("weight_version"))
            except Exception:  # noqa: BLE001 - fall back to the 0.5.x attribute below
                pass
        v = getattr(self._server_args, "weight_version", None)  # 0.5.x: tokenizer_manager.server_args
        return str(v) if v is not None else self._version

    @property
    def is_paused(self) -> bool:
        return self._paused

    # ---- requests ---------------------------------------------------------------------------------
    def _prepare(self, input_ids: Any, params: SamplingParams | dict | None, rid: str | None) -> tuple[dict, str]:
        if self._closed:
            raise EngineError("engine is closed")
        sp = params if isinstance(params, SamplingParams) else SamplingParams.from_dict(params)
        validate_request(input_ids, sp, vocab_size=self.vocab_size, context_len=self.context_len)
        if sp.stop and self.tokenizer is None:
            raise EngineError("stop strings need a tokenizer; use stop_token_ids")
        rid = rid or uuid.uuid4().hex
        if rid in self._inflight:
            raise EngineError(f"duplicate request id {rid!r}")
        return sglang_sampling_params(sp), rid

    def _track(self, rid: str) -> None:
        if not self._inflight:
            self._busy_since = time.monotonic()
        self._inflight.add(rid)
        self._stats["num_requests"] += 1

    def _untrack(self, rid: str) -> None:
        self._inflight.discard(rid)
        if not self._inflight and self._busy_since is not None:
            self._stats["busy_s"] += time.monotonic() - self._busy_since
            self._busy_since = None

    def _count_tokens(self, n: int) -> None:
        if n:
            self._stats["generated_tokens"] += n
            self._tps_window.append((time.monotonic(), n))
            if len(self._tps_window) > 256:
                del self._tps_window[:128]

    async def _start(self, input_ids: list[int], sampling: dict, rid: str, stream: bool) -> Any:
        # python/sglang/srt/entrypoints/engine.py Engine.async_generate(prompt, sampling_params,
        # input_ids, ..., return_logprob, ..., stream, ..., rid): a dict, or an async iterator if stream.
        try:
            return await self._engine.async_generate(
                input_ids=list(input_ids), sampling_params=sampling, return_logprob=True, stream=stream, rid=rid
            )
        except ValueError as e:  # SGLang's request validation (tokenizer_manager.py) raises ValueError
            raise EngineError(str(e)) from e

    async def generate(
        self, input_ids: list[int], sampling_params: SamplingParams | dict | None = None, rid: str | None = None
    ) -> dict[str, Any]:
        sampling, rid = self._prepare(input_ids, sampling_params, rid)
        self._track(rid)
        try:
            result = await self._start(input_ids, sampling, rid, stream=False)
        finally:
            self._untrack(rid)
        self._count_tokens(len(result.get("output_ids") or []))
        return result

    async def generate_stream(
        self, input_ids: list[int], sampling_params: SamplingParams | dict | None = None, rid: str | None = None
    ) -> AsyncIterator[GenerateChunk]:
        sampling, rid = self._prepare(input_ids, sampling_params, rid)
        self._track(rid)
        finished = False
        seen = 0
        try:
            it = await self._start(input_ids, sampling, rid, stream=True)
            while True:
                try:
                    out = await it.__anext__()
                except StopAsyncIteration:
                    break
                except ValueError as e:  # older SGLang raises bad-request aborts in streams too
                    raise EngineError(str(e)) from e
                msg = _is_bad_request_abort(out)
                if msg is not None and not out.get("output_ids"):
                    finished = True
                    raise EngineError(msg)
                chunk = cumulative_to_delta(seen, out, rid=rid, weight_version=self.weight_version)
                seen += len(chunk.token_ids)
                self._count_tokens(len(chunk.token_ids))
                if chunk.finished:
                    finished = True
                if chunk.token_ids or chunk.finished:
                    yield chunk
                if finished:
                    return
            if not finished:
                raise EngineError(f"SGLang stream for {rid!r} ended without a finished chunk")
        finally:
            self._untrack(rid)
            if not finished:  # the consumer went away: free the slot (SGLang aborts on disconnect)
                await self._abort_rid(rid)

    # ---- control plane ----------------------------------------------------------------------------
    async def _abort_rid(self, rid: str = "", abort_all: bool = False) -> None:
        # python/sglang/srt/managers/tokenizer_manager.py TokenizerManager.abort_request(rid, abort_all):
        # synchronous in 0.5.x (sends AbortReq to the scheduler; unknown rid is a no-op).
        res = self._tm.abort_request(rid=rid, abort_all=abort_all)
        if inspect.isawaitable(res):  # tolerate a coroutine version
            await res

    async def abort(self, rid: str) -> bool:
        """End one request now; it returns its partial output (finish_reason abort). Unknown: False."""
        if rid not in self._inflight:
            return False
        await self._abort_rid(rid)
        return True

    async def abort_all(self) -> int:
        n = len(self._inflight)
        await self._abort_rid(abort_all=True)
        return n

    async def pause(self, mode: PauseMode = "abort") -> None:
        """SGLang's pause_generation: `abort` ends in-flight requests with their partial output,
        `in_place` freezes them with their KV cache, `retract` moves them back to the waiting queue
        (KV recomputed on resume). New requests wait until `resume()` in every mode."""
        if mode not in ("abort", "in_place", "retract"):
            raise EngineError(f"pause mode must be abort, in_place or retract, got {mode!r}")
        io = self._io()
        # io_struct.py PauseGenerationReqInput(mode); tokenizer_manager.py pause_generation(obj) (as
        # verl's async_sglang_server.py calls it: one argument, no request).
        await self._tm.pause_generation(io.PauseGenerationReqInput(mode=mode))
        self._paused = True

    async def resume(self) -> None:
        io = self._io()
        # io_struct.py ContinueGenerationReqInput(); tokenizer_manager.py continue_generation(obj).
        await self._tm.continue_generation(io.ContinueGenerationReqInput())
        self._paused = False

    def _next_version(self, weight_version: str | None) -> str:
        return str(weight_version) if weight_version is not None else bump_version(self.weight_version)

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> None:
        """Load a HF folder (SGLang's loader: safetensors or bin) and set the weight version."""
        io = self._io()
        version = self._next_version(weight_version)
        # io_struct.py UpdateWeightFromDiskReqInput(model_path, load_format, abort_all_requests,
        # weight_version, ...); tokenizer_manager.py update_weights_from_disk(obj, request) ->
        # (success, message, num_paused_requests), as http_server.py /update_weights_from_disk unpacks it.
        obj = io.UpdateWeightFromDiskReqInput(model_path=str(path), weight_version=version)
        success, message, *_ = await self._tm.update_weights_from_disk(obj, None)
        if not success:
            raise EngineError(f"update_weights_from_disk: {message}")
        self._version = version

    async def update_weights_from_state_dict(self, named_tensors: Any, weight_version: str | None = None) -> None:
        """Send tensors to the engine's processes via `MultiprocessingSerializer` (CUDA IPC handles for
        GPU tensors: same node only), as verl and slime do. Keep GPU tensors on the GPU."""
        io = self._io()
        utils = _import("sglang.srt.utils")
        named = list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        version = self._next_version(weight_version)
        tp_size = int(getattr(self._server_args, "tp_size", 1) or 1)
        # engine.py Engine.update_weights_from_tensor / _serialize_tensors_per_rank: one
        # MultiprocessingSerializer.serialize(named_tensors) payload per TP rank; io_struct.py
        # UpdateWeightsFromTensorReqInput(serialized_named_tensors, load_format, flush_cache,
        # abort_all_requests, weight_version); tokenizer_communicator_mixin.py
        # update_weights_from_tensor(obj, request) -> (success, message).
        payloads = [utils.MultiprocessingSerializer.serialize(named) for _ in range(tp_size)]
        obj = io.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, flush_cache=True, weight_version=version
        )
        success, message, *_ = await self._tm.update_weights_from_tensor(obj, None)
        del payloads  # `named` (the producer's tensors) stays alive until here: IPC handles need it
        if not success:
            raise EngineError(f"update_weights_from_tensor: {message}")
        self._version = version

    async def release_memory(self) -> None:
        """Free weights and KV cache on the GPU (needs enable_memory_saver=True); refuses while requests
        are in flight (SGLang's scheduler asserts it is idle)."""
        if self._inflight:
            raise EngineError("release_memory: requests are in flight; pause(mode='abort') first")
        io = self._io()
        # io_struct.py ReleaseMemoryOccupationReqInput(tags=None: all); tokenizer_communicator_mixin.py
        # release_memory_occupation(obj, request).
        await self._tm.release_memory_occupation(io.ReleaseMemoryOccupationReqInput(), None)

    async def resume_memory(self) -> None:
        io = self._io()
        # io_struct.py ResumeMemoryOccupationReqInput(tags=None); resume_memory_occupation(obj, request).
        await self._tm.resume_memory_occupation(io.ResumeMemoryOccupationReqInput(), None)

    async def flush_cache(self) -> bool:
        """Drop SGLang's radix (prefix) cache; SGLang refuses while requests run (returns False)."""
        # tokenizer_manager.py flush_cache() -> FlushCacheReqOutput(success, ...).
        out = await self._tm.flush_cache()
        return bool(getattr(out, "success", out))

    async def health(self) -> bool:
        return not self._closed and not getattr(self._tm, "gracefully_exit", False)

    def stats(self) -> dict[str, Any]:
        """`running` counts every request in flight (SGLang's own running/queued split is not visible
        without a round trip to its scheduler, so `waiting` is 0); `busy_s` is wall time with at least
        one request in flight."""
        now = time.monotonic()
        recent = [(t, n) for t, n in self._tps_window if now - t < 5.0]
        span = now - recent[0][0] if len(recent) > 1 else 0.0
        tps = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        busy = self._stats["busy_s"] + (now - self._busy_since if self._busy_since is not None else 0.0)
        return {
            "running": len(self._inflight),
            "waiting": 0,
            "paused": self._paused,
            "weight_version": self.weight_version,
            "tokens_per_s": tps,
            "kv_cache_bytes": 0,
            "backend": "sglang",
            **self._stats,
            "busy_s": busy,
        }

    async def aclose(self) -> None:
        if self._closed:
            return
        if self._inflight:
            await self._abort_rid(abort_all=True)
        self._closed = True
        # engine.py Engine.shutdown(): kills this process's child process tree (scheduler, detokenizer).
        self._engine.shutdown()
