"""HttpPool: engines behind an HTTP API, in their own processes.

Either streamrl launches servers itself (`engines.pool: http` without `urls`: one `streamrl serve`, or
with `engines.backend: vllm` one real vLLM server, per replica on a free 127.0.0.1 port) or it connects
to servers the user runs (`urls`: real SGLang servers, `streamrl serve`, or vLLM servers). vLLM
servers are driven through `VLLMClient`, which gives SGLang-shaped results (engine/vllm/).

Generation goes to the least-loaded server with logprobs; control calls (pause, resume, abort_all)
and weight pushes go to every server. Weights travel as a safetensors folder (`weights.DiskSync`:
SGLang's `/update_weights_from_disk`, or vLLM's `collective_rpc reload_weights`) or by gloo broadcast
(`weights.BroadcastSync`).

Training never shares a process with generation here: no GIL or thread-pool contention between the
trainer and the engines.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..config import ConfigError, EnginesConfig
from ..engine.args import EngineArgs
from ..engine.http.client import SGLangClient
from ..engine.protocol import build_result, finish_reason
from ..procs import EngineStartError, free_port, terminate_group
from ..weights import BroadcastSync, DiskSync, is_adapter
from .pools import EnginePool
from .replicas import ReplicaLost, Replicas

_LISTEN = re.compile(r"listening on (http://\S+)")


class ServerProcess:
    """One `streamrl serve` child process on a free port, running with `args` (its flags are generated
    from them: every engine setting reaches it)."""

    def __init__(self, model_dir: str, args: EngineArgs, *, log_path: Path) -> None:
        self.args = args
        self.threads = args.num_threads or 1
        self.cmd = [sys.executable, "-m", "streamrl.engine.http.server", "--model", model_dir, "--port", "0",
                    *args.flags()]
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.url: str | None = None

    async def start(self, timeout: float = 120.0) -> str:
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "TOKENIZERS_PARALLELISM": "false"}
        self.proc = await asyncio.create_subprocess_exec(
            *self.cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
            start_new_session=True,  # its own process group, so stop() reaches everything it starts
        )
        log = self.log_path.open("a")
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = await asyncio.wait_for(self.proc.stdout.readline(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                await self.stop()
                raise RuntimeError(f"engine server did not start within {timeout:.0f} s; see {self.log_path}") from None
            if not line:
                code = await self.proc.wait()
                raise RuntimeError(f"engine server exited with status {code} before listening; see {self.log_path}")
            text = line.decode(errors="replace")
            log.write(text)
            log.flush()
            m = _LISTEN.search(text)
            if m:
                self.url = m.group(1)
                break
        # Keep draining output so the child never blocks on a full pipe.
        self._drain = asyncio.create_task(self._pump(log))
        return self.url

    async def _pump(self, log: Any) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with log:
            async for line in self.proc.stdout:
                log.write(line.decode(errors="replace"))
                log.flush()

    async def stop(self, grace: float = 15.0) -> None:
        drain = getattr(self, "_drain", None)
        await terminate_group(self.proc, grace)
        if drain is not None:
            await asyncio.gather(drain, return_exceptions=True)  # the log is closed with the pipe


class RouterProcess:
    """The real sglang-router (PyPI `sglang-router`) in front of the workers, round robin.

    Its hub tokenizer fetch is pointed at a dead local address (no network here), and its Prometheus
    endpoint is bound to 127.0.0.1 on a free port instead of 0.0.0.0:29000.
    """

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.url: str | None = None

    async def start(self, worker_urls: list[str], timeout: float = 60.0) -> str:
        port, prom = free_port(), free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
               "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
               "--log-level", "warn"]  # info logs every request and health probe (~300 KB/s)
        env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
        log = self.log_path.open("ab")
        self.proc = await asyncio.create_subprocess_exec(*cmd, stdout=log, stderr=log, env=env,
                                                         start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        async with SGLangClient(self.url) as c:
            while True:  # up, and every worker registered (the router probes them first)
                try:
                    workers = (await c.request("GET", "/workers")).get("workers", [])
                    if len(workers) >= len(worker_urls) and all(w.get("is_healthy", True) for w in workers):
                        return self.url
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
                if self.proc.returncode is not None or time.monotonic() > deadline:
                    await self.stop()
                    raise RuntimeError(f"sglang-router did not come up; see {self.log_path}")
                await asyncio.sleep(0.2)

    async def stop(self) -> None:
        await terminate_group(self.proc, 10)


class HttpPool(EnginePool):
    """Generation to the router (if any) or the least-loaded server that is up; control calls to every
    server that is up. Servers that die or stop answering are routed around, relaunched or waited for
    (`replicas.Replicas`, docs/http.md "Failover").

    The router re-encodes requests and drops unknown fields, and retries a non-streaming request on
    another worker when one dies: so request ids stay unique per attempt and nothing rides in custom
    fields; a retried request simply produces a fresh, complete result.
    """

    def __init__(self, urls: list[str] | None = None, *, launch: list[Any] | None = None,
                 router: str | None = None, router_log: Path | None = None, api_key: str | None = None,
                 weight_sync: str = "disk", backend: str = "sglang", engines: EnginesConfig | None = None) -> None:
        if weight_sync not in ("disk", "distributed"):
            raise ValueError(f"weight_sync must be disk or distributed, got {weight_sync!r}")
        if backend not in ("sglang", "vllm"):
            raise ValueError(f"backend must be sglang or vllm, got {backend!r}")
        if backend == "vllm" and (router or weight_sync != "disk"):
            raise ValueError("vllm servers take weights from disk and are routed in-process (no router)")
        super().__init__()
        self.backend = backend
        self.given = list(urls or [])
        self.servers = launch or []
        self.router_url = router if router and router != "launch" else None
        self.router_proc = RouterProcess(router_log or Path(tempfile.mktemp())) if router == "launch" else None
        self.router_client: SGLangClient | None = None
        self.api_key = api_key
        self.num_replicas = len(self.given) + len(self.servers)
        self.engines = engines or EnginesConfig()  # its failover settings: health checks, restarts
        self.clients: list[Any] = []  # BroadcastSync's: every server, in rank order
        self.weight_sync: DiskSync | BroadcastSync = (
            BroadcastSync(self.clients) if weight_sync == "distributed" else DiskSync(self.clients, each=self._each))
        self.replicas: Replicas | None = None
        self._busy = {"busy_s": 0.0, "prefill_s": 0.0}
        # LoRA: every request names the servers' adapter, which a push replaces; requests wait here
        # while the pool is paused for one, so none is sent naming (and bound to) the adapter going away.
        self._adapters = False
        self._open = asyncio.Event()
        self._open.set()
        self._sending = 0  # generate calls between send and answer

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas.all] if self.replicas else list(self.given)

    def _client(self, url: str) -> Any:
        if self.backend == "vllm":
            from ..engine.vllm import VLLMClient

            return VLLMClient(url, self.api_key, timeout=None)
        return SGLangClient(url, self.api_key, timeout=None)

    async def start(self) -> None:
        sync = self.weight_sync
        self.replicas = reps = Replicas(
            self.engines, self._client, paused=lambda: self.is_paused, enabled=self.router_url is None
            and self.router_proc is None, breaks_on_loss=isinstance(sync, BroadcastSync),
            current=lambda: (sync.current[0], str(sync.current[1])) if isinstance(sync, DiskSync) and sync.current
            else None)
        launched = await asyncio.gather(*[s.start() for s in self.servers])
        for u in self.given:
            reps.add(u)
        for u, server in zip(launched, self.servers, strict=True):
            reps.add(u, server)
        self.clients += [r.client for r in reps.all]
        for r in reps.all:
            if not await r.client.health():
                raise EngineStartError(f"engine server {r.url} is not healthy (or not listening)")
            if self.backend == "vllm":
                await r.client.check_server()
                await r.client.update_weight_version("0")  # vLLM starts at "default"; streamrl counts from 0
        if isinstance(sync, BroadcastSync):
            await sync.connect()
        if self.router_proc is not None:
            self.router_url = await self.router_proc.start(self.urls)
        if self.router_url:
            self.router_client = SGLangClient(self.router_url, self.api_key, timeout=None)
        reps.start_monitor()

    async def aclose(self) -> None:
        await self.weight_sync.aclose()
        if self.router_client is not None:
            await self.router_client.aclose()
        if self.router_proc is not None:
            await self.router_proc.stop()
        if self.replicas is not None:
            await self.replicas.aclose()
        await asyncio.gather(*[s.stop() for s in self.servers])

    async def _each(self, fn: Callable[[Any], Awaitable[Any]]) -> list[Any]:
        assert self.replicas is not None
        return await self.replicas.each(fn)

    async def push_weights(self, named_tensors: Any, version: int, pause: str | None = "abort") -> float:
        self._adapters = self._adapters or is_adapter(named_tensors)
        return await super().push_weights(named_tensors, version, pause)

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]:
        await self._open.wait()
        if self.router_client is not None:
            self._sending += 1
            try:
                return await self.router_client.generate(input_ids, sampling_params, rid, return_logprob=True)
            finally:
                self._sending -= 1
        return (await self._send([input_ids], [sampling_params], rid, batched=False))[0]

    async def generate_many(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]],
                            rids: list[str]) -> list[dict[str, Any]]:
        """A group as one POST /generate in SGLang's batch form (lists of input_ids, sampling_params and
        rids; the answer is a list in order) to the least-loaded server: one request to parse, route
        and answer instead of one per sample, which cuts the server's and the driver's CPU per sample
        (the engine is the busiest process of an async CPU run). Through a router (whose batch handling
        is not verified here) or to vLLM: one request per sample."""
        if self.router_client is not None or self.backend == "vllm" or len(input_ids) < 2:
            return await super().generate_many(input_ids, sampling_params, rids)
        await self._open.wait()
        return await self._send(input_ids, sampling_params, rids, batched=True)

    async def _send(self, input_ids: list[list[int]], params: list[dict[str, Any]], rids: Any,
                    batched: bool) -> list[dict[str, Any]]:
        """Requests to one up server. If it is lost meanwhile, they come back aborted with no new
        tokens (it never sent them), and the rollout manager resubmits them to the servers up."""
        reps = self.replicas
        assert reps is not None
        n = len(input_ids)
        rep = await reps.pick(n)
        self._sending += n
        try:
            out = await reps.on(rep, rep.client.generate(input_ids if batched else input_ids[0],
                                                         params if batched else params[0], rids,
                                                         return_logprob=True))
        except ReplicaLost:
            reps.counters["lost_requests"] += n
            return [_lost_result(r, len(i)) for r, i in zip(rids if batched else [rids], input_ids, strict=True)]
        finally:
            reps.done(rep, n)
            self._sending -= n
        if not batched:
            return [out]
        if not isinstance(out, list) or len(out) != n:
            raise RuntimeError(f"{rep.url}: a batch of {n} requests got {type(out).__name__} back")
        return out

    async def abort_all(self) -> None:
        await self._each(lambda c: c.abort_all())

    async def _pause_all(self, mode: str) -> None:
        if self._adapters:
            self._open.clear()
        await self._each(lambda c: c.pause(mode))
        if self._adapters and mode == "abort":
            # A request already on its way when the servers paused arrives after the pause and would wait
            # for the resume bound to the adapter going away: abort until every one has come back.
            deadline = time.monotonic() + self.engines.control_timeout_s
            while self._sending and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
                await self._each(lambda c: c.abort_all())

    async def _resume_all(self) -> None:
        if self.router_client is not None:  # requests through the router name the servers' adapter (LoRA)
            self.router_client.lora_name = next((c.lora_name for c in self.clients if c.lora_name), None)
        try:
            await self._each(lambda c: c.resume())
        finally:
            self._open.set()

    def stats(self) -> dict[str, Any]:
        reps = self.replicas
        if reps is None:
            return {"running": 0, **self._busy, "replicas": self.urls}
        return {"running": sum(reps.route.inflight), **self._busy, "replicas": [r.url for r in reps.up],
                **reps.counters}

    async def refresh_stats(self) -> None:
        """Engine busy time summed over servers, for the idle-fraction metric (a server that cannot
        tell counts as 0)."""
        async def busy(c: Any) -> Any:
            try:
                return await c.busy_seconds()
            except Exception:  # noqa: BLE001 - a server that cannot tell counts as 0
                return None

        ok = [b for b in await self._each(busy) if isinstance(b, dict)]
        self._busy = {k: sum(b[k] for b in ok) for k in ("busy_s", "prefill_s")}


def _lost_result(rid: str, prompt_tokens: int) -> dict[str, Any]:
    return build_result(rid=rid, text="", output_ids=[], logprobs=[], prompt_tokens=prompt_tokens, weight_version="",
                        finish=finish_reason("abort", message="engine server lost", status_code=503,
                                             err_type="ServerLost"))


def launch_servers(n: int, model_dir: str, run_dir: Path, args: EngineArgs) -> list[ServerProcess]:
    """`n` `streamrl serve` servers of `model_dir`, replica i with `args.replica(i)`."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    return [ServerProcess(model_dir, args.replica(i), log_path=run_dir / "logs" / f"engine-{i}.log") for i in range(n)]


