"""`VLLMClient`: drives a real vLLM server (`--enable-scale-out`, `VLLM_SERVER_DEV_MODE=1`) with the
same calls and the same SGLang-shaped results as `SGLangClient`, so `HttpPool` and the rollout
manager do not know which server they talk to.

- Generation: `/inference/v1/generate`, token ids in, token ids + sampled-token logprobs out,
  streamed (one SSE chunk per step) and accumulated into SGLang's `/generate` result, including
  `weight_versions` spans. SGLang's sampling parameter names are translated; names vLLM would
  silently ignore are rejected here.
- Behaviour logprobs: streamrl's trainer scores tokens under softmax(logits / T). vLLM reports raw
  logprobs (before temperature) unless the server runs with `--logprobs-mode processed_logprobs`;
  `check_server` refuses a server in any other mode (at T != 1 the importance weights would
  be wrong by a factor that grows with the distance of T from 1).
- Control: abort by request id maps to vLLM's server-side id `generate-tokens-<rid>`; pause maps
  SGLang's modes (abort / in_place / retract) and vLLM's own (abort / keep / wait); a weight update
  from a folder is `collective_rpc reload_weights` + `update_weight_version` + `reset_prefix_cache`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from ..http.client import JsonHttpClient, SGLangHTTPError, _message
from ..protocol import EngineError, SamplingParams, build_result, extend_version_spans, finish_reason

# SGLang name -> vLLM name, for the parameters both engines implement.
_RENAMED = {"max_new_tokens": "max_tokens", "sampling_seed": "seed", "min_new_tokens": "min_tokens"}
_SAME = ("temperature", "top_p", "min_p", "stop_token_ids", "stop", "ignore_eos", "skip_special_tokens",
         "frequency_penalty", "presence_penalty", "repetition_penalty")
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep", "keep": "keep", "wait": "wait"}
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
VLLM_LORA_NAME = "streamrl-lora"  # the adapter's name on a vLLM server (every version, loaded in place)
MIN_TEMPERATURE = 0.01  # vLLM raises a sampled request's temperature to this (SamplingParams._MAX_TEMP)


def vllm_sampling_params(sampling_params: dict[str, Any] | None, return_logprob: bool) -> dict[str, Any]:
    """SGLang sampling parameters -> vLLM's; unknown names and out-of-range values raise EngineError."""
    sp = SamplingParams.from_dict(sampling_params)  # SGLang's names, types and defaults
    checks = [
        (sp.n == 1, "n > 1 is not supported: send one request per sample"),
        (sp.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {sp.max_new_tokens}"),
        (sp.temperature == 0 or sp.temperature >= MIN_TEMPERATURE,
         f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE} (vLLM raises smaller values to "
         f"{MIN_TEMPERATURE}, so its logprobs would not be at the requested temperature), got {sp.temperature}"),
        (0 < sp.top_p <= 1, f"top_p must be in (0, 1], got {sp.top_p}"),
        (sp.top_k == -1 or sp.top_k >= 1, f"top_k must be -1 or >= 1, got {sp.top_k}"),
        (0 <= sp.min_p <= 1, f"min_p must be in [0, 1], got {sp.min_p}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise EngineError(msg)
    given = set(sampling_params or {})
    out: dict[str, Any] = {"max_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
                           "top_k": sp.top_k if sp.top_k > 0 else 0}
    for name in _SAME:
        if name in given:
            out[name] = getattr(sp, name)
    for name, vname in _RENAMED.items():
        if name in given and getattr(sp, name) is not None:
            out[vname] = getattr(sp, name)
    if "no_stop_trim" in given:
        out["include_stop_str_in_output"] = sp.no_stop_trim
    if return_logprob:
        out["logprobs"] = 0  # the sampled token's logprob only
    return out


class VLLMClient(JsonHttpClient):
    """`async with VLLMClient("http://127.0.0.1:8000") as c: r = await c.generate([1, 5], {...})`."""

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float | None = None) -> None:
        # uvicorn closes an idle keep-alive connection after 5 s; reusing one it is closing fails
        # with "Can not write request body" / "Server disconnected". Drop ours first.
        super().__init__(base_url, api_key, timeout=timeout, keepalive_s=2.0)
        # vLLM has no busy-time counter: count wall time with at least one request outstanding.
        self._outstanding = 0
        self._busy_since = 0.0
        self._busy_s = 0.0
        self.in_flight: dict[str, int] = {}  # rid -> tokens received so far, while it streams
        self.lora_name: str | None = None  # the adapter requests are for (load_lora_adapter)

    # ---- generation ------------------------------------------------------------------------------
    async def generate_stream(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None,
                              rid: str | None = None, *, return_logprob: bool = True) -> AsyncIterator[dict[str, Any]]:
        """vLLM's stream chunks, unchanged (each carries the tokens of one step). Closing the
        iterator early drops the connection, which makes vLLM abort the request."""
        if not input_ids or not all(isinstance(t, int) and t >= 0 for t in input_ids):
            raise EngineError("input_ids must be a non-empty list of token ids")
        body: dict[str, Any] = {"token_ids": list(input_ids), "stream": True, "output_mode": "tokens",
                                "sampling_params": vllm_sampling_params(sampling_params, return_logprob)}
        if rid is not None:
            body["request_id"] = rid
        if self.lora_name is not None:  # the adapter is named as a model (vLLM's LoRA serving)
            body["model"] = self.lora_name
        async for obj in self.post_sse("/inference/v1/generate", body):
            if "error" in obj:  # vLLM reports a bad request in-band once streaming began
                e = obj["error"]
                raise SGLangHTTPError(int(e.get("code", 400)) if isinstance(e, dict) else 400,
                                      _message(obj, "stream error"), obj)
            yield obj

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None,
                       rid: str | None = None, *, return_logprob: bool = True) -> dict[str, Any]:
        """One request, streamed and accumulated into SGLang's `/generate` result."""
        t0 = time.monotonic()
        rid = rid or f"streamrl-{time.monotonic_ns()}"
        ids: list[int] = []
        lps: list[float] = []
        spans: list[dict[str, Any]] | None = None
        finish, matched = None, None
        self._enter()
        self.in_flight[rid] = 0
        try:
            async for chunk in self._stream_once_retried(input_ids, sampling_params, rid, return_logprob):
                choice = chunk["choices"][0]
                ids += choice.get("token_ids") or []
                self.in_flight[rid] = len(ids)
                content = (choice.get("logprobs") or {}).get("content") or []
                lps += [float(c["logprob"]) for c in content]
                if choice.get("finish_reason") is not None:
                    finish, matched = choice["finish_reason"], choice.get("stop_reason")
                    spans = choice.get("weight_versions")
        finally:
            self._leave()
            self.in_flight.pop(rid, None)
        if finish is None:  # without the final chunk the tokens' weight versions are unknown
            raise SGLangHTTPError(502, f"vLLM's stream for {rid} ended without a final chunk")
        if return_logprob and len(lps) != len(ids):
            raise SGLangHTTPError(502, f"vLLM returned {len(ids)} tokens but {len(lps)} logprobs")
        if not return_logprob:
            lps = [0.0] * len(ids)
        if not spans:  # a server too old to label versions
            spans = []
            if ids:
                extend_version_spans(spans, "default", len(ids), len(ids))
        kind = _FINISH.get(finish, "stop")  # vLLM's other reasons (e.g. repetition) end the sample
        extra = {"matched": matched} if matched is not None else {}
        version = str(spans[-1]["version"]) if spans else "default"
        return build_result(
            rid=rid, text="", output_ids=ids, logprobs=lps, finish=finish_reason(kind, **extra),  # type: ignore[arg-type]
            prompt_tokens=len(input_ids), weight_version=version,
            weight_versions=[{"version": str(s["version"]), "start": s["start"], "end": s["end"]} for s in spans],
            e2e_latency=time.monotonic() - t0,
        )

    async def _stream_once_retried(self, input_ids: list[int], sampling_params: dict[str, Any] | None, rid: str,
                                   return_logprob: bool) -> AsyncIterator[dict[str, Any]]:
        """`generate_stream`, sent again once when the connection fails before the first chunk (a
        pooled connection the server was closing: the request never reached vLLM)."""
        for attempt in (0, 1):
            started = False
            try:
                async for chunk in self.generate_stream(input_ids, sampling_params, rid, return_logprob=return_logprob):
                    started = True
                    yield chunk
                return
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                if started or attempt:
                    raise

    def _enter(self) -> None:
        if self._outstanding == 0:
            self._busy_since = time.monotonic()
        self._outstanding += 1

    def _leave(self) -> None:
        self._outstanding -= 1
        if self._outstanding == 0:
            self._busy_s += time.monotonic() - self._busy_since

    async def busy_seconds(self) -> dict[str, float]:
        """Wall seconds with at least one request outstanding (vLLM exposes no busy counter, nor a
        prefill one: prefill_s reads 0)."""
        now = self._busy_s + (time.monotonic() - self._busy_since if self._outstanding else 0.0)
        return {"busy_s": now, "prefill_s": 0.0}

    # ---- control ---------------------------------------------------------------------------------
    async def abort(self, rid: str) -> None:
        # vLLM prefixes the caller's id; with the bare id it answers 200 and aborts nothing.
        await self.request("POST", "/inference/v1/abort_requests", {"request_ids": [f"generate-tokens-{rid}"]})

    async def abort_all(self) -> None:
        await self.request("POST", "/abort_requests", {})

    async def pause(self, mode: str = "abort") -> dict[str, Any]:
        """abort: in-flight requests end now with their partial tokens; keep (SGLang's in_place):
        they freeze and continue after resume; wait: returns once they finished. Requests sent while
        paused wait for resume."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
        return await self.request("POST", f"/pause?mode={PAUSE_MODES[mode]}", idempotent=True)

    async def resume(self) -> dict[str, Any]:
        return await self.request("POST", "/resume", idempotent=True)

    async def is_paused(self) -> bool:
        return bool((await self.request("GET", "/is_paused"))["is_paused"])

    async def update_weights_from_disk(self, path: str, version: str | None = None) -> None:
        """Reload every weight from a safetensors folder, then label later tokens with `version`.
        Call while paused: vLLM swaps weights under running requests otherwise."""
        await self.request("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
        if version is not None:
            await self.update_weight_version(str(version))
        await self.request("POST", "/reset_prefix_cache")  # cached KV was computed by the old weights

    async def load_lora_adapter(self, path: str, version: str | None = None) -> None:
        """vLLM's `/v1/load_lora_adapter` (a server started with --enable-lora and
        VLLM_ALLOW_RUNTIME_LORA_UPDATING), always under one name and replaced in place, then the prefix
        cache reset and the weight version set; requests from now on name it as their model. Call while
        paused: vLLM swaps an adapter under running requests otherwise.

        One name, not one per version: vLLM keeps unloaded adapters in its engine, and with more of them
        than --max-loras its logprobs go wrong (seen on CPU)."""
        try:
            await self.request("POST", "/v1/load_lora_adapter", {"lora_name": VLLM_LORA_NAME, "lora_path": path,
                                                                 "load_inplace": True})
        except SGLangHTTPError as e:
            if e.status != 404 or e.message != "Not Found":  # the route itself is missing, not the folder
                raise
            raise EngineError(f"vLLM server {self.base_url} has no /v1/load_lora_adapter: start it with --enable-lora "
                              "--max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True for trainer.lora") from None
        self.lora_name = VLLM_LORA_NAME
        await self.request("POST", "/reset_prefix_cache")  # cached KV was computed by the old adapter
        if version is not None:
            await self.update_weight_version(str(version))

    async def update_weight_version(self, version: str) -> None:
        await self.request("POST", "/update_weight_version", {"new_version": str(version)})

    async def server_config(self) -> dict[str, Any]:
        return (await self.request("GET", "/server_info?config_format=json"))["vllm_config"]

    async def check_server(self) -> None:
        """Refuse a server streamrl cannot drive correctly, with a message that says how to start it:
        dev mode (pause, reload, versions), the token API, and logprobs at the sampling temperature."""
        from ...procs import EngineStartError

        where = f"vLLM server {self.base_url}"
        try:
            config = await self.server_config()
        except SGLangHTTPError as e:
            if e.status == 404:
                raise EngineStartError(f"{where} has no /server_info: start it with VLLM_SERVER_DEV_MODE=1 "
                                       "(streamrl needs /pause, /collective_rpc and weight versions)") from None
            raise
        try:
            await self.request("POST", "/inference/v1/abort_requests", {"request_ids": []})
        except SGLangHTTPError as e:
            if e.status == 404:
                raise EngineStartError(f"{where} has no token API: start it with --enable-scale-out") from None
            raise
        mode = config.get("model_config", {}).get("logprobs_mode")
        if mode != "processed_logprobs":
            raise EngineStartError(
                f"{where} reports logprobs_mode={mode!r}; streamrl needs the sampling distribution's "
                "logprobs: start it with --logprobs-mode processed_logprobs"
            )
