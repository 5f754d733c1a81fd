"""`build_pool(cfg.engines, ...)`: the pool `engines.pool` names, its engines given `EngineArgs` built once
from `engines.*`; `preflight` and `check_prompts`: what can be checked of the rollout side before any
work. Each pool module is imported only when chosen (Ray, vLLM's client)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import Config, ConfigError, EnginesConfig
from ..engine.args import EngineArgs
from ..plugins import PluginError
from .pools import EnginePool, LocalPool
from .runner import encode_prompt


def preflight(cfg: Config) -> None:
    """What can be checked of the rollout side before any work (a warm start, a trainer): the
    workflow and tools load, and a vLLM install exists to launch servers from. A ConfigError naming
    the key otherwise."""
    from .tools import ToolBox
    from .workflows import load_workflow

    try:
        load_workflow(cfg.rollout.workflow)
    except PluginError as e:
        raise ConfigError("rollout.workflow", str(e)) from None
    if cfg.rollout.workflow != "single_turn":
        try:
            ToolBox(cfg.tools)
        except PluginError as e:
            raise ConfigError("tools.functions", str(e)) from None
        from .capture import load_parser

        try:
            load_parser(cfg.rollout.tool_parser)
        except PluginError as e:
            raise ConfigError("rollout.tool_parser", str(e)) from None
    sections = [("engines", cfg.engines)] + ([("judge.engines", cfg.judge.engines)] if cfg.judge.enabled else [])
    for key, e in sections:
        if e.pool == "http" and e.backend == "vllm" and not e.urls:
            from .http_pool import require_vllm_python

            try:
                require_vllm_python(e)
            except ConfigError as err:
                raise ConfigError(f"{key}.vllm_python", err.problem) from None


def check_prompts(records: list[dict[str, Any]], tokenizer: Any, model_dir: str, max_new_tokens: int) -> None:
    """Every prompt renders with `tokenizer` (a chat needs its chat template), and the longest one plus
    `rollout.max_new_tokens` fits the model's context (`max_position_embeddings`), or every long
    request would fail inside the engines. A ConfigError naming the key, before any work."""
    if any(isinstance(r["prompt"], list) for r in records) and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.prompt_key", f"the prompts are chat messages, but the tokenizer of {model_dir} has no "
                                             "chat template to render them: give a model whose tokenizer has one (or "
                                             "model.init: tiny_agent), or point data.prompt_key at a text field")
    context_len = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    if not isinstance(context_len, int) or not records:
        return  # the model does not say; the engines will
    longest = max(len(encode_prompt(tokenizer, r["prompt"])) for r in records)
    if longest + max_new_tokens > context_len:
        raise ConfigError("rollout.max_new_tokens", f"{max_new_tokens} new tokens after the longest prompt ({longest} "
                          f"tokens) exceed the model's context of {context_len} (max_position_embeddings); at most "
                          f"{context_len - longest}")


def build_pool(cfg: EnginesConfig, model_dir: str, *, run_dir: Path, seed: int = 0, lora_rank: int = 0) -> EnginePool:
    """The pool `engines.pool` names, over engines that load `model_dir` (not started yet); `lora_rank`:
    the rank of the LoRA adapters it will be pushed (launched vLLM servers must be told)."""
    args = EngineArgs.from_config(cfg, seed=seed)
    if cfg.pool == "http":
        from .http_pool import build_http_pool

        return build_http_pool(cfg, model_dir, args, run_dir=run_dir, lora_rank=lora_rank)
    if cfg.pool == "ray_serve":
        from .ray_serve_pool import RayServePool

        return RayServePool(model_dir, cfg, args, run_dir=run_dir)
    if cfg.pool == "local":
        from ..engine import TorchEngine

        return LocalPool([TorchEngine(model_dir, args.replica(i)) for i in range(cfg.num_replicas)])
    raise ConfigError("engines.pool", f"pool '{cfg.pool}' is not available in this build; use local")
