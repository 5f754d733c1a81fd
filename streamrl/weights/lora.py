"""LoRA adapters as they travel from the trainer to the engines, and how an engine applies one.

An `Adapter` holds, for every adapted linear module of the base model (named as in the base model's
state dict: `model.layers.0.self_attn.q_proj`), its `lora_A` [r, in] and `lora_B` [out, r] tensors and
the scale alpha / r. A push carries these tensors only: megabytes where the full model is gigabytes.

On disk an adapter is peft's format (`adapter_model.safetensors` + `adapter_config.json`), which
peft, vLLM's `/v1/load_lora_adapter` and SGLang's `/load_lora_adapter` read, and `streamrl serve` too.

An engine that holds merged weights (TorchEngine) applies an adapter with `Merger`: it keeps a copy of
each adapted weight as it was before the first adapter, and every new version's weight is computed
from that copy, `W = W_base + scale * B @ A`, so versions never accumulate rounding and the base
itself is never changed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
_PEFT_PREFIX = "base_model.model."  # peft's key prefix on disk
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_ADAPTER_NAME = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")


@dataclass
class Adapter:
    """`tensors`: `<module>.lora_A.weight` and `<module>.lora_B.weight` for every adapted module.
    `config`: peft's adapter_config (rank, alpha, target modules, base model), written beside them."""

    tensors: dict[str, torch.Tensor]
    rank: int
    alpha: float
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def modules(self) -> list[str]:
        return sorted({k.removesuffix(s) for k in self.tensors for s in _SUFFIXES if k.endswith(s)})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def is_adapter(weights: Any) -> bool:
    return isinstance(weights, Adapter)


def save_adapter(adapter: Adapter, folder: str | Path) -> Path:
    """The adapter in peft's format, which `PeftModel.from_pretrained` and vLLM/SGLang load."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file({_PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in adapter.tensors.items()},
              str(out / ADAPTER_FILE))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapter.rank, "lora_alpha": adapter.alpha,
              "lora_dropout": 0.0, "bias": "none", "target_modules": sorted({m.rsplit(".", 1)[-1] for m in adapter.modules()}),
              **{k: v for k, v in adapter.config.items() if k not in ("r", "lora_alpha", "target_modules")}}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))
    return out


def load_adapter(folder: str | Path) -> Adapter:
    """An adapter folder in peft's format (ValueError naming what is wrong)."""
    from safetensors.torch import load_file

    path = Path(folder)
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_FILE).is_file():
        raise ValueError(f"{str(folder)!r} is not a LoRA adapter folder (needs {ADAPTER_CONFIG} and {ADAPTER_FILE})")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_rslora") or config.get("use_dora"):
        raise ValueError(f"{str(folder)!r}: only plain LoRA adapters are supported")
    tensors = {}
    for k, v in load_file(str(path / ADAPTER_FILE)).items():
        # peft writes `.lora_A.weight`; an adapter name may sit before `.weight` (`.lora_A.default.weight`)
        name = _ADAPTER_NAME.sub(r".lora_\1.weight", k.removeprefix(_PEFT_PREFIX))
        if not name.endswith(_SUFFIXES):
            raise ValueError(f"{str(folder)!r}: unexpected tensor {k!r} (only lora_A / lora_B weights are supported)")
        tensors[name] = v
    return Adapter(tensors=tensors, rank=int(config["r"]), alpha=float(config["lora_alpha"]), config=config)


class Merger:
    """Applies adapters to a model's weights in place, always from the base weights it first saw."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.base: dict[str, torch.Tensor] = {}

    def check(self, adapter: Adapter) -> None:
        """ValueError naming the first module of `adapter` the model lacks, or whose shapes do not fit."""
        params = self.model.state_dict(keep_vars=True)
        for m in adapter.modules():
            p = params.get(m + ".weight")
            if p is None:
                raise ValueError(f"the model has no module {m!r}")
            a, b = adapter.tensors[m + ".lora_A.weight"], adapter.tensors[m + ".lora_B.weight"]
            if (b.shape[0], *a.shape[1:]) != tuple(p.shape) or a.shape[0] != b.shape[1]:
                raise ValueError(f"{m}: lora_B {tuple(b.shape)} @ lora_A {tuple(a.shape)} does not make {tuple(p.shape)}")

    def apply(self, adapter: Adapter) -> None:
        """Every adapted weight becomes `W_base + scale * B @ A`, in place (one fused addmm per module, no
        full-size temporaries in float32); a module this adapter does not adapt goes back to its base
        weight. `check` first: a bad adapter changes nothing."""
        import torch

        self.check(adapter)
        params = self.model.state_dict(keep_vars=True)
        adapted = set(adapter.modules())
        for m in adapted:  # on the weight's own device: the merge runs where the weights are
            self.base.setdefault(m + ".weight", params[m + ".weight"].detach().clone())
        with torch.no_grad():
            for w, base in self.base.items():
                p, m = params[w], w.removesuffix(".weight")
                if m not in adapted:
                    p.copy_(base)
                    continue
                a = adapter.tensors[m + ".lora_A.weight"].to(p.device, torch.float32)
                b = adapter.tensors[m + ".lora_B.weight"].to(p.device, torch.float32)
                if p.dtype == torch.float32:
                    torch.addmm(base, b, a, alpha=adapter.scale, out=p.data)
                else:  # merged in float32, rounded once
                    p.copy_(torch.addmm(base.float(), b, a, alpha=adapter.scale))
        for device in {t.device for t in self.base.values() if t.device.type == "cuda"}:
            torch.cuda.synchronize(device)  # the engine's next step runs on its own stream
