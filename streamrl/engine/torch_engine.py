"""TorchEngine: the embedded generation engine (any local Hugging Face causal LM, CPU or CUDA).

Data path of one request: `generate()` validates it and queues a `Request` → the engine loop asks the
`Scheduler` for a plan (prefill new requests, or decode every running one) → `step.execute` runs it on
the runner (`ModelRunner`'s per-slot KV on CPU, `gpu.PagedRunner`'s paged KV and CUDA graphs on a GPU)
and samples, in a worker thread (so the asyncio loop keeps serving HTTP and control calls) → the loop
appends the tokens, checks stop conditions and delivers chunks / the final SGLang-shaped result.
Control operations (abort, pause, weight updates, memory release) take the step lock, so they apply
atomically *between* steps.

The engine knows nothing about Ray, HTTP, rewards or training.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch

from ..devices import resolve_device
from ..weights.lora import Adapter, Merger
from .args import EngineArgs
from .loading import eos_ids, load_state, weight_bytes
from .model_runner import ModelRunner
from .protocol import (
    PAUSED_STATES,
    EngineError,
    EngineState,
    GenerateChunk,
    PauseMode,
    SamplingParams,
    build_result,
    check_prompt,
    extend_version_spans,
    finish_reason,
)
from .runners import make_runner
from .scheduler import Plan, Request, Scheduler
from .step import execute, isolate

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchEngine:
    """Continuous-batching engine with SGLang's request contract. Use as an async context manager."""

    def __init__(self, model_path: str, args: EngineArgs | None = None, *, load_tokenizer: bool = True,
                 inline: bool | None = None, **settings: Any) -> None:
        """`args`: every engine setting (engine/args.py; the defaults without it), `settings` any of them
        by name over it (`TorchEngine(path, max_running_requests=8)`). `args.runner`: `auto` (the paged
        GPU runner on CUDA for Llama-family models, the per-slot runner elsewhere), `paged`, `slots`.
        `inline`: steps on the event-loop thread (the default on CPU) or in a worker thread."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.args = args = (args or EngineArgs()).with_(**settings)
        self.model_path = model_path
        self.device = resolve_device(args.device)
        self.dtype = _DTYPES[args.dtype]
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path) if load_tokenizer else None
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.context_len = int(args.max_seq_len or getattr(cfg, "max_position_embeddings", 2048))
        self.eos_ids = eos_ids(self.model)
        rows = args.max_running_requests
        self.runner, total = make_runner(self.model, args.runner, rows, self.context_len, args.max_total_tokens,
                                         cpu_kernel=args.cpu_kernel, kv_cache_fraction=args.kv_cache_fraction)
        self.paged = bool(getattr(self.runner, "paged", False))
        self._stream = torch.cuda.Stream(self.device) if self.paged and self.device != "cpu" else None
        self.scheduler = Scheduler(
            max_running=rows,
            max_total_tokens=total,
            max_prefill_tokens=max(args.max_prefill_tokens, self.context_len),
            page_size=getattr(self.runner, "page_size", 1),
        )
        self._version = args.weight_version
        self._gen = torch.Generator(device=self.device).manual_seed(args.seed)
        self._seeds = random.Random(args.seed)  # the paged runner's unseeded requests: a seed each
        # torch's intra-op thread count is per calling thread: set it in the worker that computes, so an
        # engine and a trainer in one process can split the cores instead of oversubscribing them.
        # `inline` runs steps on the event-loop thread instead: no thread hop and no second OpenMP team
        # (on small CPUs two teams' spinning workers slow each other down), at the price of blocking the
        # loop for one step at a time. Right for a process that does nothing but generate.
        self._inline = self.device == "cpu" if inline is None else inline
        threads = args.num_threads
        if self._inline and threads:
            torch.set_num_threads(threads)
        init = (lambda: torch.set_num_threads(threads)) if threads else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-engine", initializer=init)
        self._step_lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._requests: dict[str, Request] = {}
        self.step_gate: Any = None  # controller.deterministic: asked before every step (rollout.Lockstep)
        self.state = EngineState.SERVING
        self._after_release = EngineState.SERVING  # where resume_memory returns to
        # prefill_*: first computation of a prompt, and recomputation of a resumed or flushed request's
        # tokens after a weight update: the price of exact partial resume.
        self._stats = {"generated_tokens": 0, "num_steps": 0, "num_requests": 0, "busy_s": 0.0,
                       "prefill_tokens": 0, "prefill_s": 0.0}
        self._tps_window: list[tuple[float, int]] = []
        self._merger: Merger | None = None  # the base weights LoRA adapters apply to

    # ---- lifecycle -------------------------------------------------------------------------------
    async def __aenter__(self) -> TorchEngine:
        self._ensure_loop()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _set_state(self, state: EngineState) -> None:
        self.state = state
        self.scheduler.paused = state is not EngineState.SERVING  # the scheduler's only input from here

    def _ensure_loop(self) -> None:
        if self.state is EngineState.CLOSED:
            raise EngineError("engine is closed")
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="torch-engine-loop")

    async def aclose(self) -> None:
        if self.state is EngineState.CLOSED:
            return
        await self.abort_all()
        self._set_state(EngineState.CLOSED)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self._executor.shutdown(wait=True)

    @property
    def weight_version(self) -> str:
        return self._version

    # ---- requests --------------------------------------------------------------------------------
    def _make_request(self, input_ids: Any, params: SamplingParams | dict | None, rid: str | None) -> Request:
        sp = params if isinstance(params, SamplingParams) else SamplingParams.from_dict(params)
        sp.validate(self.vocab_size)
        if sp.top_k >= self.vocab_size:  # the whole vocabulary (and no int overflow in the sampler)
            sp = msgspec.structs.replace(sp, top_k=-1)
        check_prompt(input_ids, sp, self.vocab_size, self.context_len)
        n = len(input_ids)
        if sp.stop and self.tokenizer is None:
            raise EngineError("stop strings need a tokenizer; use stop_token_ids")
        rid = rid or uuid.uuid4().hex
        if rid in self._requests:
            raise EngineError(f"duplicate request id {rid!r}")
        stop = set(sp.stop_token_ids or [])
        if not sp.ignore_eos:
            stop |= self.eos_ids
        if self.scheduler.reservation(n + sp.max_new_tokens) > self.scheduler.max_total_tokens:
            raise EngineError(f"prompt ({n}) + max_new_tokens ({sp.max_new_tokens}) exceeds the engine's KV budget "
                              f"of {self.scheduler.max_total_tokens} tokens")
        gen, seed = None, sp.sampling_seed
        if self.paged:  # counter-based noise on the GPU: a seed (as int64, what the kernel reads), not a generator
            seed = self._seeds.getrandbits(63) if seed is None else (seed + 2**63) % 2**64 - 2**63
        elif seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(seed % 2**64)
        return Request(rid=rid, input_ids=list(input_ids), params=sp, stop_ids=frozenset(stop), generator=gen,
                       seed=seed or 0)

    def _submit(self, req: Request, sink: Any) -> None:
        self._ensure_loop()
        req.sink = sink
        self._requests[req.rid] = req
        self._stats["num_requests"] += 1
        if req.params.max_new_tokens == 0:
            self._finish(req, finish_reason("length", length=0))
            return
        self.scheduler.add(req)
        self._wakeup.set()

    async def generate(
        self, input_ids: list[int], sampling_params: SamplingParams | dict | None = None, rid: str | None = None
    ) -> dict[str, Any]:
        return (await self.generate_many([input_ids], [sampling_params], [rid]))[0]

    async def generate_many(self, input_ids: list[list[int]], sampling_params: list[SamplingParams | dict | None],
                            rids: list[str | None]) -> list[dict[str, Any]]:
        """Several requests at once (a group's samples), answered in order: the batch form of SGLang's
        `/generate`. All are checked before any is queued, so a bad one fails the call and queues none.
        A caller that goes away (cancelled) frees their slots, as `generate_stream` does."""
        reqs = [self._make_request(i, p, r) for i, p, r in zip(input_ids, sampling_params, rids, strict=True)]
        if len({r.rid for r in reqs}) < len(reqs):
            raise EngineError("duplicate request id in a batch")
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[dict[str, Any]]] = [loop.create_future() for _ in reqs]
        if self.step_gate is not None and self.step_gate.active:
            self.step_gate.caller_waits(reqs)
        for req, fut in zip(reqs, futs, strict=True):
            self._submit(req, fut)
        try:
            return list(await asyncio.gather(*futs))  # futures, not coroutines: no task per request
        except asyncio.CancelledError:
            for req in reqs:
                if not req.finished:
                    await self.abort(req.rid)
            raise

    async def generate_stream(
        self, input_ids: list[int], sampling_params: SamplingParams | dict | None = None, rid: str | None = None
    ) -> AsyncIterator[GenerateChunk]:
        req = self._make_request(input_ids, sampling_params, rid)
        queue: asyncio.Queue[GenerateChunk] = asyncio.Queue()
        self._submit(req, queue)
        try:
            while True:
                chunk = await queue.get()
                yield chunk
                if chunk.finished:
                    return
        finally:
            if not req.finished:  # the consumer went away: free the slot, as SGLang does on disconnect
                await self.abort(req.rid)

    # ---- the loop --------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            if self.step_gate is not None:
                await self.step_gate.before_step(self)
            if not self.scheduler.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            async with self._step_lock:
                plan = self.scheduler.schedule()
                if plan is None:
                    continue
                t0 = time.perf_counter()
                try:
                    tokens, logps = await self._step(plan)
                except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
                    plan, tokens, logps = await isolate(plan, e, self._step, self._abort_failed)
                    if not plan.requests:
                        continue
                dt = time.perf_counter() - t0
                self._stats["busy_s"] += dt
                if plan.kind == "prefill":
                    self._stats["prefill_s"] += dt
                    self._stats["prefill_tokens"] += sum(len(r.seq) for r in plan.requests)
                self._stats["num_steps"] += 1
                self._postprocess(plan, tokens, logps)
            if self._inline:
                await asyncio.sleep(0)  # one step at a time: let HTTP, control calls and the trainer in

    async def _step(self, plan: Plan) -> tuple[list[int], list[float]]:
        return await self._on_step_thread(self._execute, plan)

    async def _on_step_thread(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` where the engine's steps run: inline on the loop's thread, else its worker thread."""
        if self._inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _abort_failed(self, r: Request, e: Exception) -> None:
        self._finish(r, finish_reason("abort", message=f"engine error: {e}"), error=e)

    def _execute(self, plan: Plan) -> tuple[list[int], list[float]]:
        """Runs in the worker thread: tensors only, no engine state changes."""
        return execute(self.runner, plan, self._gen, self._stream)

    def _postprocess(self, plan: Plan, tokens: list[int], logps: list[float]) -> None:
        now = time.monotonic()
        for r, tok, lp in zip(plan.requests, tokens, logps, strict=True):
            if r.finished:
                continue
            r.needs_prefill = False
            r.output_ids.append(tok)
            r.logprobs.append(lp)
            self._note_version(r, 1)
            if isinstance(r.sink, asyncio.Queue):
                r.sink.put_nowait(GenerateChunk(rid=r.rid, token_ids=[tok], logprobs=[lp], weight_version=self._version))
            n = len(r.output_ids)
            if tok in r.stop_ids and n > r.params.min_new_tokens:
                self._finish(r, finish_reason("stop", matched=tok))
            elif n >= r.params.max_new_tokens:
                self._finish(r, finish_reason("length", length=n))
            elif r.params.stop and self._hit_stop_string(r):
                pass
        self._stats["generated_tokens"] += len(tokens)
        self._tps_window.append((now, len(tokens)))
        if len(self._tps_window) > 256:
            del self._tps_window[:128]

    def _hit_stop_string(self, r: Request) -> bool:
        stops = [r.params.stop] if isinstance(r.params.stop, str) else list(r.params.stop or [])
        assert self.tokenizer is not None
        tail = self.tokenizer.decode(r.output_ids[-32:], skip_special_tokens=r.params.skip_special_tokens)
        for s in stops:
            if s and s in tail:
                self._finish(r, finish_reason("stop", matched=s))
                return True
        return False

    def _note_version(self, r: Request, n: int) -> None:
        extend_version_spans(r.version_spans, self._version, len(r.output_ids), n)

    def _finish(self, r: Request, finish: dict[str, Any], error: Exception | None = None) -> None:
        if r.finished:
            return
        r.finished = True
        if r.on_finish is not None:
            r.on_finish()
        if r.row is not None:
            self.runner.free_row(r.row)
        moved = self.scheduler.remove(r)
        if moved is not None:
            src, dst = moved
            # Only its cached positions: ctx_len, plus the one this step wrote if its token is not appended yet.
            self.runner.move_row(src, dst, min(self.scheduler.running[dst].ctx_len + 1, self.runner.max_len))
        self._requests.pop(r.rid, None)
        text = ""
        if self.tokenizer is not None and r.output_ids:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
        result = build_result(
            rid=r.rid, text=text, output_ids=r.output_ids, logprobs=r.logprobs, finish=finish,
            prompt_tokens=len(r.input_ids), weight_version=self._version,
            # Spans whenever the tokens' version is not simply the current one (a request that ran
            # across an update, or was aborted right after one before producing a new token).
            weight_versions=r.version_spans if len(r.version_spans) > 1 or (
                r.version_spans and r.version_spans[0]["version"] != self._version) else None,
            e2e_latency=time.monotonic() - r.created,
        )
        if isinstance(r.sink, asyncio.Future) and not r.sink.done():
            r.sink.set_result(result)
        elif isinstance(r.sink, asyncio.Queue):
            r.sink.put_nowait(
                GenerateChunk(rid=r.rid, token_ids=[], logprobs=[], weight_version=self._version,
                              finished=True, result=result)
            )

    # ---- control plane ---------------------------------------------------------------------------
    def _abort_now(self, r: Request, message: str = "Aborted") -> None:
        msg = message if r.row is not None else "Abort in waiting queue"
        self._finish(r, finish_reason("abort", message=msg, status_code=200, err_type=None))

    async def abort(self, rid: str) -> bool:
        """End one request now; it returns everything generated so far. Unknown rid: no-op, False."""
        async with self._step_lock:
            r = self._requests.get(rid)
            if r is None:
                return False
            self._abort_now(r)
            return True

    async def abort_all(self) -> int:
        async with self._step_lock:
            reqs = self.scheduler.all_requests()
            for r in reqs:
                self._abort_now(r)
            return len(reqs)

    async def pause(self, mode: PauseMode = "abort") -> None:
        """New requests wait until `resume()`; in-flight ones, as in SGLang:
        - `abort`: end now with their partial output (the caller resubmits prompt + partial response).
        - `retract`: freeze; a weight update meanwhile recomputes their KV with the new weights before
          they go on (SGLang frees it and prefills them again): exact, no round trip through the caller.
        - `in_place`: freeze with their KV as it is; after a weight update they go on reading keys and
          values the old weights computed (SGLang keeps the running batch untouched; PipelineRL's
          in-flight updates). No recomputation, but a token sampled then depends on both versions."""
        if mode not in PAUSED_STATES:
            raise EngineError(f"pause mode must be abort, in_place or retract, got {mode!r}")
        async with self._step_lock:
            self._check_open()
            if self.state is EngineState.RELEASED:
                self._after_release = PAUSED_STATES[mode]
            else:
                self._set_state(PAUSED_STATES[mode])
            if mode == "abort":
                for r in self.scheduler.all_requests():
                    self._abort_now(r)

    async def resume(self) -> None:
        self._check_open()
        if self.state is EngineState.RELEASED:
            raise EngineError("resume: the engine's memory is released; resume_memory first")
        self._set_state(EngineState.SERVING)
        self._wakeup.set()

    def _check_open(self) -> None:
        if self.state is EngineState.CLOSED:
            raise EngineError("engine is closed")

    @property
    def is_paused(self) -> bool:
        return self.state is not EngineState.SERVING

    async def update_weights_from_state_dict(self, named_tensors: Any, weight_version: str | None = None) -> None:
        """Load new weights between two steps. Running requests keep their tokens; their KV is recomputed
        with the new weights before they decode again, unless paused `in_place`, which keeps it (`pause`)."""
        tensors = dict(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        self._merger = self._merger if not tensors else None  # new weights: the next adapter applies to them
        await self._update(lambda: load_state(self.model, tensors), weight_version)

    async def load_lora_adapter(self, adapter: Adapter, weight_version: str | None = None) -> None:
        """A weight update of LoRA adapters only, merged from the base weights (weights/lora.py: Merger)."""
        merger = self._merger = self._merger or Merger(self.model)
        try:
            merger.check(adapter)
        except ValueError as e:
            raise EngineError(f"load_lora_adapter: {e}") from None
        await self._update(lambda: merger.apply(adapter), weight_version)

    async def _update(self, load: Any, weight_version: str | None) -> None:
        async with self._step_lock:  # where the steps run: torch ops in a second thread start a second
            await self._on_step_thread(self._load_weights, load)  # OpenMP team, which slows every later step
            v = self._version  # no version given: the next number
            self._version = str(weight_version) if weight_version is not None else str(int(v) + 1) if v.isdigit() else "1"
            if self.state is not EngineState.PAUSED_IN_PLACE:
                self.scheduler.flush()
        self._wakeup.set()

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> None:
        from ..weights import load_folder

        try:
            tensors = await asyncio.to_thread(load_folder, path)
        except FileNotFoundError as e:
            raise EngineError(f"update_weights_from_disk: {e}") from None
        await self.update_weights_from_state_dict(tensors, weight_version)

    def _load_weights(self, load: Any) -> None:
        if self.state is EngineState.RELEASED:
            raise EngineError("update_weights: the engine's memory is released; resume_memory first")
        load()

    async def release_memory(self, weights: bool = True) -> None:
        """Free the KV cache and, with `weights`, move the weights to host memory (colocated training:
        SGLang's release_memory_occupation with tags kv_cache / weights)."""
        async with self._step_lock:
            self._check_open()
            if self.state is EngineState.RELEASED:
                return
            if self.scheduler.num_running:  # queued ones hold no KV: they wait for resume_memory and resume
                raise EngineError("release_memory: requests are running; pause(mode='abort') first")
            if self.paged:
                self.runner.release(weights)  # type: ignore[union-attr]
            else:
                self.runner.free()
                if weights and self.device != "cpu":
                    self.model.to("cpu")
                    torch.cuda.empty_cache()
            self._after_release = self.state
            self._set_state(EngineState.RELEASED)

    async def resume_memory(self) -> None:
        async with self._step_lock:
            self._check_open()
            if self.state is EngineState.RELEASED:
                if self.paged:
                    await asyncio.get_running_loop().run_in_executor(self._executor, self.runner.restore)  # type: ignore[union-attr]
                else:
                    self.model.to(self.device)
                    self.runner.allocate()
                self._set_state(self._after_release)
        self._wakeup.set()

    def memory_bytes(self) -> int:
        """What the engine holds on its device: the KV cache and the weights."""
        return self.runner.kv_bytes() + weight_bytes(self.model, self.device)

    async def flush_cache(self) -> bool:
        """No prefix cache is kept across requests, so there is nothing to drop; SGLang refuses while
        requests run, and so do we."""
        return not (self.scheduler.num_running or self.scheduler.num_waiting)

    async def health(self) -> bool:
        return self.state is not EngineState.CLOSED and (self._loop_task is None or not self._loop_task.done())

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        recent = [(t, n) for t, n in self._tps_window if now - t < 5.0]
        span = now - recent[0][0] if len(recent) > 1 else 0.0
        tps = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        return {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "paused": self.is_paused,
            "state": self.state.value,
            "weight_version": self._version,
            "device": str(self.device),
            "tokens_per_s": tps,
            "kv_cache_bytes": self.runner.kv_bytes(),
            "kv_tokens": self.scheduler.max_total_tokens,
            "fast_path": isinstance(self.runner, ModelRunner) or self.paged,
            "runner": type(self.runner).__name__,
            **self._stats,
        }
