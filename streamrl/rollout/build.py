"""`build_pool(cfg.engines, ...)`: the pool `engines.pool` names; `preflight`: what can be checked of
it before any work. Each pool module is imported only when chosen (Ray, vLLM's client)."""

from __future__ import annotations

from pathlib import Path

from ..config import Config, ConfigError, EnginesConfig
from .pools import EnginePool, LocalPool


def preflight(cfg: Config) -> None:
    """What can be checked of the rollout side before any work (a warm start, a trainer): the
    workflow and tools load, and a vLLM install exists to launch servers from. A ConfigError naming
    the key otherwise."""
    from .tools import ToolBox
    from .workflows import load_workflow

    try:
        workflow = load_workflow(cfg.rollout.workflow)
    except (ValueError, ImportError) as e:
        raise ConfigError("rollout.workflow", str(e)) from None
    if workflow is not None:
        try:
            ToolBox(cfg.tools)
        except (ValueError, ImportError) as e:
            raise ConfigError("tools.functions", str(e)) from None
    sections = [("engines", cfg.engines)] + ([("judge.engines", cfg.judge.engines)] if cfg.judge.enabled else [])
    for key, e in sections:
        if e.pool == "http" and e.backend == "vllm" and not e.urls:
            from .http_pool import require_vllm_python

            try:
                require_vllm_python(e)
            except ConfigError as err:
                raise ConfigError(f"{key}.vllm_python", err.problem) from None
    if cfg.judge.enabled:
        from ..judge import load_parser

        try:
            load_parser(cfg.judge.parse)
        except (ValueError, ImportError) as err:
            raise ConfigError("judge.parse", str(err)) from None


def build_pool(cfg: EnginesConfig, model_dir: str, *, run_dir: Path, seed: int = 0) -> EnginePool:
    """The pool `engines.pool` names, over engines that load `model_dir` (not started yet)."""
    if cfg.pool == "http":
        from .http_pool import build_http_pool

        return build_http_pool(cfg, model_dir, run_dir=run_dir, seed=seed)
    engine_kwargs = dict(device=cfg.device, dtype=cfg.dtype, max_running_requests=cfg.max_running_requests,
                         max_total_tokens=cfg.max_total_tokens, kv_cache_fraction=cfg.kv_cache_fraction,
                         weight_version="0")
    if cfg.pool == "ray_serve":
        from .ray_serve_pool import RayServePool

        # "auto" is resolved by each replica on its own node (the driver may have no GPU).
        return RayServePool(model_dir, cfg, run_dir=run_dir, engine_kwargs={**engine_kwargs, "seed": seed})
    if cfg.pool == "local":
        from ..engine import TorchEngine

        return LocalPool([TorchEngine(model_dir, **engine_kwargs, seed=seed + i, num_threads=cfg.threads)
                          for i in range(cfg.num_replicas)])
    raise ConfigError("engines.pool", f"pool '{cfg.pool}' is not available in this build; use local")
