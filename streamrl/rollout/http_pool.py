"""HttpPool: engines behind an HTTP API, in their own processes.

Either streamrl launches servers itself (`engines.pool: http` without `urls`: one `streamrl serve`, or
with `engines.backend: vllm` one real vLLM server, per replica on a free 127.0.0.1 port) or it connects
to servers the user runs (`urls`: real SGLang servers, `streamrl serve`, or vLLM servers). vLLM
servers are driven through `VLLMClient`, which gives SGLang-shaped results (engine/vllm/).

Generation goes to the least-loaded server with logprobs; control calls (pause, resume, abort_all,
weight updates) go to every server. Weights travel through a safetensors folder (in /dev/shm when
available): SGLang's `/update_weights_from_disk`, or vLLM's `collective_rpc reload_weights`. The folder
holds every name of the trainer's state dict, tied `lm_head.weight` included: vLLM on CPU keeps a tied
head as its own tensor and reloads it only when the file names it.

Training never shares a process with generation here: no GIL or thread-pool contention between the
trainer and the engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..engine.http.client import SGLangClient
from ..procs import EngineStartError, free_port, terminate_group
from .pools import PoolBase

_LISTEN = re.compile(r"listening on (http://\S+)")


class ServerProcess:
    """One `streamrl serve` child process on a free port."""

    def __init__(self, model_dir: str, *, device: str, dtype: str, max_running_requests: int,
                 threads: int, weight_version: str, log_path: Path, cpu_kernel: bool = True) -> None:
        self.threads = threads
        self.cmd = [
            sys.executable, "-m", "streamrl.engine.http.server", "--model", model_dir, "--port", "0",
            "--device", device, "--dtype", dtype, "--max-running-requests", str(max_running_requests),
            "--num-threads", str(threads), "--weight-version", weight_version,
            *([] if cpu_kernel else ["--no-cpu-kernel"]),
        ]
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

    async def stop(self) -> None:
        await terminate_group(self.proc, 15)


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


class HttpPool(PoolBase):
    """Generation to the router (if any) or the least-loaded worker; control calls to every worker.

    The router re-encodes requests and drops unknown fields, and retries a non-streaming request on
    another worker when one dies: so request ids stay unique per attempt and nothing rides in custom
    fields; a retried request simply produces a fresh, complete result.
    """

    def __init__(self, urls: list[str] | None = None, *, launch: list[Any] | None = None,
                 router: str | None = None, router_log: Path | None = None, api_key: str | None = None,
                 weight_sync: str = "disk", backend: str = "sglang") -> None:
        if weight_sync not in ("disk", "distributed"):
            raise ValueError(f"weight_sync must be disk or distributed, got {weight_sync!r}")
        if backend not in ("sglang", "vllm"):
            raise ValueError(f"backend must be sglang or vllm, got {backend!r}")
        if backend == "vllm" and (router or weight_sync != "disk"):
            raise ValueError("vllm servers take weights from disk and are routed in-process (no router)")
        self.backend = backend
        self.weight_sync = weight_sync
        self._sender: Any = None
        self.urls = list(urls or [])
        self.servers = launch or []
        self.router_url = router if router and router != "launch" else None
        self.router_proc = RouterProcess(router_log or Path(tempfile.mktemp())) if router == "launch" else None
        self.router_client: SGLangClient | None = None
        self.api_key = api_key
        self.num_replicas = len(self.urls) + len(self.servers)
        self.clients: list[Any] = []  # SGLangClient or VLLMClient: the same calls, the same results
        self._inflight: list[int] = []
        super().__init__()
        self._weights_dir = Path(tempfile.mkdtemp(prefix="streamrl-weights-", dir=_fast_tmp()))
        self._busy = {"busy_s": 0.0, "prefill_s": 0.0}
        self._staged: tuple[int, Path] | None = None  # (version, folder) written by stage_weights

    async def start(self) -> None:
        if self.servers:
            self.urls += await asyncio.gather(*[s.start() for s in self.servers])
        client = SGLangClient
        if self.backend == "vllm":
            from ..engine.vllm import VLLMClient as client  # type: ignore[assignment]
        self.clients = [client(u, self.api_key, timeout=None) for u in self.urls]
        self._inflight = [0] * len(self.clients)
        for c, u in zip(self.clients, self.urls, strict=True):
            if not await c.health():
                raise EngineStartError(f"engine server {u} is not healthy (or not listening)")
            if self.backend == "vllm":
                await c.check_server()
                await c.update_weight_version("0")  # vLLM starts at "default"; streamrl counts from 0
        if self.weight_sync == "distributed":
            await self._connect_gloo()
        if self.router_proc is not None:
            self.router_url = await self.router_proc.start(self.urls)
        if self.router_url:
            self.router_client = SGLangClient(self.router_url, self.api_key, timeout=None)

    async def aclose(self) -> None:
        if self._sender is not None:
            self._sender.close()
        if self.router_client is not None:
            await self.router_client.aclose()
        if self.router_proc is not None:
            await self.router_proc.stop()
        for c in self.clients:
            await c.aclose()
        await asyncio.gather(*[s.stop() for s in self.servers])
        shutil.rmtree(self._weights_dir, ignore_errors=True)

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]:
        if self.router_client is not None:
            return await self.router_client.generate(input_ids, sampling_params, rid, return_logprob=True)
        i = min(range(len(self.clients)), key=self._inflight.__getitem__)
        self._inflight[i] += 1
        try:
            return await self.clients[i].generate(input_ids, sampling_params, rid, return_logprob=True)
        finally:
            self._inflight[i] -= 1

    async def generate_many(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]],
                            rids: list[str]) -> list[dict[str, Any]]:
        """A group as one POST /generate in SGLang's batch form (lists of input_ids, sampling_params and
        rids; the answer is a list in order) to the least-loaded worker: one request to parse, route and
        answer instead of one per sample, which cuts the server's and the driver's CPU per sample (the
        engine is the busiest process of an async CPU run). Through a router (whose batch handling is not
        verified here) or to vLLM: one request per sample."""
        if self.router_client is not None or self.backend == "vllm" or len(input_ids) < 2:
            return await super().generate_many(input_ids, sampling_params, rids)
        i = min(range(len(self.clients)), key=self._inflight.__getitem__)
        self._inflight[i] += len(input_ids)
        try:
            out = await self.clients[i].generate(input_ids, sampling_params, rids, return_logprob=True)
        finally:
            self._inflight[i] -= len(input_ids)
        if not isinstance(out, list) or len(out) != len(input_ids):
            raise RuntimeError(f"{self.urls[i]}: a batch of {len(input_ids)} requests got {type(out).__name__} back")
        return out

    async def abort_all(self) -> None:
        await asyncio.gather(*[c.abort_all() for c in self.clients])

    async def _pause_all(self, mode: str) -> None:
        await asyncio.gather(*[c.pause(mode) for c in self.clients])

    async def _resume_all(self) -> None:
        await asyncio.gather(*[c.resume() for c in self.clients])

    async def _connect_gloo(self) -> None:
        """One gloo group: the trainer is rank 0, server i joins as rank i + 1 (SGLang's protocol)."""
        from ..engine.http.client import GlooWeightSender

        self._sender = s = GlooWeightSender("127.0.0.1", 0, world_size=len(self.clients) + 1)
        await asyncio.gather(asyncio.to_thread(s.connect), *[
            c.init_weights_update_group(s.master_address, s.master_port, i + 1, s.world_size, s.group_name)
            for i, c in enumerate(self.clients)
        ])

    async def _send_gloo(self, named_tensors: Any, version: int) -> None:
        s = self._sender
        tensors = [(n, t.detach().contiguous().cpu()) for n, t in dict(named_tensors).items()]
        names = [n for n, _ in tensors]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        # Every server must be receiving while rank 0 broadcasts: run both sides together.
        await asyncio.gather(asyncio.to_thread(s.broadcast, tensors), *[
            c.update_weights_from_distributed(names, dtypes, shapes, str(version), s.group_name) for c in self.clients
        ])

    async def stage_weights(self, named_tensors: Any, version: int) -> None:
        """Disk sync: write the version's folder now, while the engines still generate, so that the
        pause that follows only covers their loading it (~4 ms less per step on the CPU benchmark)."""
        if self.weight_sync == "disk":
            self._staged = (version, await self._write_folder(named_tensors, version))

    async def update_weights(self, named_tensors: Any, version: int) -> None:
        if self.weight_sync == "distributed":
            await self._send_gloo(named_tensors, version)
            return
        staged, self._staged = self._staged, None
        folder = staged[1] if staged and staged[0] == version else await self._write_folder(named_tensors, version)
        try:
            await asyncio.gather(*[c.update_weights_from_disk(str(folder), str(version)) for c in self.clients])
        finally:
            with contextlib.suppress(OSError):
                for old in self._weights_dir.iterdir():
                    if old != folder:
                        shutil.rmtree(old, ignore_errors=True)

    async def _write_folder(self, named_tensors: Any, version: int) -> Path:
        from safetensors.torch import save_file

        folder = self._weights_dir / f"v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in dict(named_tensors).items()}
        # Tied weights share storage; safetensors refuses shared tensors, and the engine copies both names.
        seen: dict[int, str] = {}
        for k in list(tensors):
            ptr = tensors[k].data_ptr()
            if ptr in seen:
                tensors[k] = tensors[k].clone()
            seen[ptr] = k
        await asyncio.to_thread(save_file, tensors, str(folder / "model.safetensors"))
        return folder

    def stats(self) -> dict[str, Any]:
        return {"running": sum(self._inflight), **self._busy, "replicas": self.urls}

    async def refresh_stats(self) -> None:
        """Engine busy time summed over servers, for the idle-fraction metric (a server that cannot
        tell counts as 0)."""
        busy = await asyncio.gather(*[c.busy_seconds() for c in self.clients], return_exceptions=True)
        ok = [b for b in busy if isinstance(b, dict)]
        self._busy = {k: sum(b[k] for b in ok) for k in ("busy_s", "prefill_s")}


def _fast_tmp() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def launch_servers(n: int, model_dir: str, run_dir: Path, **kw: Any) -> list[ServerProcess]:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    return [ServerProcess(model_dir, log_path=run_dir / "logs" / f"engine-{i}.log", **kw) for i in range(n)]
