"""MCP tools (`tools.mcp`): Model Context Protocol servers started over stdio with the `mcp` SDK for the
run's life, their tools called through the ToolBox like Python tools (rollout/tools.py).

    servers = McpServers(cfg.tools, log_dir=run_dir)
    await servers.start(taken)   every server spawned, initialized and its tools listed, side by side; a
                                 ConfigError naming tools.mcp[i].command when one does not start
    servers.tools                {name: async fn(args) -> observation}, args a JSON object as the model wrote it
    servers.openai_tools()       the same tools in the OpenAI function-tool format, for agents
    await servers.aclose()       every server stopped (stdin closed, then SIGTERM, SIGKILL: the SDK's shutdown)

A call raises on arguments that are not a JSON object, an error result (`isError`), a timeout, or a
server that cannot be reached; the ToolBox makes that the model's observation. A server that has gone
away is started again by the next call to it, and a call that found it gone is sent once more, to the
new one. Nothing here knows the rollout: names, JSON and text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable, Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TextIO

import anyio
from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client
from mcp.types import CONNECTION_CLOSED, CallToolResult, PaginatedRequestParams, Tool

from ..config import ConfigError, ToolsConfig
from ..config.schema import McpServerConfig
from .tool_error import ToolError

log = logging.getLogger("streamrl.mcp")

ToolFn = Callable[[str], Awaitable[str]]


class _Connection:
    """One spawned server and its session. The SDK's transport and session hold anyio cancel scopes, which
    must be left by the task that entered them: a task of their own enters them, waits to be closed, and
    leaves them."""

    def __init__(self, params: StdioServerParameters, errlog: Path | None) -> None:
        self.session: ClientSession | None = None
        self.tools: list[Tool] = []
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._closing = asyncio.Event()
        self._scope = anyio.CancelScope()  # cancelled only while starting: a started server is told goodbye
        self._task = asyncio.create_task(self._hold(params, errlog), name="mcp-server")

    async def _hold(self, params: StdioServerParameters, errlog: Path | None) -> None:
        try:
            with self._scope, ExitStack() as files:
                err: TextIO = files.enter_context(errlog.open("a")) if errlog is not None else sys.stderr
                async with stdio_client(params, errlog=err) as (read, write), ClientSession(read, write) as session:
                    await session.initialize()
                    self.tools = await _list_tools(session)
                    self.session = session
                    self._ready.set_result(None)
                    await self._closing.wait()
        except Exception as e:  # noqa: BLE001 - the opener reports it; later, calls find the connection gone
            if not self._ready.done():
                self._ready.set_exception(_leaf(e))
        finally:
            if not self._ready.done():
                self._ready.set_exception(ConnectionError("closed while starting"))

    async def opened(self, timeout: float) -> None:
        """Returns once the server has listed its tools; on any failure (a timeout too) it is closed."""
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._ready)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        self._closing.set()
        if not self._ready.done():
            self._scope.cancel()
        # Not gather: a closer that is cancelled must not cancel the SDK's shutdown, or the process leaks.
        await asyncio.wait([self._task])
        if not self._ready.cancelled():
            self._ready.exception()  # read, so a failure nobody waited for is not logged as never retrieved

    def lost(self, e: BaseException) -> bool:
        """Whether `e` says the connection is gone (the server exited), rather than that the call failed."""
        return (self._task.done() or isinstance(e, anyio.ClosedResourceError | anyio.BrokenResourceError)
                or (isinstance(e, MCPError) and e.code == CONNECTION_CLOSED))


class _Server:
    """One `tools.mcp` entry: its connection, opened again when the server has gone away."""

    def __init__(self, index: int, cfg: McpServerConfig, timeout_s: float, log_dir: Path | None) -> None:
        self.cfg, self.key, self.timeout_s = cfg, f"tools.mcp[{index}]", timeout_s
        # `python` is the run's own interpreter: it has the mcp SDK, however streamrl was started.
        exe = sys.executable if cfg.command[0] == "python" else cfg.command[0]
        self.params = StdioServerParameters(command=exe, args=cfg.command[1:], env=cfg.env or None, cwd=cfg.cwd)
        self.log_path = log_dir / f"mcp-{cfg.name}.log" if log_dir is not None else None
        self.tools: list[Tool] = []
        self.restarts = 0
        self._conn: _Connection | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    async def start(self) -> None:
        try:
            self._conn = await self._open()
        except Exception as e:  # noqa: BLE001 - every way of not starting is one line naming the key
            raise ConfigError(f"{self.key}.command", f"MCP server '{self.cfg.name}' ({' '.join(self.cfg.command)}) "
                                                     f"did not start: {self._why(e)}") from None
        self.tools = self._conn.tools

    async def call(self, tool: str, arguments: dict[str, Any]) -> str:
        for attempt in range(2):
            conn = await self._connection()
            assert conn.session is not None
            try:
                async with asyncio.timeout(self.timeout_s):
                    result = await conn.session.call_tool(tool, arguments)
            except TimeoutError:
                raise TimeoutError(f"timed out after {self.timeout_s:g} s") from None
            except Exception as e:
                if not conn.lost(e):
                    raise
                await self._drop(conn)
                if attempt:
                    raise ToolError("server", f"MCP server '{self.cfg.name}' went away during the call, also "
                                              "after it was started again") from None
                continue
            return _observation(result)
        raise AssertionError("unreachable")

    async def _connection(self) -> _Connection:
        if self._conn is not None:
            return self._conn
        async with self._lock:  # the calls that found the server gone wait for one restart
            if self._conn is None:
                if self._closed:
                    raise ToolError("server", f"MCP server '{self.cfg.name}' is stopped")
                try:
                    conn = await self._open()
                except Exception as e:  # noqa: BLE001 - the call's observation
                    raise ToolError("server", f"MCP server '{self.cfg.name}' went away and did not start "
                                              f"again: {self._why(e)}") from None
                if self._closed:  # stopped while it started: it must not outlive the run
                    await conn.close()
                    raise ToolError("server", f"MCP server '{self.cfg.name}' is stopped")
                self._conn = conn
                self.restarts += 1
                log.warning("mcp: server '%s' (%s) started again", self.cfg.name, self.key)
            return self._conn

    async def _open(self) -> _Connection:
        conn = _Connection(self.params, self.log_path)
        await conn.opened(self.cfg.startup_timeout_s)
        return conn

    async def _drop(self, conn: _Connection) -> None:
        if self._conn is conn:  # the first call to find it gone; the others see it replaced
            self._conn = None
            log.warning("mcp: server '%s' (%s) went away; starting it again", self.cfg.name, self.key)
            await conn.close()

    async def aclose(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    def _why(self, e: BaseException) -> str:
        e = _leaf(e)
        if isinstance(e, TimeoutError):
            why = (f"no answer to initialize and tools/list within {self.cfg.startup_timeout_s:g} s "
                   f"({self.key}.startup_timeout_s)")
        elif isinstance(e, MCPError) and e.code == CONNECTION_CLOSED:
            why = "it exited before answering"
        else:
            why = f"{type(e).__name__}: {e}"
        tail = _last_line(self.log_path) if self.log_path is not None else ""
        return why + (f"; its stderr ends: {tail}" if tail else "") + (f" ({self.log_path})" if self.log_path else "")


class McpServers:
    """The servers of `tools.mcp` and the tools they serve, by the name the model calls them by."""

    def __init__(self, cfg: ToolsConfig, *, log_dir: Path | None = None) -> None:
        """`log_dir`: each server's stderr goes to `log_dir/mcp-NAME.log` (None: this process's stderr)."""
        self.servers = [_Server(i, s, s.timeout_s or cfg.timeout_s, log_dir) for i, s in enumerate(cfg.mcp)]
        self.tools: dict[str, ToolFn] = {}
        self._listed: dict[str, Tool] = {}

    async def start(self, taken: Iterable[str] = ()) -> None:
        """Start every server and name its tools; `taken`: the names of the run's other tools. A ConfigError
        (every server stopped) when one does not start or a name is taken twice."""
        try:
            async with asyncio.TaskGroup() as tg:  # the first failure stops the others' starts
                for s in self.servers:
                    tg.create_task(s.start())
            self._name_tools(taken)
        except BaseException as e:
            await self.aclose()
            if isinstance(first := _leaf(e), ConfigError):
                raise first from None  # one line, as the user should see it
            raise

    def _name_tools(self, taken: Iterable[str]) -> None:
        owner = dict.fromkeys(taken, "another tool of the run")
        for s in self.servers:
            for t in s.tools:
                name = f"{s.cfg.name}_{t.name}" if s.cfg.prefix else t.name
                if name in owner:
                    hint = f"rename {s.key}.name" if s.cfg.prefix else f"set {s.key}.prefix: true ({s.cfg.name}_{t.name})"
                    raise ConfigError(s.key, f"MCP server '{s.cfg.name}' serves a tool '{name}', the name of "
                                             f"{owner[name]}; {hint}")
                owner[name] = f"a tool of {s.key}"
                self.tools[name] = _tool_fn(s, t.name)
                self._listed[name] = t

    def openai_tools(self) -> list[dict[str, Any]]:
        """[{"type": "function", "function": {"name", "description", "parameters"}}] for every MCP tool,
        `parameters` being the tool's own JSON Schema (`inputSchema`)."""
        return [{"type": "function", "function": {"name": name, "description": t.description or "",
                                                  "parameters": t.input_schema}} for name, t in self._listed.items()]

    async def aclose(self) -> None:
        """Stop every server, side by side (each shutdown is bounded by the SDK); safe to call again."""
        await asyncio.gather(*(s.aclose() for s in self.servers))


