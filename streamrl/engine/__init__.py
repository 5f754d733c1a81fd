"""Generation engines behind one async contract (see `protocol.py`)."""

from .protocol import Engine, EngineError, GenerateChunk, SamplingParams, build_result
from .torch_engine import TorchEngine

__all__ = ["Engine", "EngineError", "GenerateChunk", "SamplingParams", "TorchEngine", "build_result"]