def require_vllm_python(cfg: EnginesConfig) -> str:
    """The Python that launches vLLM servers; a ConfigError naming the fix when there is none."""
    from ..engine.vllm import find_vllm_python

    python = find_vllm_python(cfg.vllm_python)
    if python is None:
        where = f"'{cfg.vllm_python}' does not exist" if cfg.vllm_python else "no Python with vLLM was found"
        raise ConfigError("engines.vllm_python", f"{where}; run `bash scripts/setup_vllm.sh` (builds .venv-vllm) "
                                                 "or point engines.vllm_python at a Python that has vllm")
    return python


def vllm_cache_dir() -> str:
    """vLLM's torch.compile cache, shared by every run of this user (a warm one halves a server's start)."""
    return str(Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "streamrl" / "vllm")


def build_http_pool(cfg: EnginesConfig, model_dir: str, args: EngineArgs, *, run_dir: Path, lora_rank: int = 0) -> HttpPool:
    """Servers given as `urls`, or launched here: `streamrl serve` with `args` (or real vLLM) per replica."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if cfg.backend == "vllm":  # validate() guarantees no router and disk weight sync
        from ..engine.vllm import VLLMServer

        python = require_vllm_python(cfg)
        launched = None if cfg.urls else [
            VLLMServer(python, model_dir, log_path=logs / f"vllm-{i}.log", dtype=args.dtype,
                       max_num_seqs=args.max_running_requests, kv_cache_gib=cfg.vllm_kv_cache_gib,
                       seed=args.replica(i).seed, cache_dir=vllm_cache_dir(), start_timeout=cfg.start_timeout_s,
                       lora_rank=lora_rank)
            for i in range(cfg.num_replicas)
        ]
        return HttpPool(cfg.urls, launch=launched, backend="vllm", engines=cfg)
    routing = dict(router=cfg.router, router_log=logs / "router.log", weight_sync=cfg.weight_sync,
                   engines=cfg)
    if cfg.urls:
        return HttpPool(cfg.urls, **routing)  # type: ignore[arg-type]
    return HttpPool(launch=launch_servers(cfg.num_replicas, model_dir, run_dir, args), **routing)  # type: ignore[arg-type]
