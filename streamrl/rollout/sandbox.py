"""`tools.python`: the model's Python code, run in a sandbox, one fresh process tree per call.

    tool = PythonTool(cfg.tools.python)      ToolBox makes it when tools.python.enabled
    await tool.run("print(2 + 2)")           -> "4\\n"; a failure raises ToolError(cause, ...)

Each call is a launcher (rollout/sandbox_launch.py: the run's own interpreter, standard library
only) forked by the tool's fork server (rollout/sandbox_server.py) into a session of its own; the
tool reads at most `max_output_bytes` of its stdout and stderr together from one pipe, and kills the
session when it has ended, run out of time or written too much. The launcher makes the isolation
(namespaces, an unprivileged uid, rlimits); what this kernel allows is found once per process by
starting it (`probe`). docs/environments.md says what holds by which mechanism.

Knows nothing of episodes or tokens: code in, text out, or a ToolError that says why.
"""

from __future__ import annotations

import asyncio
import functools
import json
import marshal
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..config import ConfigError
from ..config.schema import PythonToolConfig
from .sandbox_launch import NOBODY, SETUP_FAILED
from .sandbox_server import LAUNCH_ENV, LAUNCHER, ForkServer, kill_session
from .tool_error import ToolError

_EXCEPTION = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")
MAX_CODE_BYTES = 100_000  # one argv string may hold 128 KiB (MAX_ARG_STRLEN)

PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run Python 3 code (standard library only) in a fresh sandbox and return what it printed "
            "(stdout and stderr). No input; a private working directory; nothing is kept between calls."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program; print what you need to see"}},
            "required": ["code"],
        },
    },
}


@dataclass(frozen=True)
class Isolation:
    """What the sandbox is made of here: `namespaces` (user, mount, PID, IPC and, with
    `network_namespace`, network namespaces) or `rlimits` (rlimits, seccomp and an audit hook only);
    `reason`: why not stronger."""

    mode: Literal["namespaces", "rlimits"]
    network_namespace: bool
    reason: str = ""


def interpreter() -> tuple[str, str]:
    """The run's own Python (its installation's, not a venv's link or copy: the code gets no venv)
    and the installation's prefix."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable)), sys.base_prefix


def _launch_sync(settings: dict[str, Any], code: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a short run, for the probe."""
    with subprocess.Popen([settings["python"], "-I", "-S", str(LAUNCHER), encode_settings(settings), code],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=LAUNCH_ENV, start_new_session=True, cwd="/") as p:
        try:
            out, err = p.communicate(timeout=30)
        finally:
            kill_session(p.pid)
    return p.returncode, out, err


@functools.cache
def probe() -> Isolation:
    """Start the sandbox on `print('ok')`, with a network namespace, then without: the strongest that
    works. Once per process."""
    python, prefix = interpreter()
    base = {"mode": "namespaces", "cpu_s": 5, "memory_mb": 256, "max_processes": 4, "max_file_mb": 1,
            "python": python, "prefix": prefix}
    reasons = []
    for network in (False, True):
        try:
            rc, out, err = _launch_sync(base | {"network": network}, "print('ok')")
        except (OSError, subprocess.TimeoutExpired) as e:
            reasons.append(f"{type(e).__name__}: {e}")
            continue
        if rc == 0 and out == "ok\n":
            return Isolation("namespaces", not network, "; ".join(reasons))
        reasons.append((err.strip().splitlines() or [f"exit status {rc}"])[-1])
    return Isolation("rlimits", False, "; ".join(reasons))


def _runnable_by_others(path: str) -> bool:
    """Whether every folder above `path` lets any user through, and `path` lets any user run it."""
    p = Path(path)
    return all(d.stat().st_mode & 0o001 for d in p.parents) and bool(p.stat().st_mode & 0o001)


def code_of(args: str) -> str:
    """The code of a call: the text as written, or an OpenAI-style arguments object `{"code": ...}`
    (PYTHON_TOOL's parameters)."""
    text = args.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            return args
        if isinstance(obj, dict) and set(obj) == {"code"} and isinstance(obj["code"], str):
            return obj["code"]
    return args


