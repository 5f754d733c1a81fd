"""The code tool's fork server, seen from the run: one `sandbox_launch.py --serve` process per
PythonTool, started at its first call, so a call forks a warm interpreter instead of starting two.

    server = ForkServer(python)
    pid = await server.start(settings, code, out_fd)   the call's launcher, in a session of its own
    status = await server.wait(pid)                    after the caller has killed that session
    await server.aclose()                              the server kills the calls still running, exits

Requests and answers go one at a time over a SOCK_SEQPACKET socket pair (a request is one message,
its output pipe's write end passed with it). A caller cancelled between request and answer still
takes its answer, so the next caller never reads another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import marshal
import os
import signal
import socket
import struct
import subprocess
from pathlib import Path
from typing import Any

from .sandbox_launch import MAX_REQUEST
from .tool_error import ToolError

LAUNCHER = Path(__file__).with_name("sandbox_launch.py")
LAUNCH_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # the launcher's; the code gets its own


class ForkServer:
    """Bound to the event loop of the call that started it; a call from another loop (a test's next
    one) starts a new server, and the old one exits as its socket closes."""

    def __init__(self, python: str) -> None:
        self.python = python
        self._proc: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        """The server's process, while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def start(self, settings: dict[str, Any], code: str, out_fd: int) -> int:
        """The pid (and session) of a new launcher running `code` with `settings`, its stdout and
        stderr `out_fd` (the caller closes its own copy)."""
        return await self._ask(b"R" + marshal.dumps((settings, code)), out_fd)

    async def wait(self, pid: int) -> int:
        """The exit status of launcher `pid` (a signal N as 128 + N), once it has exited."""
        return await self._ask(b"W" + struct.pack("!i", pid))

    async def _ask(self, msg: bytes, fd: int | None = None) -> int:
        exchange = asyncio.ensure_future(self._exchange(msg, fd))
        try:
            return await asyncio.shield(exchange)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                pid = await exchange  # the answer is ours to read, and a launcher ours to stop
                if msg[:1] == b"R":
                    kill_session(pid)
                    await self._exchange(b"W" + struct.pack("!i", pid), None)
            raise

    async def _exchange(self, msg: bytes, fd: int | None) -> int:
        if self._loop is not asyncio.get_running_loop():
            self._close_socket()
            self._proc, self._loop, self._lock = None, asyncio.get_running_loop(), asyncio.Lock()
        async with self._lock:
            sock = await self._connect()
            try:
                socket.send_fds(sock, [msg], [fd] if fd is not None else [])
                answer = await asyncio.get_running_loop().sock_recv(sock, 4)
            except OSError as e:
                answer, why = b"", f"{type(e).__name__}: {e}"
            else:
                why = f"exit status {self._proc.returncode if self._proc else None}"
            if len(answer) != 4:
                self._close_socket()
                raise ToolError("sandbox", f"the sandbox's fork server is gone ({why})")
            return int(struct.unpack("!i", answer)[0])

    async def _connect(self) -> socket.socket:
        if self._sock is not None and self._proc is not None and self._proc.returncode is None:
            return self._sock
        self._close_socket()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MAX_REQUEST)
            theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2 * MAX_REQUEST)
            self._proc = await asyncio.create_subprocess_exec(
                self.python, "-I", "-S", str(LAUNCHER), "--serve", str(theirs.fileno()),
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                env=LAUNCH_ENV, start_new_session=True, cwd="/")  # a Ctrl-C reaches the run, which closes it
        ours.setblocking(False)
        self._sock = ours
        return ours

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()  # the server reads the end of its requests: it stops its calls and exits
            self._sock = None

    async def aclose(self) -> None:
        self._close_socket()
        if self._loop is not asyncio.get_running_loop():  # its process is another loop's to wait for
            proc, self._proc = self._proc, None
            await _gone(proc.pid if proc is not None else None)
            return
        async with self._lock:
            if self._proc is not None and self._proc.returncode is None:
                try:
                    await asyncio.wait_for(self._proc.wait(), 5)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        self._proc.kill()
                    await self._proc.wait()
            self._proc = None

    def __del__(self) -> None:  # a tool never closed: the server still sees its socket close
        self._close_socket()


async def _gone(pid: int | None, timeout: float = 5) -> None:
    """Until process `pid` has exited (and been reaped by the watcher of the loop that started it)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while pid is not None and asyncio.get_running_loop().time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        await asyncio.sleep(0.01)


def kill_session(sid: int) -> None:
    """SIGKILL to process group `sid` (the launcher's session). Its init is in it, and the kernel
    kills a PID namespace with its init: code that left the group dies too."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(sid, signal.SIGKILL)
