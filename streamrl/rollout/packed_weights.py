"""Weights as one flat byte array plus a table of (name, dtype, shape, offset, nbytes).

Ray stores a numpy array in its object store without pickling the data, and a reader on the same node
maps it without a copy; a dict of torch tensors is pickled tensor by tensor instead (about 10x slower
for the quickstart model here). The replica rebuilds views into the array and copies them into its
parameters, so nothing is allocated per tensor.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

_ALIGN = 16  # bytes: the widest element size among torch dtypes (complex128)

Table = list[tuple[str, str, tuple[int, ...], int, int]]


def pack(named_tensors: Any) -> tuple[Table, np.ndarray]:
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": the views are only read
        base = torch.from_numpy(data)
    return {
        name: base[off:off + n].view(getattr(torch, dtype)).view(shape)
        for name, dtype, shape, off, n in table
    }
