"""Weight transport from the trainer to the engines: the forms weights travel in (`formats`), the
collective broadcast (`broadcast`), and the `WeightSync` every pool pushes through (`sync`).

Both sides live here: a pool's sync sends, an engine (or its HTTP server, or its Ray replica) reads
with `load_folder`, `unpack` or `receive`. Torch is imported by the submodules that need it.
"""

from .broadcast import BroadcastSender, join_group, receive
from .formats import load_folder, pack, save_folder, unpack
from .lora import Adapter, Merger, is_adapter, load_adapter, save_adapter
from .sync import BroadcastSync, DiskSync, InProcessSync, ObjectStoreSync, WeightSync

__all__ = [
    "Adapter", "Merger", "is_adapter", "load_adapter", "save_adapter",
    "BroadcastSender", "BroadcastSync", "DiskSync", "InProcessSync", "ObjectStoreSync", "WeightSync", "join_group",
    "load_folder", "pack", "receive", "save_folder", "unpack",
]
