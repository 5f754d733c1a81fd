"""Workflows and tools used by the workflow tests (a random model never calls a tool on its own)."""

from __future__ import annotations

import asyncio
from typing import Any

CALLS: list[str] = []  # every call of `count`, in order


def count(args: str) -> str:
    """A tool that remembers it ran: a second run of one call would show here."""
    CALLS.append(args)
    return str(len(CALLS) % 10)


async def slow(args: str) -> str:
    await asyncio.sleep(10)
    return "late"


def broken(args: str) -> str:
    raise RuntimeError("the tool's backend is down")


async def two_turns(record: dict[str, Any], episode: Any) -> None:
    """A short model turn, one tool call, a long model turn (40 tokens, EOS ignored)."""
    await episode.generate(max_new_tokens=4, ignore_eos=True)
    await episode.call_tool("count", f"{episode.sample.group_id}-{episode.sample.index}")
    await episode.generate(max_new_tokens=40, ignore_eos=True)
