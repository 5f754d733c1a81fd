"""Warm starts: supervised recipes that a task brings, run once and cached by content, and
`prepare_model`, which makes a run's starting folder from `model.*` and `warm_start.*`.

A recipe is a function of the task's own module, `recipe(model_dir, out_dir, **params) -> metrics`,
that trains `model_dir` and writes an HF folder to `out_dir` (`save_trained`). This module knows no
task: it runs the recipe it is given. A cached folder is reused only when everything that changes
what the recipe trains is the same: its parameters (defaults filled in), the base folder's weights,
config and tokenizer, the source of the recipe's module and of the streamrl modules it uses, and the
torch and transformers versions. A cache that held a folder from other code is not a result.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from ..config import ConfigError, ModelConfig, WarmStartConfig

MARKER = "WARM_START_COMPLETE"
METRICS_FILE = "warm_start.json"
Recipe = Callable[..., dict[str, Any]]
_NOT_RECIPE_PARAMS = ("model_dir", "out_dir", "progress")


def load_for_training(model_dir: str | Path, device: str) -> tuple[Any, Any, Any]:
    """(model in float32 on `device`, tokenizer, the dtype to save it in) for a supervised recipe."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Eager attention: at ~10 tokens per row it measured faster than sdpa per CPU training step.
    attn = "eager" if torch.device(device).type == "cpu" else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    saved = getattr(model.config, "dtype", None)
    return model.to(device), tokenizer, saved if isinstance(saved, torch.dtype) else torch.float32


def save_trained(model: Any, tokenizer: Any, out_dir: str | Path, metrics: dict[str, Any]) -> dict[str, Any]:
    """A warm start's result: the model and tokenizer as an HF folder at `out_dir`, its metrics in
    `warm_start.json` beside them. Returns `metrics`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    return metrics


def cosine(step: int, total: int, warmup: int = 0) -> float:
    """Learning-rate factor: linear warmup, then a cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def loss_window(losses: list[float]) -> dict[str, float]:
    """Mean loss over the first and the last few steps (a recipe's metrics)."""
    w = max(1, min(20, len(losses) // 5))
    return {"loss_first": sum(losses[:w]) / w, "loss_last": sum(losses[-w:]) / w}


# ---- the cache ---------------------------------------------------------------------------------------
def _hash_files(h: Any, files: list[Path]) -> None:
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(block)


def _hash_model_dir(model_dir: Path) -> str:
    """The base folder's weights, config and tokenizer files."""
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} has no config.json; is it a Hugging Face model folder?")
    files = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("tokenizer*")) + [model_dir / "config.json"]
    h = hashlib.sha256()
    _hash_files(h, files)
    return h.hexdigest()


def _code_files(recipe: Recipe) -> list[Path]:
    """The source files whose code a recipe runs: its module, the streamrl modules and functions that
    module uses, and this one."""
    module = sys.modules[recipe.__module__]
    used: set[str] = {module.__file__ or "", __file__}
    for obj in vars(module).values():
        owner = obj if isinstance(obj, ModuleType) else sys.modules.get(getattr(obj, "__module__", "") or "")
        name = getattr(owner, "__name__", "")
        if owner is not None and name.startswith("streamrl.") and getattr(owner, "__file__", None):
            used.add(owner.__file__)  # type: ignore[arg-type]
    return sorted(Path(f) for f in used if f)


def warm_start_key(recipe: Recipe, model_dir: str | Path, **params: Any) -> str:
    """The cache key of `recipe(model_dir, ..., **params)`: see the module's docstring for what it covers."""
    import torch
    import transformers

    bound = inspect.signature(recipe).bind("model", "out", **params)
    bound.apply_defaults()
    code = hashlib.sha256()
    _hash_files(code, _code_files(recipe))
    body = {"recipe": f"{recipe.__module__}:{recipe.__qualname__}",
            "params": {k: v for k, v in bound.arguments.items() if k not in _NOT_RECIPE_PARAMS},
            "base": _hash_model_dir(Path(model_dir)), "code": code.hexdigest(),
            "torch": torch.__version__, "transformers": transformers.__version__}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cached_warm_start(recipe: Recipe, model_dir: str | Path, cache_root: str | Path, **params: Any) -> Path:
    """`recipe` into ``cache_root/warm-<key>``, or that folder as it is if a finished run left it there.

    A run trains into a temporary sibling, writes ``MARKER`` last and then renames the folder into
    place, so a killed run is never reused and two concurrent runs cannot interleave files.
    """
    root = Path(cache_root)
    final = root / f"warm-{warm_start_key(recipe, model_dir, **params)}"
    if (final / MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        recipe(model_dir, tmp, **params)
        (tmp / MARKER).write_text("ok\n")
        if final.exists() and not (final / MARKER).is_file():
            shutil.rmtree(final)  # a folder without the marker is an interrupted run: not trusted
        try:
            tmp.rename(final)
        except OSError:
            if not (final / MARKER).is_file():  # lost a race only if the winner actually finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_warm_start_metrics(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / METRICS_FILE).read_text())


# ---- a run's starting folder ---------------------------------------------------------------------------
def build_model(model: ModelConfig, *, section: str = "", log: Any = print) -> str:
    """The model folder `model.path`: the tiny model built there if `model.init` asks and it is
    missing. `section`: where `model` sits in the config (`judge.` for the judge's), for errors."""
    path = Path(model.path)
    if not (path / "config.json").is_file():
        if model.init == "none":
            raise ConfigError(f"{section}model.path", f"folder '{path}' has no config.json")
        from .tiny_model import build_tiny_model

        log(f"building tiny model at {path}")
        build_tiny_model(path, preset=model.preset, seed=model.init_seed, agent=model.init == "tiny_agent",
                         tools=model.init == "tiny_tools", text=model.init == "tiny_text")
    return str(path)


def prepare_model(model: ModelConfig, warm: WarmStartConfig, *, seed: int, recipe: Recipe | None,
                  section: str = "", log: Any = print) -> tuple[str, dict[str, Any]]:
    """The starting folder: `build_model`, then the cached `recipe` (the task's warm start) if
    `warm.enabled`. Returns (folder, the warm start's metrics and whether they came from the cache)."""
    path = Path(build_model(model, section=section, log=log))
    if not warm.enabled:
        return str(path), {}
    if recipe is None:
        raise ConfigError(f"{section}warm_start.enabled", "this task has no built-in warm start; bring a trained "
                                                          f"{section}model.path")
    from ..devices import resolve_device

    params = dict(steps=warm.steps, batch_size=warm.batch_size, lr=warm.lr, label_noise=warm.label_noise, seed=seed,
                  device=resolve_device(warm.device))
    if warm.warmup_steps is not None:
        if "warmup_steps" not in inspect.signature(recipe).parameters:
            raise ConfigError(f"{section}warm_start.warmup_steps", "this warm start has its own schedule; leave it "
                                                                   "null")
        params["warmup_steps"] = warm.warmup_steps
    target = Path(warm.cache_dir) / f"warm-{warm_start_key(recipe, path, **params)}"
    cached = (target / MARKER).is_file()
    log(f"warm start: reusing cache {target}" if cached else f"warm start: {warm.steps} supervised steps")
    out = cached_warm_start(recipe, path, warm.cache_dir, **params)
    return str(out), {**load_warm_start_metrics(out), "cached": cached}
