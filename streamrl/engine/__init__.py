"""Generation engines behind one async contract (see `protocol.py`).

`TorchEngine` is loaded on first use: the contract's types import no torch, so the rollout side can
name them without loading it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .protocol import Engine, EngineError, EngineState, GenerateChunk, SamplingParams, build_result

if TYPE_CHECKING:
    from .torch_engine import TorchEngine

__all__ = ["Engine", "EngineError", "EngineState", "GenerateChunk", "SamplingParams", "TorchEngine", "build_result"]


def __getattr__(name: str) -> Any:
    if name == "TorchEngine":
        from . import torch_engine

        return getattr(torch_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
