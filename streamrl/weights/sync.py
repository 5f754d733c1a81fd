"""How a pool's engines get the trainer's weights: one interface, one implementation per transport.

    pool.push_weights:  sync.stage(weights, v)   engines still generating (work that needs no pause)
                        pool.pause(mode)
                        sync.load(weights, v)    every engine holds version v when this returns
                        pool.resume()

- `InProcessSync`: engines in this process copy the trainer's tensors (`update_weights_from_state_dict`).
- `DiskSync`: a safetensors folder (in /dev/shm when there is one) that every server loads
  (`update_weights_from_disk`: SGLang, `streamrl serve`, vLLM's reload through `VLLMClient`).

With LoRA the trainer's weights are an `Adapter` (weights/lora.py) and each sync moves only its
tensors: in-process engines get `load_lora_adapter(adapter)`, servers a peft folder through their own
`load_lora_adapter` (SGLang's and vLLM's endpoints), Ray replicas the packed adapter. The broadcast
sync takes full weights only (config validation refuses LoRA with it).
- `BroadcastSync`: a gloo/NCCL group, the trainer rank 0 (`update_weights_from_distributed`).
- `ObjectStoreSync`: one `ray.put` of the packed weights, which every Ray Serve replica pulls.

A sync knows the engines' control calls only; it never pauses or resumes them (the pool does).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from .broadcast import BroadcastSender
from .formats import pack, save_folder
from .lora import ADAPTER_CONFIG, is_adapter, save_adapter


class WeightSync(ABC):
    async def stage(self, named_tensors: Any, version: int) -> None:
        """Work for the next `load` that can be done while the engines still generate. Nothing by default."""
        return None

    @abstractmethod
    async def load(self, named_tensors: Any, version: int) -> None:
        """Every engine holds these weights, as `version`, when this returns."""

    async def aclose(self) -> None:
        """Free what the sync holds (folders, process groups)."""
        return None


class InProcessSync(WeightSync):
    def __init__(self, engines: Sequence[Any]) -> None:
        self.engines = engines

    async def load(self, named_tensors: Any, version: int) -> None:
        if is_adapter(named_tensors):
            await asyncio.gather(*[e.load_lora_adapter(named_tensors, str(version)) for e in self.engines])
        else:
            await asyncio.gather(*[e.update_weights_from_state_dict(named_tensors, str(version)) for e in self.engines])


class DiskSync(WeightSync):
    """The version's folder is written in `stage`, while the engines still generate, so the pause only
    covers their loading it. `current` is the newest loaded (version, folder), which a server that
    joins later loads first. `each(fn)`: how to call every client (the HTTP pool's skips lost
    servers); default: all of `clients` at once."""

    def __init__(self, clients: Sequence[Any],
                 each: Callable[[Callable[[Any], Awaitable[Any]]], Awaitable[Any]] | None = None) -> None:
        self.clients = clients
        self.each = each or self._all
        self.root = Path(tempfile.mkdtemp(prefix="streamrl-weights-", dir=_fast_tmp()))
        self._staged: tuple[int, Path] | None = None
        self.current: tuple[int, Path] | None = None

    async def _all(self, fn: Callable[[Any], Awaitable[Any]]) -> list[Any]:
        return list(await asyncio.gather(*[fn(c) for c in self.clients]))

    async def _write(self, named_tensors: Any, version: int) -> Path:
        write = save_adapter if is_adapter(named_tensors) else save_folder
        return await asyncio.to_thread(write, named_tensors, self.root / f"v{version}")

    async def stage(self, named_tensors: Any, version: int) -> None:
        self._staged = (version, await self._write(named_tensors, version))

    async def load(self, named_tensors: Any, version: int) -> None:
        staged, self._staged = self._staged, None
        folder = staged[1] if staged and staged[0] == version else await self._write(named_tensors, version)
        previous, self.current = self.current, (version, folder)
        try:
            await self.each(lambda c: load_into(c, str(folder), str(version)))
        except BaseException:
            self.current = previous
            raise
        # The previous version's folder stays one push longer: vLLM reads an adapter's files lazily, when
        # a request first needs it, and a request bound to it may still be finishing.
        keep = {folder, previous[1]} if previous and is_adapter(named_tensors) else {folder}
        with contextlib.suppress(OSError):
            for old in self.root.iterdir():
                if old not in keep:
                    shutil.rmtree(old, ignore_errors=True)

    async def aclose(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class BroadcastSync(WeightSync):
    """One group: the trainer is rank 0, server i joins as rank i + 1 (SGLang's protocol)."""

    def __init__(self, clients: Sequence[Any], *, backend: str = "gloo", device: str = "cpu") -> None:
        self.clients = clients
        self.backend, self.device = backend, device
        self.sender: BroadcastSender | None = None

    async def connect(self) -> None:
        self.sender = s = BroadcastSender("127.0.0.1", 0, world_size=len(self.clients) + 1, backend=self.backend,
                                          device=self.device)
        await asyncio.gather(asyncio.to_thread(s.connect), *[
            c.init_weights_update_group(s.master_address, s.master_port, i + 1, s.world_size, s.group_name,
                                        self.backend)
            for i, c in enumerate(self.clients)
        ])

    async def load(self, named_tensors: Any, version: int) -> None:
        if self.sender is None:
            await self.connect()
        s = self.sender
        assert s is not None
        tensors = [(n, t.detach().contiguous() if self.backend == "nccl" else t.detach().contiguous().cpu())
                   for n, t in dict(named_tensors).items()]
        names = [n for n, _ in tensors]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        # Every server must be receiving while rank 0 broadcasts: run both sides together.
        await asyncio.gather(asyncio.to_thread(s.broadcast, tensors), *[
            c.update_weights_from_distributed(names, dtypes, shapes, str(version), s.group_name) for c in self.clients
        ])

    async def aclose(self) -> None:
        if self.sender is not None:
            self.sender.close()


class ObjectStoreSync(WeightSync):
    """Ray: the packed weights go into the object store once; a store actor keeps the newest for
    replicas that start later, and `broadcast("sync_weights", version, box)` makes every live replica
    pull them. Requests sent after `load` returns carry `version`, so no replica serves them older."""

    def __init__(self, store: Any, broadcast: Callable[..., Awaitable[list[Any]]],
                 loaded: Callable[[int], None] | None = None) -> None:
        """`loaded(version)` runs as soon as every replica holds `version`, before the pool resumes."""
        self.store, self.broadcast, self.loaded = store, broadcast, loaded
        self._box: list[Any] | None = None

    async def load(self, named_tensors: Any, version: int) -> None:
        import ray

        lora = named_tensors if is_adapter(named_tensors) else None
        table, data = await asyncio.to_thread(pack, lora.tensors if lora else named_tensors)
        # Boxed so Ray passes the reference, not the value. The store holds a borrowed ref; the owner
        # (this process) keeps the object alive through `_box`.
        box = [table, await asyncio.to_thread(ray.put, data), (lora.rank, lora.alpha) if lora else None]
        self._box = box
        _, versions = await asyncio.gather(self.store.set.remote(version, box),
                                           self.broadcast("sync_weights", version, box))
        if any(v < version for v in versions):
            raise RuntimeError(f"ray_serve pool: replicas at versions {versions} after update to {version}")
        if self.loaded is not None:
            self.loaded(version)


def load_into(client: Any, folder: str, version: str) -> Awaitable[Any]:
    """A server loads a folder `DiskSync` wrote: a LoRA adapter's with its adapter call, full weights
    with `update_weights_from_disk` (a server that rejoins the pool gets the current one this way)."""
    if (Path(folder) / ADAPTER_CONFIG).is_file():
        return client.load_lora_adapter(folder, version)
    return client.update_weights_from_disk(folder, version)


def _fast_tmp() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
