"""A calculator served over MCP's stdio transport, built with the `mcp` SDK (docs/environments.md, "MCP
tools"; tests/test_mcp_tools.py). Run by `tools.mcp`:

    tools:
      mcp:
        - name: calc
          command: [python, examples/mcp_calculator_server.py]

Tools: `multiply(a, b)` and `add(a, b)` on integers, `divide(a, b)` (an error result when b is 0), and
`sleep(seconds)`, a tool slow on purpose for timeout tests.
"""

from __future__ import annotations

import asyncio
import logging

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

# WARNING, not the SDK's INFO: a line on stderr per request would bury the run's own output.
server = MCPServer("calculator", instructions="exact integer arithmetic", log_level="WARNING")


@server.tool()
def multiply(a: int, b: int) -> int:
    """The product a * b of two integers."""
    return a * b


@server.tool()
def add(a: int, b: int) -> int:
    """The sum a + b of two integers."""
    return a + b


@server.tool()
def divide(a: int, b: int) -> int:
    """The integer quotient a // b; b must not be 0."""
    if b == 0:
        # ToolError's text reaches the client; any other exception is reported only as "Error executing tool".
        raise ToolError("division by zero")
    return a // b


@server.tool()
async def sleep(seconds: float) -> str:
    """Waits `seconds`, then answers 'awake'."""
    await asyncio.sleep(seconds)
    return "awake"


if __name__ == "__main__":
    logging.getLogger("mcp").setLevel(logging.WARNING)
    server.run()
