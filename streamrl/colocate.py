"""Colocated (hybrid) mode, `engines.colocate: true`: the engines and the trainer share one GPU and
take turns with its memory.

A step's batch is gathered while the engines generate. Then the engines stop (samples in flight come
back partial, as at a weight update, and resume later with 0 tokens lost), free their KV cache (and
with `engines.colocate_offload_weights` their weights, to host memory), and the trainer computes the
whole step with the GPU to itself. Then the engines take their memory back, and the run loop's weight
push copies the new weights into them GPU to GPU (one process: no disk, no host, no serialisation)
and resumes them. verl's hybrid engine and slime's colocated mode work this way; the price is that
generation waits while the trainer computes, so async overlap shrinks to what happens while a batch
fills.

`ColocatedTrainer` is the trainer handle the run loop drives (the same methods), so the loop itself
does not change.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .config import EnginesConfig
from .rollout.pools import EnginePool, LocalPool
from .trainer import TrainerProcess, TrainerThread
from .types import Group


class ColocatedTrainer:
    def __init__(self, trainer: TrainerThread | TrainerProcess, pool: LocalPool, *, offload_weights: bool) -> None:
        self.trainer = trainer
        self.pool = pool
        self.offload_weights = offload_weights
        self.tokenizer = trainer.tokenizer
        self._parts: list[list[Group]] = []

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def samples(self) -> int:
        return self.trainer.samples

    async def accumulate(self, groups: list[Group]) -> None:
        """Held until `finish_step`: the engines keep the GPU while the batch fills."""
        self._parts.append(groups)

    async def finish_step(self) -> dict[str, Any]:
        parts, self._parts = self._parts, []
        t0 = time.perf_counter()
        await self.pool.pause("abort")
        await self.pool.release_memory(weights=self.offload_weights)
        released = self.pool.memory_bytes()
        t1 = time.perf_counter()
        try:
            for p in parts:
                await self.trainer.accumulate(p)
            stats = await self.trainer.finish_step()
        finally:
            t2 = time.perf_counter()
            await self.pool.resume_memory()  # the push that follows loads the new weights and resumes
        return stats | {"engine_release_s": t1 - t0, "engine_restore_s": time.perf_counter() - t2,
                        "engine_bytes_during_step": released}

    async def save(self, out_dir: str | Path, *, optimizer: bool = False, merged: bool = False) -> Path:
        return await self.trainer.save(out_dir, optimizer=optimizer, merged=merged)

    def weights(self) -> Any:
        return self.trainer.weights()

    async def aclose(self) -> None:
        await self.trainer.aclose()


TrainerHandle = TrainerThread | TrainerProcess | ColocatedTrainer


def colocated(trainer: TrainerThread | TrainerProcess, pool: EnginePool, cfg: EnginesConfig) -> TrainerHandle:
    """The handle the run loop drives: `trainer` itself, or with `engines.colocate` wrapped so that the
    engines yield their memory around each step."""
    if not cfg.colocate:
        return trainer
    assert isinstance(pool, LocalPool)  # the config allows colocate with pool=local only
    return ColocatedTrainer(trainer, pool, offload_weights=cfg.colocate_offload_weights)
