"""Rollouts: engine pools and the manager that turns prompts into scored groups."""

from .manager import RolloutCounters, RolloutFailed, RolloutManager, RolloutSettings
from .pools import EnginePool, LocalPool

__all__ = ["EnginePool", "LocalPool", "RolloutCounters", "RolloutFailed", "RolloutManager", "RolloutSettings"]
