"""Workflows of the MCP run tests (tests/test_mcp_tools.py): a random model never calls a tool, so they
call the MCP calculator's `multiply` themselves, on the prompt's numbers."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

KILL_AT = 24  # after the held-out evaluation before RL (16 calls with data.eval_size=8): mid-training
_calls = [0]


def server_pids(parent: int, needle: bytes = b"mcp_calculator_server.py") -> list[int]:
    """The live child processes of `parent` whose command line mentions `needle` (a killed one, not yet
    reaped, has an empty command line)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and needle in cmdline:
            found.append(int(proc.name))
    return found


async def multiply(record: dict[str, Any], episode: Any) -> None:
    """A model turn, the MCP server's `multiply` on the prompt's numbers, a model turn."""
    await episode.generate(max_new_tokens=2, ignore_eos=True)
    a, b = record["prompt"].rstrip("=").split("*")
    await episode.call_tool("multiply", json.dumps({"a": int(a), "b": int(b)}))
    await episode.generate(max_new_tokens=2, ignore_eos=True)


async def multiply_killing_the_server(record: dict[str, Any], episode: Any) -> None:
    """`multiply`, but the KILL_AT-th call first kills the server with SIGKILL, as a crash would."""
    _calls[0] += 1
    if _calls[0] == KILL_AT:
        for pid in server_pids(os.getpid()):
            os.kill(pid, signal.SIGKILL)
    await multiply(record, episode)
