"""The trainer's side of LoRA (`trainer.lora`): peft adapters on a frozen base, what the engines get of
them (an `Adapter`: the adapter tensors only), and the checks a config gets before any work.

The base model's weights never change and never travel again after the engines loaded them; the KL
reference is that same base with the adapters switched off (`disable_adapter`), so no second model is
held. The adapters start from a fixed seed, so two runs of one config start from the same adapters.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from ..config.schema import LoraConfig
from ..weights.lora import ADAPTER_CONFIG, Adapter

INIT_SEED = 0
_ALL = "all-linear"


def alpha(cfg: LoraConfig) -> float:
    return cfg.alpha if cfg.alpha is not None else 2.0 * cfg.rank


def lora_lr(cfg: LoraConfig, full_lr: float) -> float:
    return cfg.lr if cfg.lr is not None else 10.0 * full_lr


def is_adapter_folder(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def wrap(model: torch.nn.Module, cfg: LoraConfig, adapter_path: str | Path | None = None) -> Any:
    """`model` with trainable adapters (peft), every base weight frozen; `adapter_path`: start from the
    adapters saved there (a checkpoint) instead of fresh ones."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    with warnings.catch_warnings():  # peft asks transformers a deprecated question; not the user's to fix
        warnings.simplefilter("ignore", FutureWarning)
        if adapter_path is not None:
            return PeftModel.from_pretrained(model, str(adapter_path), is_trainable=True)
        targets: Any = _ALL if cfg.target_modules == [_ALL] else list(cfg.target_modules)
        peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=alpha(cfg), lora_dropout=cfg.dropout, target_modules=targets,
                                  bias="none", task_type="CAUSAL_LM")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)
            return get_peft_model(model, peft_cfg)


def adapter(model: Any) -> Adapter:
    """The adapter tensors of a peft model, as views of its parameters (current after every step),
    named by the base model's modules."""
    cfg = model.peft_config["default"]
    tensors = {}
    for name, p in model.named_parameters():
        if "lora_" not in name:
            continue
        module, _, kind = name.removeprefix("base_model.model.").partition(".lora_")
        ab = kind.split(".", 1)[0]  # "A.default.weight" -> "A"
        tensors[f"{module}.lora_{ab}.weight"] = p.detach()
    return Adapter(tensors=tensors, rank=int(cfg.r), alpha=float(cfg.lora_alpha),
                   config={"base_model_name_or_path": cfg.base_model_name_or_path})


def save_merged(model: Any, out: Path) -> Path:
    """The base with the adapters merged in, as a Hugging Face folder (the trained model is untouched)."""
    import copy

    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(out)
    return out


def linear_modules(model_dir: str | Path) -> set[str]:
    """The short names of the linear layers of the model in `model_dir` (built on the meta device: no
    weights read), the output head left out as peft's all-linear leaves it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}


def check_targets(model_dir: str | Path, cfg: LoraConfig) -> None:
    """ConfigError naming `trainer.lora.target_modules` when the model has no such linear layer."""
    if cfg.rank == 0 or cfg.target_modules == [_ALL]:
        return
    have = linear_modules(model_dir)
    missing = [t for t in cfg.target_modules if t not in have]
    if missing:
        raise ConfigError("trainer.lora.target_modules", f"the model has no linear module {missing[0]!r} "
                                                         f"(it has: {', '.join(sorted(have))}; or all-linear)")


def base_of(adapter_folder: str | Path) -> str | None:
    """The base model an adapter folder was trained on, as its config names it."""
    return json.loads((Path(adapter_folder) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
