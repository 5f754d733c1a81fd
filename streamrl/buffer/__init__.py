"""The rollout buffer between the rollout manager and the trainer (no torch)."""

from streamrl.buffer.buffer import BufferClosed, BufferFull, RolloutBuffer

__all__ = ["BufferClosed", "BufferFull", "RolloutBuffer"]
