"""Which runner computes for TorchEngine: the paged GPU runner (gpu/, Triton: loaded only for it), the
per-slot runner (model_runner.ModelRunner), or the whole-sequence fallback, and the KV budget the
scheduler admits against."""

from __future__ import annotations

import logging
from typing import Any

import torch

from .model_runner import FallbackRunner, ModelRunner
from .shape import supports_fast_path

log = logging.getLogger("streamrl.engine.model_runner")


def make_runner(model: Any, kind: str, rows: int, context_len: int, max_total_tokens: int | None, *,
                cpu_kernel: bool, kv_cache_fraction: float) -> tuple[Any, int]:
    """The runner `kind` names for `model` (`auto`: the paged runner on CUDA where it applies, else
    per-slot rows; `paged`; `slots`) and the KV token budget the scheduler admits against."""
    if kind not in ("auto", "paged", "slots"):
        raise ValueError(f"runner must be auto, paged or slots, got {kind!r}")
    device = model.model.embed_tokens.weight.device if hasattr(model, "model") else torch.device("cpu")
    if kind == "paged" or (kind == "auto" and device.type == "cuda"):
        from .gpu import PagedRunner, supports_paged  # Triton: loaded only for the paged runner

        why = supports_paged(model)
        if why is None:
            runner = PagedRunner(model, rows, context_len,
                                 max_total_tokens=max_total_tokens or _kv_budget(model, rows * context_len, kv_cache_fraction))
            return runner, runner.num_pages * runner.page_size  # the pool's slots: whole pages
        if kind == "paged":
            raise ValueError(f"the paged runner cannot run this model: {why}")
        log.warning("streamrl: TorchEngine uses per-slot KV rows (%s)", why)
    total = max_total_tokens or rows * context_len
    if supports_fast_path(model):
        return ModelRunner(model, rows, context_len, cpu_kernel=cpu_kernel), total
    return FallbackRunner(model, rows, context_len), total


def _kv_budget(model: Any, most: int, fraction: float) -> int:
    """KV tokens: `most` (rows x context), or what `fraction` of the free GPU memory holds."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    per_token = cfg.num_hidden_layers * 2 * kv_heads * head_dim * model.model.embed_tokens.weight.element_size()
    device = model.model.embed_tokens.weight.device
    if device.type != "cuda":
        return most
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(most, int(fraction * free / per_token)))
