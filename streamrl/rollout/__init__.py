"""Rollouts: engine pools and the manager that turns prompts into scored groups (no torch at import)."""

from .build import build_pool, preflight
from .lockstep import Lockstep, make_deterministic
from .manager import RolloutCounters, RolloutFailed, RolloutManager
from .pools import EnginePool, LeastLoaded, LocalPool

__all__ = ["EnginePool", "LeastLoaded", "LocalPool", "Lockstep", "RolloutCounters", "RolloutFailed",
           "RolloutManager", "build_pool", "make_deterministic", "preflight"]
