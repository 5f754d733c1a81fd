"""What TorchEngine reads off its Hugging Face model: stop tokens, and new weights copied in."""

from __future__ import annotations

from typing import Any

import torch

from .protocol import EngineError


def eos_ids(model: Any) -> frozenset[int]:
    """The end-of-sequence ids of the model's generation config and config."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(eos)
    return frozenset(ids)


def load_state(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` into the model's parameters in place (so CUDA graphs and fused views that hold
    them stay valid), all checked first: a bad update changes nothing. EngineError names the first
    unknown name or mismatched shape."""
    # state_dict (not named_parameters) so tied weights are addressable under both names.
    params = model.state_dict(keep_vars=True)
    unknown = [k for k in tensors if k not in params]
    if unknown:
        raise EngineError(f"update_weights: unknown parameter(s) {unknown[:3]}")
    bad = [k for k, v in tensors.items() if tuple(v.shape) != tuple(params[k].shape)]
    if bad:
        raise EngineError(
            f"update_weights: shape mismatch for {bad[0]}: {tuple(tensors[bad[0]].shape)} vs "
            f"{tuple(params[bad[0]].shape)}"
        )
    device = None
    with torch.no_grad():
        for k, v in tensors.items():
            params[k].copy_(v)  # device and dtype converted in the one copy
            device = params[k].device
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)  # the engine's next step runs on its own stream; the source may change


def weight_bytes(model: Any, device: str) -> int:
    """Bytes of the model's weights that sit on `device` now (each storage once)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == torch.device(device).type:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
