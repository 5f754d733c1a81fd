"""SGLangServer: one real SGLang HTTP server (`python -m sglang.launch_server`) as a child process.

UNVERIFIED HERE against a real SGLang (sglang needs a CUDA build and is not installed on the machines
this was written on); the command line, readiness wait and shutdown are tested with stand-in processes.

    server = SGLangServer("path/to/model", port=30000, extra_args=["--mem-fraction-static", "0.5"])
    url = await server.start()          # waits for GET /health_generate -> 200
    pool = HttpPool(urls=[url])         # or HttpPool(launch=[server]): it calls start() / stop() itself
    ...
    await server.stop()                 # SIGTERM to the server's process group, SIGKILL after a grace

`start()` / `stop()` have the same shape as `streamrl.rollout.http_pool.ServerProcess`, so a list of
SGLangServer can be handed to `HttpPool(launch=...)`. The server listens on 127.0.0.1 only; its output
goes to a log file (`log_path`), whose tail is quoted in every start-up error.

Readiness: SGLang's `GET /health_generate` answers 200 only once the engine has produced a token (503 or
no listener before that), per SGLang's http_server.py; `GET /health` is up earlier, so it is not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp


class SGLangLaunchError(RuntimeError):
    """The SGLang server did not become healthy (missing sglang, early exit, or timeout)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def build_command(
    model_path: str, port: int, extra_args: Sequence[str] = (), *, host: str = "127.0.0.1",
    python: str | None = None,
) -> list[str]:
    """`python -m sglang.launch_server --model-path M --host H --port P [extra args]`.

    `--model-path`, `--host` and `--port` belong to the launcher; passing them in `extra_args` is an
    error rather than a silent override.
    """
    owned = {"--model-path", "--model", "--host", "--port"}
    clash = [a for a in extra_args if a.split("=", 1)[0] in owned]
    if clash:
        raise ValueError(f"extra_args must not set {clash}: model path, host and port are the launcher's")
    return [
        python or sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_path), "--host", host, "--port", str(int(port)),
        *[str(a) for a in extra_args],
    ]


def _tail(path: Path | None, n: int = 2000) -> str:
    if path is None:
        return "(no log)"
    try:
        data = path.read_bytes()[-n:]
    except OSError:
        return "(no log)"
    return data.decode(errors="replace").strip() or "(empty log)"


class SGLangServer:
    """A `python -m sglang.launch_server` child on 127.0.0.1 (a free port when `port` is None or 0)."""

    def __init__(
        self,
        model_path: str,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        *,
        python: str | None = None,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        stop_grace: float = 30.0,
    ) -> None:
        self.host = "127.0.0.1"
        self.port = int(port) if port else free_port(self.host)
        self.python = python or sys.executable
        self.cmd = build_command(model_path, self.port, extra_args, host=self.host, python=self.python)
        self.url = f"http://{self.host}:{self.port}"
        self.log_path = Path(log_path) if log_path is not None else None  # a temp file, made by start()
        self.env = {**os.environ, **(env or {})}
        self.stop_grace = stop_grace
        self.proc: asyncio.subprocess.Process | None = None
        self._reaped = False

    async def __aenter__(self) -> SGLangServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _check_installed(self) -> None:
        # Only answerable for this interpreter; another `python` reports a missing sglang by exiting.
        if self.python == sys.executable and importlib.util.find_spec("sglang") is None:
            raise SGLangLaunchError(
                f"sglang is not installed for {sys.executable}: `python -m sglang.launch_server` needs a "
                "CUDA build of sglang (pass python= to use another environment)"
            )

    async def start(self, timeout: float = 900.0, poll_s: float = 1.0) -> str:
        """Start the server and wait until GET /health_generate answers 200; return its base URL."""
        if self.proc is not None and self.proc.returncode is None:
            return self.url
        self._check_installed()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"sglang-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        with self.log_path.open("ab") as log:
            # Own session = own process group: stop() signals the server and every process it spawned
            # (scheduler, detokenizer) without touching anything else.
            self.proc = await asyncio.create_subprocess_exec(
                *self.cmd, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=self.env,
                start_new_session=True,
            )
        self._reaped = False
        try:
            return await self._wait_healthy(timeout, poll_s)
        except BaseException:  # failed, timed out or cancelled: leave no server behind
            await self.stop()
            raise

    async def _wait_healthy(self, timeout: float, poll_s: float) -> str:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        probe = f"{self.url}/health_generate"
        async with aiohttp.ClientSession() as session:
            while True:
                if self.proc.returncode is not None:
                    code = self.proc.returncode
                    raise SGLangLaunchError(
                        f"SGLang server exited with status {code} before becoming healthy "
                        f"({' '.join(self.cmd)}); log {self.log_path}:\n{_tail(self.log_path)}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SGLangLaunchError(
                        f"SGLang server at {self.url} was not healthy (GET /health_generate) within "
                        f"{timeout:.0f} s; log {self.log_path}:\n{_tail(self.log_path)}"
                    )
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    t = aiohttp.ClientTimeout(total=max(0.1, min(10.0, left)))
                    async with session.get(probe, timeout=t) as resp:
                        if resp.status == 200:
                            return self.url
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.proc.wait(), max(0.01, min(poll_s, deadline - time.monotonic())))

    async def stop(self, grace: float | None = None) -> None:
        """SIGTERM to the server's process group; SIGKILL to whatever is left after `grace` seconds
        (default `stop_grace`)."""
        grace = self.stop_grace if grace is None else grace
        proc = self.proc
        if proc is None or self._reaped:
            return
        pgid = proc.pid  # start_new_session: the child leads its own group
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), grace)
        # The leader may be gone while its children (scheduler, detokenizer) linger: kill the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        await proc.wait()
        self._reaped = True  # its group id may be reused from now on: never signal it again
