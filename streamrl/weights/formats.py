"""The two forms weights travel in between processes: a safetensors folder, and one flat byte array.

- **Folder** (`save_folder` / `load_folder`): what SGLang's and vLLM's `update_weights_from_disk` read,
  and what `streamrl serve` reads. Every name of the state dict is written, tied `lm_head.weight`
  included: vLLM on CPU keeps a tied head as its own tensor and reloads it only when the file names it.
- **Flat array** (`pack` / `unpack`): one byte array plus a table of (name, dtype, shape, offset,
  nbytes). Ray stores a numpy array in its object store without pickling the data, and a reader on the
  same node maps it without a copy; a dict of torch tensors is pickled tensor by tensor instead. The
  reader rebuilds views into the array, so nothing is allocated per tensor.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads with the first call: importing the pools must not pull it in
    import numpy as np
    import torch

_ALIGN = 16  # bytes: the widest element size among torch dtypes (complex128)
WEIGHTS_FILE = "model.safetensors"

Table = list[tuple[str, str, tuple[int, ...], int, int]]


def save_folder(named_tensors: Any, folder: Path) -> Path:
    """The tensors as `folder/model.safetensors` (tied tensors written under each of their names)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in dict(named_tensors).items()}
    # Tied weights share storage; safetensors refuses shared tensors, and the engine copies both names.
    seen: set[int] = set()
    for k in list(tensors):
        ptr = tensors[k].data_ptr()
        if ptr in seen:
            tensors[k] = tensors[k].clone()
        seen.add(ptr)
    save_file(tensors, str(folder / WEIGHTS_FILE))
    return folder


def load_folder(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the `*.safetensors` files directly in `folder` (a model folder, sharded or not).

    `folder` is a path, never a pattern: a name with glob characters is read literally."""
    from safetensors.torch import load_file

    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"{str(folder)!r} is not a folder")
    files = sorted(p for p in path.iterdir() if p.suffix == ".safetensors" and p.is_file())
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(folder)!r}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def pack(named_tensors: Any) -> tuple[Table, np.ndarray]:
    import torch

    table: Table = []
    parts: list[torch.Tensor] = []
    offset = 0
    for name, t in dict(named_tensors).items():
        pad = -offset % _ALIGN  # a view as dtype D must start at a multiple of D's size
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8))
            offset += pad
        flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        table.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    data = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return table, data.numpy()


def unpack(table: Table, data: np.ndarray) -> dict[str, torch.Tensor]:
    """Views into `data` (read-only when it comes from the object store: copy before writing)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": the views are only read
        base = torch.from_numpy(data)
    return {
        name: base[off:off + n].view(getattr(torch, dtype)).view(shape)
        for name, dtype, shape, off, n in table
    }
