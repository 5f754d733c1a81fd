"""What a runner reads off a Llama-family decoder (Llama, Qwen2, Qwen3, Mistral): whether the fast
paths apply, and its layers and attention shape. Shared by the per-slot runner (model_runner.py) and
the paged GPU runner (gpu/runner.py)."""

from __future__ import annotations

from typing import Any

import torch


def supports_fast_path(model: Any) -> bool:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "embed_tokens"):
        return False
    if getattr(model.config, "use_sliding_window", False) and getattr(model.config, "sliding_window", None):
        return False
    attn = getattr(layers[0], "self_attn", None)
    return all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) and all(
        hasattr(layers[0], n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")
    )


class LlamaShape:
    """What a runner of a Llama-family decoder reads off the model: its layers, attention shape,
    device and dtype (ModelRunner here, gpu/runner.py's PagedRunner)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        cfg = model.config
        self.layers = list(model.model.layers)
        attn0 = self.layers[0].self_attn
        self.head_dim = int(getattr(attn0, "head_dim", cfg.hidden_size // cfg.num_attention_heads))
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.scale = float(getattr(attn0, "scaling", self.head_dim**-0.5))

    @property
    def device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype
