"""Process helpers: stopping the children streamrl launches (engine servers, sglang-router, vLLM), the
Python of a side environment (`find_side_python`), free ports, the driver's own garbage-collection policy (`quiet_gc`), and running a command's coroutine so
that a signal stops it at any point (`run_stoppable`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


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


def find_side_python(explicit: str | None, env_var: str, venv: str) -> str | None:
    """The Python of a side environment (vLLM's, verifiers'; packages that cannot share .venv): `explicit`
    (only it, when given), else $`env_var`, else `venv/bin/python` in the working folder or beside this
    checkout. A path must be an executable file, a bare name on PATH. None when none exists."""
    here = Path(__file__).resolve().parents[1]
    cands = [explicit] if explicit else [os.environ.get(env_var), f"{venv}/bin/python", str(here / venv / "bin" / "python")]
    for cand in cands:
        if cand and ((Path(cand).is_file() and os.access(cand, os.X_OK)) or (os.sep not in cand and shutil.which(cand))):
            return cand
    return None


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


def run_stoppable(coro: Coroutine[Any, Any, T], *, on_stop: Callable[[], None] | None = None) -> T:
    """Run `coro` to its end on a (uv)loop; SIGINT and SIGTERM stop it within seconds at any point of
    its life. While the loop waits, the first signal calls `on_stop` (default: cancel `coro`, whose
    cleanup then runs: engine servers, routers, the trainer). While synchronous work holds the loop in
    `coro`'s own task (a warm start, a model load, a kernel build), where nothing would read the
    signal before that work ends, KeyboardInterrupt is raised right there and unwinds it the same way.
    A signal during the cleanup is ignored, so it runs to its end. A cancelled `coro` raises
    KeyboardInterrupt."""

    async def guarded() -> T:
        task = asyncio.ensure_future(coro)
        loop = asyncio.get_running_loop()
        signalled: list[int] = []

        def on_signal(sig: int, frame: Any) -> None:
            if signalled:
                return
            signalled.append(sig)
            if asyncio.current_task(loop) is task:
                raise KeyboardInterrupt
            loop.call_soon_threadsafe(on_stop or task.cancel)

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return await task
        except asyncio.CancelledError:
            if signalled and task.cancelled():  # stopped by the signal (not the loop's own shutdown)
                raise KeyboardInterrupt from None
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    try:  # only the import is guarded: an ImportError raised by the run itself is the run's error
        import uvloop
    except ImportError:
        return asyncio.run(guarded())
    return uvloop.run(guarded())
