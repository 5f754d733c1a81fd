"""The agents quickstart's task (`data.task: agent_multiply`): the agentic quickstart's products, asked
of an agent written with an SDK (openai-agents, anthropic) that declares a `calculator` function tool.

The conversation is whatever the agent sends through the capture endpoint, rendered by the model's
chat template (`model.init: tiny_tools`, Hermes / Qwen form): the agent's instructions and tool in the
system turn, the question, then either a tool call
`<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>`, the result
`<tool_response>5535</tool_response>` (masked) and the answer, or the answer at once. The reward reads
the agent's last answer. The warm start is the sloppy teacher of the agentic quickstart, rendered
through the same template: `1 - label_noise` of its examples call the tool. This module owns the
instructions and the tool's schema the examples in `examples/` use, so warm start and agent agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .multiply import multiply_prompts, supervised

INSTRUCTIONS = "use the calculator"
TOOL_DESCRIPTION = "exact integer arithmetic: + - * and parentheses"
TOOL_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"expression": {"type": "string"}},
                               "required": ["expression"]}
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": TOOL_DESCRIPTION,
                                           "parameters": TOOL_SCHEMA}}]
_ASSISTANT, _END, _CALL = "<|assistant|>", "<|end|>", "<tool_call>"

prompts = multiply_prompts


def final_answer(response_text: str) -> str:
    """The text of the agent's last answer: after the last assistant header, up to its end of turn."""
    return response_text.rsplit(_ASSISTANT, 1)[-1].split(_END, 1)[0].split("<eos>", 1)[0]


def reward(response_text: str, answer: str) -> float:
    """1.0 iff the last answer is the product (an answer that is a tool call is none)."""
    final = final_answer(response_text)
    return 1.0 if _CALL not in final and final.strip() == answer.strip() else 0.0


def _render(tok: Any, messages: list[dict[str, Any]], generation: bool) -> list[int]:
    out = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=generation, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _example(tok: Any, prompt: str, answer: str, use_tool: bool) -> tuple[list[int], list[int]]:
    """The episode an SDK agent has with the teacher as its model, as the capture endpoint records it:
    token ids and loss mask (1 on what the model writes, 0 on the prompt and the tool's result)."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": prompt}]
    ids = _render(tok, msgs, True)
    mask = [0] * len(ids)
    if use_tool:
        call = {"id": "call_0", "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": prompt.rstrip("=")})}}
        msgs += [{"role": "assistant", "content": "", "tool_calls": [call]}]
        after_call = _render(tok, msgs, False)
        msgs += [{"role": "tool", "tool_call_id": "call_0", "content": answer}]
        after_result = _render(tok, msgs, True)
        mask += [1] * (len(after_call) - len(ids)) + [0] * (len(after_result) - len(after_call))
        ids = after_result
    full = _render(tok, [*msgs, {"role": "assistant", "content": answer}], False)
    return full, mask + [1] * (len(full) - len(ids))


def warm_start(model_dir: str | Path, out_dir: str | Path, *, steps: int = 300, batch_size: int = 64,
               lr: float = 3e-3, label_noise: float = 0.6, seed: int = 0, device: str = "cpu") -> dict[str, Any]:
    """Supervised steps on the sloppy teacher's episodes; the result saved as an HF folder."""
    return supervised(model_dir, out_dir, _example, task="agent_multiply", steps=steps, batch_size=batch_size,
                      lr=lr, label_noise=label_noise, seed=seed, device=device)
