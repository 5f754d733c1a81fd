"""Process helpers: stopping the children streamrl launches (engine servers, sglang-router, vLLM), free
ports, and the driver's own garbage-collection policy (`quiet_gc`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from pathlib import Path


class EngineStartError(RuntimeError):
    """A server streamrl launched did not come up; the message says why and where its log is."""


async def terminate_group(proc: asyncio.subprocess.Process | None, grace: float) -> None:
    """SIGTERM to the child's whole process group, then SIGKILL after `grace` seconds.

    The group matters: `python -m sglang_router.launch_router` runs the router as a grandchild
    ("sglang::router"), and vLLM forks an engine-core process; both would outlive a signal sent to
    their parent alone. Children must be started with `start_new_session=True`.
    """
    if proc is None:
        return

    def signal_group(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    if proc.returncode is None:
        signal_group(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            signal_group(signal.SIGKILL)
            await proc.wait()
    signal_group(signal.SIGKILL)  # stragglers in the group once the leader is gone
    # SIGKILL is delivered asynchronously: on a loaded machine a straggler can still be running
    # when this returns, and a caller that exits right after would leave it behind for a moment.
    for _ in range(100):
        if not _live_members(proc.pid):
            break
        await asyncio.sleep(0.02)


def _live_members(pgid: int) -> bool:
    """Whether process group `pgid` still has a member that is not a zombie (Linux /proc; elsewhere
    whether the group exists at all)."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command name: state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def quiet_gc() -> None:
    """Collect less in a process that holds many live records (every sample in flight and queued).

    What exists now (torch, transformers, the models: millions of objects that never die) leaves the
    collector's walks, and young objects are collected every 10,000 allocations instead of 700: with
    tens of thousands of samples in flight, each of a handful of lists, the default thresholds make
    the collector the driver's largest cost (docs/benchmarks.md, bench/overhead.py)."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