class PythonTool:
    """The `python` tool of a run. `isolation` and `python` are the probe's and the run's own
    interpreter unless given (a test runs the weaker mode on purpose)."""

    schema = PYTHON_TOOL

    def __init__(self, cfg: PythonToolConfig, *, isolation: Isolation | None = None,
                 python: tuple[str, str] | None = None) -> None:
        """ConfigError (one line, naming the key) where this machine cannot give what `cfg` asks."""
        self.cfg = cfg
        self.isolation = iso = isolation or probe()
        self.python, self.prefix = python or interpreter()
        self.server = ForkServer(self.python)  # started by the first call
        if cfg.network == "none" and not iso.network_namespace:
            raise ConfigError("tools.python.network", "'none' needs a network namespace, which this machine does "
                              f"not give ({iso.reason or 'user namespaces refused'}); 'allowed' runs the code "
                              "with the host's network")
        if iso.mode == "rlimits" and os.getuid() == 0 and not _runnable_by_others(self.python):
            # Without a user namespace the code must run as an unprivileged uid (RLIMIT_NPROC does not
            # bind root), which needs an interpreter every user may run.
            raise ConfigError("tools.python", f"without user namespaces ({iso.reason}) the code runs as nobody, "
                              f"who cannot run {self.python}: install Python outside a private folder")

    def settings(self, workdir: str | None) -> dict[str, Any]:
        c = self.cfg
        return {"mode": self.isolation.mode, "network": c.network == "allowed", "cpu_s": c.cpu_s,
                "memory_mb": c.memory_mb, "max_processes": c.max_processes, "max_file_mb": c.max_file_mb,
                "python": self.python, "prefix": self.prefix, "workdir": workdir}

    async def run(self, args: str) -> str:
        """Run the code once; returns what it printed, or raises ToolError (its cause, what it printed)."""
        code = code_of(args)
        if len(code.encode()) > MAX_CODE_BYTES:
            raise ToolError("too_long", f"code longer than {MAX_CODE_BYTES} bytes")
        workdir = None
        if self.isolation.mode == "rlimits":  # with namespaces the code's /tmp is a tmpfs of its own
            workdir = tempfile.mkdtemp(prefix="streamrl-python-")
            if os.getuid() == 0:
                os.chown(workdir, NOBODY, NOBODY)
        try:
            rc, out, cause = await self._launch(code, workdir)
        finally:
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
        limit = self.cfg.max_output_bytes
        text = out[:limit].decode(errors="replace") + (f"\n[output cut at {limit} bytes]" if len(out) > limit else "")
        verdict = self._verdict(rc, text, cause)
        if verdict is not None:
            raise ToolError(verdict[0], verdict[1], text)
        return text

    async def _launch(self, code: str, workdir: str | None) -> tuple[int, bytes, str | None]:
        """(exit status, output, `timeout` / `output_limit` / None). The whole session is killed on the
        way out, whatever happened (a cancelled call too)."""
        loop = asyncio.get_running_loop()
        r, w = os.pipe()
        reader = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(r, "rb", buffering=0))
        pid, rc, out, cause = None, 0, bytearray(), None
        try:
            try:
                pid = await self.server.start(self.settings(workdir), code, w)
            finally:
                os.close(w)
            async with asyncio.timeout(self.cfg.timeout_s):
                # EOF comes when every process holding the pipe is gone, the launcher last: with
                # namespaces, the code's processes die with their PID namespace.
                while chunk := await reader.read(1 << 16):
                    out += chunk
                    if len(out) > self.cfg.max_output_bytes:
                        cause = "output_limit"
                        break
        except TimeoutError:
            cause = "timeout"
        finally:
            transport.close()
            if pid is not None:
                kill_session(pid)  # before the launcher is reaped: its pid cannot be another's yet
                rc = await self.server.wait(pid)
        return rc, bytes(out), cause

    async def aclose(self) -> None:
        """Stop the fork server (and any call still running)."""
        await self.server.aclose()

    def _verdict(self, rc: int, text: str, cause: str | None) -> tuple[str, str] | None:
        """(cause, message) of a failed run; None for one that succeeded."""
        c = self.cfg
        if cause == "timeout":
            return cause, f"timed out after {c.timeout_s:g} s"
        if cause == "output_limit":
            return cause, f"more than {c.max_output_bytes} bytes of output"
        if rc == 0:
            return None
        lines = text.strip().splitlines()
        if rc == SETUP_FAILED and lines and lines[-1].startswith("sandbox setup failed"):
            return "sandbox", lines[-1]
        sig = -rc if rc < 0 else rc - 128 if rc > 128 else 0
        if sig == signal.SIGXCPU:
            return "cpu", f"CPU time over {c.cpu_s} s"
        if sig:
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            return "killed", f"killed by {name}"
        # The last exception line, not the last line: processes dying at once interleave their output.
        last = next((line for line in reversed(lines) if _EXCEPTION.match(line)), "")
        if last.startswith("MemoryError"):
            return "memory", f"out of memory ({c.memory_mb} MiB)"
        if "[Errno 27]" in last or "[Errno 28]" in last:  # EFBIG, ENOSPC
            return "file_size", f"files over {c.max_file_mb} MiB"
        if last.startswith("BlockingIOError") and "[Errno 11]" in last or "can't start new thread" in last:
            return "processes", f"more than {c.max_processes} processes and threads"
        if "[Errno 101]" in last:  # ENETUNREACH: its network namespace has no route anywhere
            return "network", "no network"
        return "exit_code", f"exit code {rc}"


def encode_settings(settings: dict[str, Any]) -> str:
    """The launcher's settings as it reads them without importing json: marshal (the same interpreter)."""
    return marshal.dumps(settings).hex()
