"""Child-process helpers shared by everything streamrl launches (engine servers, sglang-router, vLLM)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
