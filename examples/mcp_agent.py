"""The agentic quickstart with its calculator served over MCP (configs/agentic_mcp.yaml; docs/environments.md,
"MCP tools"): `multi_turn_tools`' loop, the model's call sent to an MCP tool.

The model writes `<tool>123*45</tool>`, as the quickstart's warm start taught it; the MCP server's
`multiply` (examples/mcp_calculator_server.py) takes a JSON object, `{"a": 123, "b": 45}`, so this
workflow writes one from the call, and the server's answer is appended between `<result>` and
`</result>`, masked out of the loss. A call it cannot read goes as written: the server's complaint is
the model's observation, as any tool error is.
"""

from __future__ import annotations

import json
from typing import Any


def as_arguments(call: str) -> str:
    """`123*45` -> `{"a": 123, "b": 45}`; anything else unchanged."""
    a, star, b = call.partition("*")
    if star and a.strip().isdigit() and b.strip().isdigit():
        return json.dumps({"a": int(a), "b": int(b)})
    return call


async def solve(record: dict[str, Any], episode: Any) -> None:
    cfg = episode.tools.cfg
    # A closing tag that is one token stops the engine by id, as in multi_turn_tools.
    close_ids = episode.tokenizer(cfg.call_close, add_special_tokens=False)["input_ids"]
    stop = {"stop_token_ids": close_ids} if len(close_ids) == 1 else {"stop": [cfg.call_close]}
    for _ in range(episode.cfg.max_turns):
        turn = await episode.generate(**stop)
        text = episode.text(turn)
        if turn.finish != "stop" or not text.endswith(cfg.call_close) or cfg.call_open not in text:
            return  # an answer (or the budget ran out)
        call = text[text.rindex(cfg.call_open) + len(cfg.call_open):-len(cfg.call_close)]
        await episode.call_tool("multiply", as_arguments(call))
