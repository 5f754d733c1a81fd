"""Rollouts: engine pools and the manager that turns prompts into scored groups (no torch at import)."""

from ..errors import RolloutFailed
from .build import build_pool, check_prompts, preflight
from .lockstep import FreeRunning, Lockstep
from .manager import RolloutCounters, RolloutManager
from .pools import EnginePool, LeastLoaded, LocalPool
from .runner import Context, Episode, Runner
from .tools import ToolBox

__all__ = ["Context", "EnginePool", "Episode", "FreeRunning", "LeastLoaded", "LocalPool", "Lockstep", "RolloutCounters",
           "RolloutFailed", "RolloutManager", "Runner", "ToolBox", "build_pool", "check_prompts", "preflight"]
