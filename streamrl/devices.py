"""`auto` resolved to a device, the same way for engines and trainer."""

from __future__ import annotations


def resolve_device(device: str) -> str:
    """`auto` is cuda when a GPU is visible, else cpu; anything else is returned as given."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
