"""The error a tool raises to say why it failed; the tools (sandbox, MCP) and the ToolBox share it,
so it sits below them all."""

from __future__ import annotations


class ToolError(Exception):
    """A tool's failure that says why: `cause` (one word, counted as tool_errors/CAUSE), the message,
    and what the tool had printed before it failed, which the observation shows after the message."""

    def __init__(self, cause: str, message: str, output: str = "") -> None:
        super().__init__(message)
        self.cause, self.message, self.output = cause, message, output
