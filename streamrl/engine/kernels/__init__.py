"""CPU kernels the embedded engine compiles on first use (C++ through torch's extension loader).

`decode_attention()` returns the compiled decode-attention op, or None where it cannot be built (no
C++ compiler, not Linux/macOS, `STREAMRL_CPU_KERNELS=0`); the engine then uses PyTorch's SDPA, which
gives the same numbers more slowly. The build takes ~30 s once per machine and is cached under
torch's extension folder (`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`), one
subfolder per source, CPU, torch and Python version; `scripts/setup.sh` builds it ahead.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("decode_attention.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno"]
BLOCK = 16  # key positions per cache block (kBlock in the kernel)


def _build_dir(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    out = Path(root) / name
    out.mkdir(parents=True, exist_ok=True)
    return out


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """The build folder to this process alone. torch's loader serialises builds with a lock *file* and
    waits for it forever, so a build killed midway (Ctrl-C on a first run, an OOM kill) would block
    every later one. Builders here first take an flock, which the kernel drops with its process, however
    it ends: whoever holds it is the only builder alive, so a torch lock file still there is a dead
    build's, removed (and said so). A wait for a live build says so once; a signal ends it."""
    with (build_dir / "streamrl.lock").open("a") as f:
        told = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    log.warning("streamrl: waiting for another process building the CPU kernel in %s", build_dir)
                    told = True
                time.sleep(0.2)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("streamrl: removing the lock of an interrupted kernel build (%s)", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cpu_signature() -> str:
    """The build uses -march=native, so a cached build belongs to one CPU model and flag set."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name", "Features")):
                flags += line
    except OSError:
        pass
    return platform.machine() + flags


@functools.cache
def decode_attention() -> Any | None:
    if os.environ.get("STREAMRL_CPU_KERNELS", "1") == "0":
        return None
    try:
        import torch
        from torch.utils import cpp_extension

        try:  # the `ninja` wheel puts its binary in the venv, which is not always on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
        src = _SOURCE.read_bytes()
        # A cached build belongs to one source, CPU, torch, Python (the module's ABI) and flag set.
        key = src + f"{_cpu_signature()}|{torch.__version__}|{sys.version_info[:2]}|{_CFLAGS}".encode()
        tag = hashlib.sha1(key).hexdigest()[:12]
        name = f"streamrl_decode_attention_{tag}"
        build_dir = _build_dir(name)
        with build_lock(build_dir):
            mod = cpp_extension.load(name=name, sources=[str(_SOURCE)], build_directory=str(build_dir),
                                     extra_cflags=_CFLAGS, verbose=False)
        return mod.decode_attention
    except Exception as e:  # noqa: BLE001 - any build failure means: use the PyTorch path (a signal is no Exception)
        log.warning("streamrl: CPU decode-attention kernel unavailable (%s); using PyTorch SDPA",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def block_keys(k: Any) -> Any:
    """Keys [..., T, D] in the kernel's cache layout [..., ceil(T / 16), D, 16] (zero-padded)."""
    import torch.nn.functional as F

    t, d = k.shape[-2], k.shape[-1]
    nb = -(-t // BLOCK)
    k = F.pad(k, (0, 0, 0, nb * BLOCK - t))
    return k.reshape(*k.shape[:-2], nb, BLOCK, d).transpose(-1, -2)
