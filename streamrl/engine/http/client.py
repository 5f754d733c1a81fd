"""`SGLangClient`: an asyncio client for SGLang's native HTTP API (a real SGLang server, a
sglang-router, or `streamrl serve`).

Results are the server's JSON, unchanged: `generate` returns SGLang's `/generate` dict, the same shape
`TorchEngine.generate` returns (logprobs are requested by default, as the engine always returns them).
Errors (HTTP status >= 400, or an in-band stream error) raise `SGLangHTTPError` with the server's
message. Closing a `generate_stream` early drops the connection, which aborts the request server-side.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Self

import aiohttp
import msgspec


class SGLangHTTPError(Exception):
    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.body = status, message, body


def _message(body: Any, fallback: str) -> str:
    if isinstance(body, dict):
        err = body.get("error", body.get("message", body.get("detail")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if body.get("success") is False and "message" in body:
            err = body["message"]
        if err is not None:
            return str(err)
    return fallback


class JsonHttpClient:
    """One aiohttp session to one server: JSON calls, errors as `SGLangHTTPError` with the server's
    message. The SGLang and vLLM clients add their APIs on top."""

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float | None = None,
                 session: aiohttp.ClientSession | None = None, keepalive_s: float = 15.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session = session
        self._owns_session = session is None
        self._keepalive_s = keepalive_s

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None and self._owns_session and not self._session.closed:
            await self._session.close()
        self._session = None if self._owns_session else self._session

    def _s(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection limit: a rollout keeps hundreds of requests in flight on one client.
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keepalive_s),
                headers=self._headers
            )
        return self._session

    async def request(self, method: str, path: str, payload: Any = None, *, idempotent: bool = False) -> Any:
        """One call; returns the decoded JSON (or text / None for non-JSON bodies). `idempotent`: a call
        that may run twice (pause, resume) is also tried again when the server dropped the connection."""
        data = msgspec.json.encode(payload) if payload is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else None
        try:
            return await self._request(method, path, data, headers)
        except aiohttp.ServerDisconnectedError:
            # The server may have seen it: only a call that can run twice goes again.
            if not idempotent:
                raise
            return await self._request(method, path, data, headers)
        except aiohttp.ClientOSError as e:
            # A pooled connection the server closed while it sat idle fails before the request is
            # written, so the server never saw it and one retry on a fresh connection is safe.
            if not isinstance(e.__cause__, ConnectionResetError):
                raise
            return await self._request(method, path, data, headers)

    async def _request(self, method: str, path: str, data: bytes | None, headers: dict[str, str] | None) -> Any:
        async with self._s().request(method, self.base_url + path, data=data, headers=headers) as r:
            raw = await r.read()
            body: Any = None
            if raw:
                try:
                    body = msgspec.json.decode(raw)
                except msgspec.DecodeError:
                    body = raw.decode(errors="replace")
            if r.status >= 400:
                raise SGLangHTTPError(r.status, _message(body, r.reason or ""), body)
            return body

    async def post_sse(self, path: str, payload: Any) -> AsyncIterator[Any]:
        """POST JSON, then yield each decoded `data:` event of the server-sent stream until `[DONE]`.
        Closing the iterator early drops the connection, which aborts the request server-side."""
        r = await self._s().post(self.base_url + path, data=msgspec.json.encode(payload),
                                 headers={"Content-Type": "application/json"})
        try:
            if r.status >= 400:
                raw = await r.read()
                body = msgspec.json.decode(raw) if raw.startswith(b"{") else raw.decode(errors="replace")
                raise SGLangHTTPError(r.status, _message(body, r.reason or ""), body)
            buf = b""
            async for piece in r.content.iter_any():  # not line iteration: chunks can exceed its limit
                buf += piece
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data:"):
                        continue
                    data = event[5:].strip()
                    if data == b"[DONE]":
                        return
                    yield msgspec.json.decode(data)
        finally:
            r.close()

    async def health(self) -> bool:
        try:
            await self.request("GET", "/health")
        except (SGLangHTTPError, aiohttp.ClientError, OSError):
            return False
        return True


class SGLangClient(JsonHttpClient):
    """`async with SGLangClient("http://127.0.0.1:30000") as c: r = await c.generate([1, 5], {...})`.

    After `load_lora_adapter` every request names the adapter (`lora_path`), as SGLang wants it."""

    lora_name: str | None = None

    # ---- generation ------------------------------------------------------------------------------
    @staticmethod
    def _payload(input_ids: Any, sampling_params: dict[str, Any] | None, rid: Any, return_logprob: bool,
                 stream: bool, extra: dict[str, Any]) -> dict[str, Any]:
        key = "text" if isinstance(input_ids, str) or (
            isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], str)) else "input_ids"
        p: dict[str, Any] = {key: input_ids, "sampling_params": sampling_params or {},
                             "return_logprob": return_logprob, **extra}
        if rid is not None:
            p["rid"] = rid
        if stream:
            p["stream"] = True
        return p

    async def generate(self, input_ids: Any, sampling_params: dict[str, Any] | None = None, rid: Any = None, *,
                       return_logprob: bool = True, **extra: Any) -> Any:
        """POST /generate. `input_ids` may be token ids, text, or a batch of either (→ a list)."""
        if self.lora_name is not None:
            extra.setdefault("lora_path", self.lora_name)
        return await self.request(
            "POST", "/generate", self._payload(input_ids, sampling_params, rid, return_logprob, False, extra)
        )

    async def generate_stream(self, input_ids: Any, sampling_params: dict[str, Any] | None = None,
                              rid: Any = None, *, return_logprob: bool = True,
                              **extra: Any) -> AsyncIterator[dict[str, Any]]:
        """POST /generate with stream=True; yields SGLang's cumulative chunks (the last is finished)."""
        if self.lora_name is not None:
            extra.setdefault("lora_path", self.lora_name)
        payload = self._payload(input_ids, sampling_params, rid, return_logprob, True, extra)
        async for obj in self.post_sse("/generate", payload):
            if isinstance(obj, dict) and "error" in obj:
                raise SGLangHTTPError(200, _message(obj, "stream error"), obj)
            yield obj

    # ---- control ---------------------------------------------------------------------------------
    async def abort(self, rid: str) -> None:
        await self.request("POST", "/abort_request", {"rid": rid})

    async def abort_all(self) -> None:
        await self.request("POST", "/abort_request", {"abort_all": True})

    async def pause(self, mode: str = "abort") -> dict[str, Any]:
        return await self.request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> dict[str, Any]:
        return await self.request("POST", "/continue_generation", {})

    async def update_weights_from_disk(self, path: str, version: str | None = None, **extra: Any) -> dict[str, Any]:
        payload = {"model_path": path, **extra}
        if version is not None:
            payload["weight_version"] = str(version)
        return await self.request("POST", "/update_weights_from_disk", payload)

    async def update_weight_version(self, version: str, abort_all_requests: bool = True) -> dict[str, Any]:
        return await self.request(
            "POST", "/update_weight_version", {"new_version": str(version), "abort_all_requests": abort_all_requests}
        )

    async def load_lora_adapter(self, path: str, version: str | None = None) -> None:
        """SGLang's `/load_lora_adapter` under the version's name (`streamrl-vN`), the previous adapter
        unloaded, then the weight version; requests from now on name it. A new name per version:
        SGLang cannot replace an adapter in place, and its caches never mix two versions this way."""
        name, old = f"streamrl-v{version or 0}", self.lora_name
        if old == name:  # the same version again (a rejoining server): replace it where it is
            await self.request("POST", "/unload_lora_adapter", {"lora_name": name})
        await self.request("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path})
        self.lora_name = name
        if old is not None and old != name:
            try:
                await self.request("POST", "/unload_lora_adapter", {"lora_name": old})
            except SGLangHTTPError as e:
                if e.status not in (400, 404):  # already gone (a restarted server) is fine
                    raise
        if version is not None:
            await self.update_weight_version(str(version), abort_all_requests=False)

    async def release_memory(self) -> None:
        await self.request("POST", "/release_memory_occupation", {})

    async def resume_memory(self) -> None:
        await self.request("POST", "/resume_memory_occupation", {})

    async def flush_cache(self) -> bool:
        """True when flushed; False when the server refused (requests in flight)."""
        try:
            await self.request("POST", "/flush_cache")
        except SGLangHTTPError as e:
            if e.status == 400:
                return False
            raise
        return True

    async def _get_either(self, path: str) -> Any:
        try:
            return await self.request("GET", path)
        except SGLangHTTPError as e:  # older SGLang only has the /get_* names
            if e.status != 404:
                raise
            return await self.request("GET", path.replace("/", "/get_", 1))

    async def model_info(self) -> dict[str, Any]:
        return await self._get_either("/model_info")

    async def server_info(self) -> dict[str, Any]:
        return await self._get_either("/server_info")

    async def busy_seconds(self) -> dict[str, float]:
        """Seconds the server's engines have spent computing, and of those in prefill (streamrl serve's
        /server_info; a real SGLang server reports neither, so both read 0)."""
        states = (await self.server_info()).get("internal_states", [])
        return {k: sum(float(st.get(k, 0.0)) for st in states) for k in ("busy_s", "prefill_s")}

    async def loads(self) -> dict[str, Any]:
        return await self.request("GET", "/v1/loads")

    # ---- distributed weight updates (gloo) -------------------------------------------------------
    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "gloo") -> dict[str, Any]:
        return await self.request("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              weight_version: str | None = None,
                                              group_name: str = "weight_update_group") -> dict[str, Any]:
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self.request("POST", "/update_weights_from_distributed", payload)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return await self.request("POST", "/destroy_weights_update_group", {"group_name": group_name})