def _tool_fn(server: _Server, tool: str) -> ToolFn:
    async def call(args: str) -> str:
        return await server.call(tool, _arguments(args))

    return call


def _arguments(args: str) -> dict[str, Any]:
    """The model's text as the call's arguments: a JSON object (nothing at all: no arguments)."""
    if not args.strip():
        return {}
    try:
        value = json.loads(args)
    except json.JSONDecodeError as e:
        raise ToolError("arguments", f"arguments must be a JSON object, got {args[:80]!r} ({e.msg})") from None
    if not isinstance(value, dict):
        raise ToolError("arguments", f"arguments must be a JSON object, got {type(value).__name__} {args[:80]!r}")
    return value


def _observation(result: CallToolResult) -> str:
    """The result's text blocks, one per line; other blocks (images, audio, links), which a text model
    cannot read, by their kind. An error result (`isError`) raises ToolError with its text."""
    parts = []
    for block in result.content:
        resource = getattr(block, "resource", None)
        if block.type == "text":
            parts.append(getattr(block, "text", ""))
        elif isinstance(getattr(resource, "text", None), str):
            parts.append(resource.text)  # type: ignore[union-attr]
        else:
            parts.append(f"[{block.type}]")
    text = "\n".join(parts)
    if not parts and result.structured_content is not None:
        text = json.dumps(result.structured_content)
    if result.is_error:
        raise ToolError("result", text or "the tool reported an error")
    return text


async def _list_tools(session: ClientSession) -> list[Tool]:
    tools: list[Tool] = []
    cursor: str | None = None
    while True:
        page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            return tools


def _leaf(e: BaseException) -> BaseException:
    """The first error inside the SDK's task groups' exception groups."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""
