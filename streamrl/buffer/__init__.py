"""Between the rollout manager and the trainer: the buffer of finished groups, the off-policy controller,
and the trainer's batches drawn from both (no torch)."""

from .batches import next_batch
from .buffer import BufferClosed, BufferFull, RolloutBuffer
from .controller import ControllerStats, StalenessController

__all__ = ["BufferClosed", "BufferFull", "ControllerStats", "RolloutBuffer", "StalenessController", "next_batch"]
