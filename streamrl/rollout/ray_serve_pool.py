"""RayServePool: engine replicas as one Ray Serve application.

    generate  -> DeploymentHandle (stream=True) -> one replica, chosen by Serve's router; the
                 request stays on that replica for its whole life, so an abort broadcast by rid
                 reaches the engine that holds it
    control   -> handle.broadcast(...) -> every running replica (pause, resume, abort_all,
                 weights, memory, stats)
    weights   -> ray.put once -> WeightStore -> each replica pulls the same object

A replica that dies mid-request: its stream raises; the pool returns what the replica had streamed
so far as an aborted result, and the rollout manager resumes the sample from there on another
replica (partial resume), exactly as after a weight update. Serve starts a replacement, which loads
the current weights before serving (see `serve_replica`).

Ray is started here unless the process is already connected (tests share one session per module,
a cluster user sets `engines.ray_address`); the pool shuts down only what it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from ..config import EnginesConfig
from ..engine.args import EngineArgs
from ..engine.protocol import EngineError, build_result, extend_version_spans, finish_reason
from ..weights import ObjectStoreSync
from .pools import EnginePool

log = logging.getLogger(__name__)

# Unix socket paths (Ray puts its sockets under the temp dir) are limited to 107 bytes; Ray adds
# about 60 characters of session and socket names below the folder it is given.
_MAX_TEMP_DIR = 45


class _Pending:
    """One request's future and the tokens streamed for it so far."""

    def __init__(self, rid: str, prompt_tokens: int, future: asyncio.Future[dict[str, Any]]) -> None:
        self.rid, self.prompt_tokens, self.future = rid, prompt_tokens, future
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.spans: list[dict[str, Any]] = []

    def set(self, result: dict[str, Any]) -> None:
        if not self.future.done():
            self.future.set_result(result)

    def fail(self, e: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(e)


class RayStartError(RuntimeError):
    """Ray or Serve could not start; the message says what to check."""


def start_ray(run_dir: Path, *, num_cpus: float, address: str | None = None) -> bool:
    """Connect to Ray, starting a local session if none is running. Returns True if it started one."""
    import ray

    if ray.is_initialized():
        return False
    kw: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                              configure_logging=True)
    if address:
        _check_reachable(address)
        kw["address"] = address
    else:
        try:
            kw["_temp_dir"] = _ray_temp_dir(run_dir)
            _local_auth_token(Path(kw["_temp_dir"]))
        except OSError as e:
            raise RayStartError(f"Ray's temp folder {run_dir / 'ray'}: {e.strerror or e}") from None
        kw["num_cpus"] = max(os.cpu_count() or 1, math.ceil(num_cpus))
    # Ray's driver replaces the SIGTERM handler (Python's and, through its core worker, the C-level
    # one, which dumps a stack and kills the process without any cleanup). Whoever registered
    # SIGINT/SIGTERM handlers before (the CLI: cancel the run, stop the replicas) gets them back.
    saved = _signal_handlers()
    try:
        ray.init(**kw)
    except Exception as e:  # noqa: BLE001 - every failure here means the same thing to the user
        where = f"the Ray cluster at {address}" if address else "a local Ray session"
        raise RayStartError(f"could not start {where}: {type(e).__name__}: {e}") from e
    finally:
        _restore_signal_handlers(saved)
    return True


