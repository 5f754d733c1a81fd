"""Tools a workflow's model may call: loading them from `tools.functions`, and running one call.

A tool is a plain Python function (sync or async) of one string, the arguments as the model wrote
them, that returns the observation as text. A call that raises or runs past `tools.timeout_s` is
not a failed sample: its observation is the error, the model sees it, and the sample goes on.
Sync tools run in a thread, so a slow one does not stop generation on the event loop.

Built in: `calculator`, exact integer arithmetic on `+ - *` and parentheses (no names, no calls:
the expression is parsed, never evaluated as Python).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import ToolsConfig
from ..plugins import load_plugin

_OPS: dict[type, Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """`12*(3+4)` -> `84`: integers, + - * and parentheses; anything else is a ValueError."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if max(abs(a), abs(b)) > 10**18:
                raise ValueError("number too large")
            return _OPS[type(node.op)](a, b)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"not arithmetic: {expression!r}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not arithmetic: {expression!r}") from None
    return str(ev(tree))


BUILTIN: dict[str, Callable[[str], Any]] = {"calculator": calculator}


@dataclass
class ToolResult:
    observation: str
    error: str | None  # None when the tool returned
    seconds: float


class ToolBox:
    """The tools of one run, by name, from `tools.*`."""

    def __init__(self, cfg: ToolsConfig) -> None:
        """PluginError when a tool cannot be loaded."""
        self.cfg = cfg
        self.tools: dict[str, Callable[[str], Any]] = {}
        for spec in cfg.functions:
            name, eq, target = spec.partition("=")
            self.tools[name] = load_plugin(target if eq else name, "tool", None if eq else BUILTIN)

    async def call(self, name: str, args: str) -> ToolResult:
        """Run one call; every failure becomes an error observation, never an exception."""
        t0 = time.perf_counter()
        fn = self.tools.get(name)
        try:
            if fn is None:
                raise LookupError(f"no tool named {name!r} (tools: {', '.join(self.tools)})")
            async with asyncio.timeout(self.cfg.timeout_s):
                out = await fn(args) if inspect.iscoroutinefunction(fn) else await asyncio.to_thread(fn, args)
            return ToolResult(str(out), None, time.perf_counter() - t0)
        except TimeoutError:
            error = f"timed out after {self.cfg.timeout_s:g} s"
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation, not a crash
            error = f"{type(e).__name__}: {e}"
        return ToolResult(f"error: {error}", error, time.perf_counter() - t0)
