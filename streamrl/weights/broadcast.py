"""Weights by collective broadcast (gloo for CPU tensors, NCCL for GPU ones), in the shape of SGLang's
`/init_weights_update_group` + `/update_weights_from_distributed`: the trainer is rank 0 and hosts the
TCP store; each engine joins as rank `rank_offset` and receives every tensor in the announced order.

`BroadcastSender` is the trainer's side, `join_group` / `receive` the engine's.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

GROUP_NAME = "weight_update_group"


class BroadcastSender:
    """Rank 0 of a weight-update group: hosts the store, broadcasts every tensor to ranks 1..N-1."""

    def __init__(self, master_address: str = "127.0.0.1", master_port: int = 0, world_size: int = 2,
                 group_name: str = GROUP_NAME, timeout_s: float = 600.0, backend: str = "gloo",
                 device: str = "cpu") -> None:
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        self.backend, self.device = backend, device
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(master_address, master_port, world_size, True, self._timeout,
                                    wait_for_workers=False)
        self.master_address, self.master_port = master_address, int(self._store.port)
        self.world_size, self.group_name = world_size, group_name
        self._pg: Any = None

    def connect(self) -> None:
        """Blocks until every rank has joined."""
        self._pg = _process_group(self._store, self.group_name, 0, self.world_size, self.backend, self.device,
                                  self._timeout)

    def broadcast(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        if self._pg is None:
            raise RuntimeError("BroadcastSender.connect() first")
        if self.backend == "nccl":
            import torch

            torch.cuda.set_device(torch.device(self.device))
        for _, t in named_tensors:
            self._pg.broadcast(t.to(self.device) if self.backend == "nccl" else t, 0).wait()

    def close(self) -> None:
        self._pg = None


def join_group(master_address: str, master_port: int, rank: int, world_size: int, *, group_name: str = GROUP_NAME,
               backend: str = "gloo", device: str = "cpu", timeout_s: float = 600.0) -> Any:
    """An engine joins the trainer's group as `rank` (blocks until every rank has joined)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, False, timeout)
    return _process_group(store, group_name, rank, world_size, backend, device, timeout)


def receive(pg: Any, names: list[str], dtypes: list[str], shapes: list[list[int]], device: str) -> dict[str, Any]:
    """The tensors rank 0 broadcasts, in this order, on `device`."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    out = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        t = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
        pg.broadcast(t, 0).wait()
        out[name] = t
    return out


def _process_group(store: Any, group_name: str, rank: int, world_size: int, backend: str, device: str,
                   timeout: datetime.timedelta) -> Any:
    # The store prefix is the one torch's `new_group` and SGLang's custom groups use.
    import torch
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"{group_name}/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    torch.cuda.set_device(torch.device(device))  # NCCL binds the communicator to this thread's device
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
