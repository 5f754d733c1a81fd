"""The Ray Serve side of the `ray_serve` pool: one TorchEngine per replica, plus the weight store.

Each replica is its own Ray actor process, so generation never time-slices with the trainer.
Weights live in Ray's object store exactly once per version: the driver `ray.put`s them and records
the reference in `WeightStore`; replicas pull from there. That one source of truth is also how a
replica that Serve started after a crash catches up: it reads the store before it serves, and every
request carries the version it needs (`min_version`), so a replica that missed a broadcast while it
was starting loads the weights before generating anything.

This module imports Ray; only the `ray_serve` pool loads it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from ..engine import Engine, TorchEngine
from ..engine.args import EngineArgs
from ..weights import Adapter, unpack


@ray.remote(num_cpus=0)
class WeightStore:
    """The newest weights: a version and a box `[table, ObjectRef]` (boxed so Ray passes the ref, not
    the value; see `weights.formats`)."""

    def __init__(self) -> None:
        self.version = 0
        self.box: list[Any] | None = None  # None: the replicas' starting weights (the model folder)

    def set(self, version: int, box: list[Any]) -> None:
        if version >= self.version:
            self.version, self.box = version, box

    def get(self) -> tuple[int, list[Any] | None]:
        return self.version, self.box


def _make_engine(kind: str, model_dir: str, args: EngineArgs) -> Engine:
    if kind == "sglang":  # unverified here: needs a GPU build of sglang on the replica's node
        from ..engine.sglang_engine import SGLangEngine

        return SGLangEngine(model_dir, weight_version=args.weight_version, dtype=args.dtype, random_seed=args.seed)
    return TorchEngine(model_dir, args)


class EngineReplica:
    """Serve deployment body. Method names are the pool's control plane (called via broadcast)."""

    async def __init__(self, model_dir: str, engine: str, args: EngineArgs, store_name: str,
                       namespace: str, stream_interval: int) -> None:
        self.engine = _make_engine(engine, model_dir, args)
        await self.engine.__aenter__()
        self.store = ray.get_actor(store_name, namespace=namespace)
        self.stream_interval = max(1, stream_interval)
        self.tag = serve.get_replica_context().replica_id.unique_id
        self._sync = asyncio.Lock()
        await self.sync_weights(None)  # a replacement replica: current weights before the first request

    @property
    def version(self) -> int:
        v = self.engine.weight_version
        return int(v) if v.isdigit() else 0

    async def sync_weights(self, min_version: int | None, box: list[Any] | None = None) -> int:
        """Load weights if this replica is behind `min_version` (None: behind the store): from `box`
        when the caller passes it (a broadcast update), else from the store (a replica that missed it)."""
        if min_version is not None and self.version >= min_version:
            return self.version
        async with self._sync:
            version = min_version
            if box is None or min_version is None:
                version, box = await self.store.get.remote()
            if box is not None and version is not None and version > self.version:
                table, ref, lora = box
                tensors = unpack(table, await ref)
                if lora is None:
                    await self.engine.update_weights_from_state_dict(tensors, str(version))
                else:  # LoRA: (rank, alpha) and the adapter tensors only
                    await self.engine.load_lora_adapter(Adapter(tensors, rank=lora[0], alpha=lora[1]), str(version))
        return self.version

    async def generate_batch(self, reqs: list[tuple[list[int], dict[str, Any], str]],
                             min_version: int) -> AsyncIterator[list[dict[str, Any]]]:
        """Run several requests at once and stream their progress, multiplexed by rid.

        One Serve call per batch rather than per request: a handle call costs milliseconds of CPU on
        each side, more than a decode step of a small model. Each yield carries whatever messages are
        ready: token deltas (`ids`/`lps` produced under `version`, at least `stream_interval` of them),
        a request's full `result` when it ends, or its `error` (a bad request fails alone)."""
        await self.sync_weights(min_version)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def one(input_ids: list[int], params: dict[str, Any], rid: str) -> None:
            try:
                async for msg in self._stream(input_ids, params, rid):
                    queue.put_nowait(msg)
            except Exception as e:  # noqa: BLE001 - reported to the caller of this request only
                queue.put_nowait({"rid": rid, "error": str(e)})

        tasks = [asyncio.create_task(one(*r)) for r in reqs]
        open_ = len(reqs)
        try:
            while open_:
                out = [await queue.get()]
                while not queue.empty():
                    out.append(queue.get_nowait())
                open_ -= sum(1 for m in out if "result" in m or "error" in m)
                yield out
        finally:
            for t in tasks:  # the caller went away: the engine streams abort what they hold
                t.cancel()

    async def _stream(self, input_ids: list[int], params: dict[str, Any], rid: str) -> AsyncIterator[dict[str, Any]]:
        ids: list[int] = []
        lps: list[float] = []
        version = ""
        async for ch in self.engine.generate_stream(input_ids, params, rid):
            if ch.finished:  # the result repeats every token: pending deltas need not be sent
                assert ch.result is not None
                ch.result["meta_info"]["replica"] = self.tag
                yield {"rid": rid, "result": ch.result}
                return
            # Flush before appending, so a request that ends right here sends one message, not two.
            if ids and (len(ids) >= self.stream_interval or ch.weight_version != version):
                yield {"rid": rid, "ids": ids, "lps": lps, "version": version}
                ids, lps = [], []
            version = ch.weight_version
            ids += ch.token_ids
            lps += ch.logprobs

    async def abort(self, rid: str) -> bool:
        return await self.engine.abort(rid)

    async def abort_all(self) -> int:
        return await self.engine.abort_all()

    async def pause(self, mode: str) -> None:
        await self.engine.pause(mode)  # type: ignore[arg-type]

    async def resume(self) -> None:
        await self.engine.resume()

    async def release_memory(self) -> None:
        await self.engine.release_memory()

    async def resume_memory(self) -> None:
        await self.engine.resume_memory()

    async def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), "replica": self.tag, "pid": os.getpid()}

    async def check_health(self) -> None:
        """Serve's periodic probe: a replica whose engine loop died is restarted."""
        if not await self.engine.health():
            raise RuntimeError("engine loop is not running")

    async def __del__(self) -> None:
        await self.engine.aclose()
