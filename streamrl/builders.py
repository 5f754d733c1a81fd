"""Turn a validated `Config` into components: model folder, task data, reward, engine pool, trainer.

Each builder reads only its own config section. Nothing here runs a training step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import Config, ConfigError
from .engine import TorchEngine
from .engine.torch_engine import resolve_device
from .rollout.pools import EnginePool, LocalPool


@dataclass
class TaskData:
    train: list[dict[str, Any]]
    held_out: list[dict[str, Any]]
    reward_fn: Any


def prepare_model(cfg: Config, log: Any = print) -> tuple[str, dict[str, Any]]:
    """The policy's starting folder: build the tiny model if asked, then the (cached) warm start."""
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        if cfg.model.init != "tiny":
            raise ConfigError("model.path", f"folder '{path}' has no config.json")
        from .tasks import build_tiny_model

        log(f"building tiny model at {path}")
        build_tiny_model(path, preset="tiny", seed=cfg.model.init_seed)
    info: dict[str, Any] = {}
    if not cfg.warm_start.enabled:
        return str(path), info
    from .trainer.sft import MARKER, cached_warm_start, load_warm_start_metrics, warm_start_key

    ws = cfg.warm_start
    recipe = dict(steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr, label_noise=ws.label_noise, seed=cfg.seed)
    target = Path(ws.cache_dir) / f"warm-{warm_start_key(path, **recipe)}"
    cached = (target / MARKER).is_file()
    log("warm start: reusing cache " + str(target) if cached else f"warm start: {ws.steps} supervised steps")
    out = cached_warm_start(path, ws.cache_dir, **recipe)
    info = load_warm_start_metrics(out)
    info["cached"] = cached
    return str(out), info


def load_task(cfg: Config) -> TaskData:
    from .tasks import addition, load_prompts, load_reward_fn

    d = cfg.data
    if d.task == "addition":
        train = addition.addition_prompts("train", seed=cfg.seed)
        held = addition.addition_prompts("held_out", seed=cfg.seed)
        reward = addition.reward
    else:
        assert d.path is not None  # validate() guarantees exactly one of task / path
        records = load_prompts(d.path, d.prompt_key, d.answer_key)
        n_eval = min(d.eval_size, len(records) // 5)
        train, held = records[n_eval:], records[:n_eval]
        reward = addition.reward
    if d.reward:
        try:
            reward = load_reward_fn(d.reward)
        except (ValueError, ImportError) as e:
            raise ConfigError("data.reward", str(e)) from None
    return TaskData(train=train, held_out=held[: d.eval_size], reward_fn=reward)


def build_pool(cfg: Config, model_dir: str) -> EnginePool:
    e = cfg.engines
    if e.pool == "http":
        from .rollout.http_pool import HttpPool, launch_servers

        log_dir = Path(cfg.run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        if e.backend == "vllm":  # validate() guarantees no router and disk weight sync
            launched = None if e.urls else vllm_servers(cfg, model_dir)
            return HttpPool(e.urls, launch=launched, backend="vllm")  # type: ignore[return-value]
        router = dict(router=e.router, router_log=log_dir / "router.log", weight_sync=e.weight_sync)
        if e.urls:
            return HttpPool(e.urls, **router)  # type: ignore[return-value, arg-type]
        servers = launch_servers(
            e.num_replicas, model_dir, Path(cfg.run_dir), device=resolve_device(cfg.model.device),
            dtype=cfg.model.dtype, max_running_requests=e.max_running_requests, threads=e.threads,
            weight_version="0", cpu_kernel=e.cpu_kernel,
        )
        return HttpPool(launch=servers, **router)  # type: ignore[return-value, arg-type]
    if e.pool == "ray_serve":
        from .rollout.ray_serve_pool import RayServePool

        return RayServePool(  # type: ignore[return-value]
            model_dir, num_replicas=e.num_replicas, run_dir=Path(cfg.run_dir), engine=e.engine,
            # "auto" is resolved by each replica on its own node (the driver may have no GPU).
            engine_kwargs=dict(device=cfg.model.device, dtype=cfg.model.dtype,
                               max_running_requests=e.max_running_requests, max_total_tokens=e.max_total_tokens,
                               seed=cfg.seed, weight_version="0", cpu_kernel=e.cpu_kernel),
            cpus_per_replica=e.cpus_per_replica, gpus_per_replica=e.gpus_per_replica, threads=e.threads,
            stream_interval=e.stream_interval, ray_address=e.ray_address,
        )
    if e.pool == "local":
        engines = [
            TorchEngine(
                model_dir, device=resolve_device(cfg.model.device), dtype=cfg.model.dtype,
                max_running_requests=e.max_running_requests, max_total_tokens=e.max_total_tokens,
                seed=cfg.seed + i, weight_version="0", num_threads=e.threads, cpu_kernel=e.cpu_kernel,
            )
            for i in range(e.num_replicas)
        ]
        return LocalPool(engines)
    raise ConfigError("engines.pool", f"pool '{e.pool}' is not available yet in this build; use local")


def vllm_python(cfg: Config) -> str:
    """The Python that launches vLLM servers; a ConfigError naming the fix when there is none."""
    from .engine.vllm import find_vllm_python

    e = cfg.engines
    python = find_vllm_python(e.vllm_python)
    if python is None:
        where = f"'{e.vllm_python}' does not exist" if e.vllm_python else "no Python with vLLM was found"
        raise ConfigError("engines.vllm_python", f"{where}; run `bash scripts/setup_vllm.sh` (builds .venv-vllm) "
                                                 "or point engines.vllm_python at a Python that has vllm")
    return python


def vllm_servers(cfg: Config, model_dir: str) -> list[Any]:
    """One real vLLM server per replica, from vLLM's own environment (scripts/setup_vllm.sh)."""
    from .engine.vllm import VLLMServer

    e = cfg.engines
    python = vllm_python(cfg)
    logs = Path(cfg.run_dir) / "logs"
    return [
        VLLMServer(python, model_dir, log_path=logs / f"vllm-{i}.log", dtype=cfg.model.dtype,
                   max_num_seqs=e.max_running_requests, kv_cache_gib=e.vllm_kv_cache_gib, seed=cfg.seed + i,
                   cache_dir=str(Path(cfg.warm_start.cache_dir).parent / "vllm"), start_timeout=e.start_timeout_s)
        for i in range(e.num_replicas)
    ]


def check_context(cfg: Config, model_dir: str, task: TaskData) -> None:
    """The longest prompt plus `rollout.max_new_tokens` must fit the model's context: otherwise every
    long request fails inside the engines, and held-out evaluation before the first step with it."""
    import json

    from transformers import AutoTokenizer

    from .rollout.manager import encode_prompt

    model_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    ctx = model_cfg.get("max_position_embeddings")
    if not isinstance(ctx, int):
        return  # the model does not say; the engines will
    tok = AutoTokenizer.from_pretrained(model_dir)
    records = task.train + task.held_out
    longest = max(len(encode_prompt(tok, r["prompt"])) for r in records)
    n = cfg.rollout.max_new_tokens
    if longest + n > ctx:
        raise ConfigError(
            "rollout.max_new_tokens",
            f"{n} new tokens after the longest prompt ({longest} tokens) exceed the model's context of {ctx} "
            f"(max_position_embeddings in {model_dir}/config.json); at most {ctx - longest}",
        )
