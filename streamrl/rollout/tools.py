"""Tools a workflow's model may call: loading them from `tools.functions`, and running one call.

A tool is a plain Python function (sync or async) of one string, the arguments as the model wrote
them, that returns the observation as text. A call that raises or runs past `tools.timeout_s` is
not a failed sample: its observation is the error, the model sees it, and the sample goes on.
Sync tools run in a thread, so a slow one does not stop generation on the event loop.
The tools of MCP servers (`tools.mcp`, rollout/mcp_tools.py) join them once `start()` has started
the servers, for the run's life (`aclose()`); their arguments are a JSON object.

Built in: `calculator`, exact integer arithmetic on `+ - *` and parentheses (no names, no calls:
the expression is parsed, never evaluated as Python).
`python` (tools.python.enabled): the model's code in a sandbox, rollout/sandbox.py.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import ConfigError, ToolsConfig
from ..plugins import load_plugin
from .tool_error import ToolError

if TYPE_CHECKING:
    from .mcp_tools import McpServers
    from .sandbox import PythonTool

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
    cause: str | None = None  # why it failed, one word (timeout, exception, memory, ...): tool_errors/CAUSE


class ToolBox:
    """The tools of one run, by name, from `tools.*`."""

    def __init__(self, cfg: ToolsConfig) -> None:
        """PluginError when a tool cannot be loaded; ConfigError when tools.python asks for what this
        machine cannot give."""
        self.cfg = cfg
        self.tools: dict[str, Callable[[str], Any]] = {}
        for spec in cfg.functions:
            name, eq, target = spec.partition("=")
            self.tools[name] = load_plugin(target if eq else name, "tool", None if eq else BUILTIN)
        self.python: PythonTool | None = None  # tools.python's sandbox
        if cfg.python.enabled:
            from .sandbox import PythonTool  # its probe starts processes: only runs that use it

            if "python" in self.tools:
                raise ConfigError("tools.python.enabled", "tools.functions already has a tool named python")
            self.python = PythonTool(cfg.python)
            self.tools["python"] = self.python.run
        self.mcp: McpServers | None = None  # tools.mcp's servers, once `start` has started them

    async def call(self, name: str, args: str) -> ToolResult:
        """Run one call; every failure becomes an error observation, never an exception."""
        t0 = time.perf_counter()
        fn = self.tools.get(name)
        try:
            if fn is None:
                raise LookupError(f"no tool named {name!r} (tools: {', '.join(self.tools)})")
            # An MCP call times itself (tools.mcp[i].timeout_s): restarting its server is not the call's time.
            timeout = None if self.mcp is not None and name in self.mcp.tools else self.cfg.timeout_s
            if self.python is not None and name == "python":
                timeout = None  # the sandbox times itself (tools.python.timeout_s) and kills what it started
            async with asyncio.timeout(timeout):
                out = await fn(args) if inspect.iscoroutinefunction(fn) else await asyncio.to_thread(fn, args)
            return ToolResult(str(out), None, time.perf_counter() - t0)
        except ToolError as e:
            text = f"error: {e.message}" + (f"\n{e.output}" if e.output else "")
            return ToolResult(text, e.message, time.perf_counter() - t0, e.cause)
        except TimeoutError as e:
            error, cause = str(e) or f"timed out after {self.cfg.timeout_s:g} s", "timeout"
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation, not a crash
            error, cause = f"{type(e).__name__}: {e}", "exception"
        return ToolResult(f"error: {error}", error, time.perf_counter() - t0, cause)

    async def start(self, log_dir: Path | None = None) -> None:
        """Start the MCP servers of `tools.mcp` (rollout/mcp_tools.py) and add their tools; each server's
        stderr goes to `log_dir/mcp-NAME.log`. A ConfigError naming the key when one does not start or
        serves a name another tool has. Nothing to do without `tools.mcp`."""
        if self.cfg.mcp and self.mcp is None:
            from .mcp_tools import McpServers  # the mcp SDK is imported only by runs that use it

            self.mcp = McpServers(self.cfg, log_dir=log_dir)
            await self.mcp.start(taken=self.tools)
            self.tools |= self.mcp.tools

    async def aclose(self) -> None:
        """Stop the MCP servers and the code tool's fork server (safe to call again, or before `start`)."""
        if self.mcp is not None:
            await self.mcp.aclose()
        if self.python is not None:
            await self.python.aclose()

    def openai_tools(self) -> list[dict[str, Any]]:
        """The MCP tools (and `python`, where enabled) in the OpenAI function-tool format, for an agent's
        `tools=`; call them with `call(name, arguments_json)`."""
        return ([self.python.schema] if self.python is not None else []) + (
            self.mcp.openai_tools() if self.mcp is not None else [])