def _signal_handlers() -> dict[int, Any]:
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore_signal_handlers(saved: dict[int, Any]) -> None:
    import signal

    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)  # re-installs the C-level handler too


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """A `host:port` that nothing listens on fails here in seconds; ray.init would retry for minutes."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto", "ray://...": Ray's own resolution
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise RayStartError(f"engines.ray_address: no Ray cluster answers at {address} ({e.strerror or e})") from None


def _local_auth_token(temp_dir: Path) -> None:
    """Token auth (Ray's default) with a token private to this run, instead of one Ray would write to
    ~/.ray; a mode or token the user configured wins."""
    if any(k in os.environ for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        return
    import secrets

    path = temp_dir / "auth_token"
    if not path.is_file():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    # Ray caches its config at import; this is what ray.init itself calls after changing the mode.
    from ray._raylet import Config

    Config.initialize("")


def _ray_temp_dir(run_dir: Path) -> str:
    """`run_dir/ray`, or a short folder in /tmp linked from there when the run path is too long."""
    target = (run_dir / "ray").absolute()
    if len(str(target)) <= _MAX_TEMP_DIR:
        target.mkdir(parents=True, exist_ok=True)
        return str(target)
    if target.is_symlink() and Path(os.readlink(target)).is_dir():
        return os.readlink(target)
    short = tempfile.mkdtemp(prefix="streamrl-ray-", dir="/tmp")
    run_dir.mkdir(parents=True, exist_ok=True)
    if target.is_symlink():
        target.unlink()
    target.symlink_to(short)
    return short


def _is_lost_replica(e: BaseException) -> bool:
    """Errors that mean "the replica went away", as opposed to a bad request or an engine bug."""
    from ray import exceptions as rex

    return isinstance(e, rex.RayActorError | rex.ActorUnavailableError)


def _unwrap(e: BaseException) -> BaseException:
    """The replica's own exception (e.g. EngineError for a bad request) rather than Ray's wrapper."""
    from ray.exceptions import RayTaskError

    if isinstance(e, RayTaskError) and isinstance(e.cause, Exception):
        return e.cause
    return e


class RayServePool(EnginePool):
    """EnginePool over Ray Serve replicas of `EngineReplica`, from `engines.*` (num_replicas, engine,
    cpus_per_replica, gpus_per_replica, threads, stream_interval, ray_address); `args` (every engine
    setting) go whole to each replica's engine."""

    def __init__(self, model_dir: str, cfg: EnginesConfig, args: EngineArgs, *, run_dir: Path,
                 max_ongoing_requests: int = 1024, max_batch: int = 32) -> None:
        super().__init__()
        self.model_dir = model_dir
        self.engine = cfg.engine
        self.num_replicas = cfg.num_replicas
        self.run_dir = Path(run_dir)
        self.args = args
        self.cpus_per_replica = cfg.cpus_per_replica
        self.gpus_per_replica = cfg.gpus_per_replica
        self.threads = cfg.threads
        self.stream_interval = cfg.stream_interval
        self.ray_address = cfg.ray_address
        self.max_ongoing_requests = max_ongoing_requests
        suffix = uuid.uuid4().hex[:8]
        self.app_name = f"streamrl-engines-{suffix}"
        self.namespace = "streamrl"
        self.store_name = f"streamrl-weights-{suffix}"
        self.version = 0
        self.lost_requests = 0  # requests cut off by a lost replica (resumed by the manager)
        self.requests_by_replica: Counter[str] = Counter()
        self._handle: Any = None
        self._store: Any = None
        self._started_ray = False
        self._stats: list[dict[str, Any]] = []
        self._inflight = 0
        self.max_batch = max_batch
        self._pending: list[tuple[tuple[list[int], dict[str, Any], str], _Pending]] = []
        self._flush_scheduled = False
        self._batches: set[asyncio.Task[None]] = set()
        self._closing = False

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        t0 = time.perf_counter()
        # On the loop's (main) thread: Ray's session must be started by a thread that lives on, and
        # nothing else runs yet. A cluster address that does not answer fails fast (_check_reachable).
        self._started_ray = start_ray(self.run_dir, num_cpus=self.num_replicas * self.cpus_per_replica,
                                      address=self.ray_address)
        try:
            await asyncio.to_thread(self._deploy)
        except BaseException:
            await self.aclose()
            raise
        # Serve logs its start at INFO on the console, and warns once per request cut off by a lost
        # replica; the pool reports those itself (the replicas' logs stay in RUN_DIR/ray).
        logging.getLogger("ray.serve").setLevel(logging.ERROR)
        await self.refresh_stats()
        log.info("ray_serve pool: %d replicas up in %.1f s", self.num_replicas, time.perf_counter() - t0)

    def _deploy(self) -> None:
        import ray
        from ray import serve

        logging.getLogger("ray.serve").setLevel(logging.WARNING)

        from .serve_replica import EngineReplica, WeightStore

        self._store = WeightStore.options(name=self.store_name, namespace=self.namespace).remote()
        ray.get(self._store.get.remote())  # the store exists before any replica looks for it
        # Requests sent from the moment the replicas hold a version carry it: a replica that missed it
        # (one starting meanwhile) loads it before generating.
        self.weight_sync = ObjectStoreSync(self._store, self._broadcast, loaded=self._loaded)
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING", "enable_access_log": False})
        env = {"OMP_NUM_THREADS": str(self.threads), "TOKENIZERS_PARALLELISM": "false"}
        dep = serve.deployment(
            EngineReplica,
            name="engine",
            num_replicas=self.num_replicas,
            ray_actor_options={"num_cpus": self.cpus_per_replica, "num_gpus": self.gpus_per_replica,
                               "runtime_env": {"env_vars": env}},
            # The engine queues and batches; Serve must not cap what reaches it.
            max_ongoing_requests=self.max_ongoing_requests,
            graceful_shutdown_timeout_s=2.0,
            health_check_period_s=2.0,
            logging_config={"log_level": "WARNING", "enable_access_log": False},
        )
        app = dep.bind(self.model_dir, self.engine, self.args, self.store_name, self.namespace, self.stream_interval)
        self._handle = serve.run(app, name=self.app_name, route_prefix=None)

    async def aclose(self) -> None:
        import ray

        self._closing = True
        for _, p in self._pending:  # queued in this loop turn, never sent
            p.fail(RuntimeError("ray_serve pool closed"))
        self._pending = []
        while self._batches:
            for t in list(self._batches):
                t.cancel()
            await asyncio.gather(*self._batches, return_exceptions=True)

        if not ray.is_initialized():
            return
        from ray import serve

        def stop() -> None:
            if self._started_ray:  # our session: ending it ends Serve, the replicas and the store
                ray.shutdown()
                return
            try:  # a shared session: remove only what this pool added
                serve.delete(self.app_name)
            except Exception as e:  # noqa: BLE001 - shutting down: report, keep going
                log.warning("ray_serve pool: serve shutdown: %s", e)
            if self._store is not None:
                ray.kill(self._store)

        self._handle = None
        await asyncio.to_thread(stop)

    # ---- data plane ------------------------------------------------------------------------------
    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]:
        """Queued for the next batch call; requests issued in the same event-loop turn (a group's
        samples, a burst of admissions) travel together to one replica."""
        if self._closing:
            raise RuntimeError("ray_serve pool is closed")
        req = _Pending(rid, len(input_ids), asyncio.get_running_loop().create_future())
        self._pending.append(((list(input_ids), dict(sampling_params), rid), req))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        self._inflight += 1
        try:
            return await req.future
        finally:
            self._inflight -= 1

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        if self._closing:
            return
        for k in range(0, len(pending), self.max_batch):
            t = asyncio.get_running_loop().create_task(self._run_batch(pending[k:k + self.max_batch]))
            self._batches.add(t)
            t.add_done_callback(self._batches.discard)

    async def _run_batch(self, batch: list[tuple[tuple[list[int], dict[str, Any], str], _Pending]]) -> None:
        reqs = {p.rid: p for _, p in batch}
        try:
            stream = self._handle.options(stream=True).generate_batch.remote([a for a, _ in batch], self.version)
            async for msgs in stream:
                for m in msgs:
                    p = reqs[m["rid"]]
                    if "result" in m:
                        self.requests_by_replica[m["result"]["meta_info"].get("replica", "")] += 1
                        p.set(m["result"])
                    elif "error" in m:
                        p.fail(EngineError(m["error"]))
                    else:
                        p.ids += m["ids"]
                        p.lps += m["lps"]
                        extend_version_spans(p.spans, m["version"], len(p.ids), len(m["ids"]))
        except Exception as e:  # noqa: BLE001 - classified right below
            if not _is_lost_replica(e):
                for p in reqs.values():
                    p.fail(_unwrap(e))
                return
            lost = [p for p in reqs.values() if not p.future.done()]
            self.lost_requests += len(lost)
            log.warning("ray_serve pool: a replica was lost with %d requests in flight; they resume elsewhere",
                        len(lost))
            # "Unavailable" can be transient: the replica may still run these. Free their slots
            # (best effort, not awaited); the retries carry new request ids either way.
            t = asyncio.get_running_loop().create_task(self._abort_quietly([p.rid for p in lost]))
            self._batches.add(t)
            t.add_done_callback(self._batches.discard)
            await asyncio.sleep(0.05)  # let Serve's router drop the dead replica before the retries
            for p in lost:
                p.set(_lost_result(p, self.version))
        finally:
            for p in reqs.values():  # cancelled (pool closing) or a stream that ended early
                p.fail(RuntimeError("ray_serve pool: the request ended without a result"))

    # ---- control plane: every replica ------------------------------------------------------------
    async def _broadcast(self, method: str, *args: Any) -> list[Any]:
        """Results of the replicas that answered; lost replicas are skipped (their replacement reads
        the weight store, and nothing else here outlives a replica)."""
        results = await self._handle.broadcast(method, *args).results_async(return_exceptions=True)
        out = []
        for r in results:
            if isinstance(r, BaseException):
                if _is_lost_replica(r):
                    log.warning("ray_serve pool: %s skipped a lost replica", method)
                    continue
                raise _unwrap(r)
            out.append(r)
        return out

    async def _abort_quietly(self, rids: list[str]) -> None:
        with contextlib.suppress(Exception):
            await asyncio.gather(*[self._broadcast("abort", rid) for rid in rids])

    async def abort(self, rid: str) -> bool:
        return any(await self._broadcast("abort", rid))

    async def abort_all(self) -> None:
        await self._broadcast("abort_all")

    async def _pause_all(self, mode: str) -> None:
        await self._broadcast("pause", mode)

    async def _resume_all(self) -> None:
        await self._broadcast("resume")

    async def release_memory(self) -> None:
        await self._broadcast("release_memory")

    async def resume_memory(self) -> None:
        await self._broadcast("resume_memory")

    def _loaded(self, version: int) -> None:
        self.version = version

    # ---- stats -----------------------------------------------------------------------------------
    async def refresh_stats(self) -> None:
        self._stats = await self._broadcast("stats")

    def stats(self) -> dict[str, Any]:
        per = self._stats
        return {
            "running": self._inflight,
            "generated_tokens": sum(s.get("generated_tokens", 0) for s in per),
            "busy_s": sum(s.get("busy_s", 0.0) for s in per),
            "prefill_s": sum(s.get("prefill_s", 0.0) for s in per),
            "lost_requests": self.lost_requests,
            "replicas": per,
        }


def _lost_result(p: _Pending, version: int) -> dict[str, Any]:
    """What the lost replica had streamed, as an aborted result: the manager resumes from there."""
    return build_result(
        rid=p.rid, text="", output_ids=p.ids, logprobs=p.lps,
        finish=finish_reason("abort", message="replica lost", status_code=503, err_type="ReplicaLost"),
        prompt_tokens=p.prompt_tokens, weight_version=p.spans[-1]["version"] if p.spans else str(version),
        weight_versions=p.spans or None,
    )
