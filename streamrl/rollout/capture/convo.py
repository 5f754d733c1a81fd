"""A conversation's messages -> the tokens they add to an episode, and the checks a request gets first.

Every API the capture endpoint speaks (Chat Completions, Responses, Messages) is turned into OpenAI
chat messages (`tool_calls`, `role: tool`) and the OpenAI tool list, which is what chat templates
render. A conversation is extended, never re-tokenized: the history (everything up to the last
assistant message) stands for the tokens the episode holds as generated, and only what the template
renders after it (the agent's new user or tool messages and the assistant header) is appended,
masked. The history is rendered too, to check it against the episode (token drift is counted,
`prefix_mismatch`); the messages themselves must repeat what the session saw and answered (an agent
that rewrites an earlier turn gets a 400: it asks about a conversation the episode did not have).
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..runner import Episode

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class Refused(Exception):
    """A request the endpoint turns down: status and message; nothing of it is recorded."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def check_tools(tools: Any, where: str = "tools") -> list[dict[str, Any]] | None:
    """OpenAI chat tools (`{"type": "function", "function": {"name", "description", "parameters"}}`),
    checked; None when there are none."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise Refused(400, f"{where} must be a list", where)
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise Refused(400, f'{where}[{i}]: a tool is {{"type": "function", "function": {{...}}}}', f"{where}[{i}]")
        if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise Refused(400, f"{where}[{i}].function.name: letters, digits, _ . - (1-64)", f"{where}[{i}]")
        params = fn.get("parameters", {})
        if not isinstance(params, dict) or not isinstance(params.get("properties", {}), dict):
            raise Refused(400, f"{where}[{i}].function.parameters must be a JSON schema object", f"{where}[{i}]")
    return tools


def text_of(content: Any) -> str:
    """A message's content as text: a string, or the text of its parts (`text`, `input_text`, `output_text`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise Refused(400, "a message's content must be a string or a list of text parts")


def check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise Refused(400, "messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise Refused(400, f"messages[{i}]: a message has a role of system, user, assistant or tool", "messages")
    return [_for_template(m) for m in messages]


def _for_template(m: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates take it: content as text, `developer` as `system`."""
    out = {"role": "system" if m["role"] == "developer" else m["role"], "content": text_of(m.get("content"))}
    if m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                  for c in calls):
            raise Refused(400, "an assistant message's tool_calls are [{id, type, function: {name, arguments}}]")
        out["tool_calls"] = calls
    if m["role"] == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
    return out


def _canonical(m: dict[str, Any]) -> tuple[Any, ...]:
    """What must stay the same when an agent sends a turn back: role, text, the calls and their arguments."""
    calls = []
    for c in m.get("tool_calls") or []:
        args = c["function"].get("arguments")
        with contextlib.suppress(TypeError, ValueError):
            args = json.dumps(json.loads(args) if isinstance(args, str) else args, sort_keys=True)
        calls.append((c["function"].get("name"), args))
    return m["role"], m["content"].strip(), tuple(calls)


def check_continues(seen: list[dict[str, Any]], messages: list[dict[str, Any]]) -> None:
    """400 unless `messages` begin with the conversation the session saw and answered."""
    if len(messages) < len(seen):
        raise Refused(400, "the messages leave out turns this episode already had", "messages")
    for i, (a, b) in enumerate(zip(seen, messages, strict=False)):
        if _canonical(a) != _canonical(b):
            raise Refused(400, f"messages[{i}] rewrites a turn this episode already had (an episode's "
                               "conversation is extended, never edited)", "messages")


def render(ep: Episode, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
           generation: bool) -> list[int]:
    out = ep.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def new_tokens(ep: Episode, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """The tokens these messages add to the episode: what the template renders after the history,
    whose tokens are the episode's own, as generated. Where the history renders longer than the episode
    (an answer cut at max_tokens, which the template closes) the rest is appended masked; where it
    renders otherwise (text that re-tokenizes differently, another end-of-turn token) the mismatch is
    counted and the generated tokens stand. The first call of an episode that has generated nothing
    yet may bring its own prompt (an agent's instructions and tools): its rendering becomes the prompt."""
    try:
        full = render(ep, messages, tools, generation=True)
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        history = None if last is None else render(ep, messages[:last + 1], tools, generation=False)
    except Exception as e:  # noqa: BLE001 - a template that cannot render these messages
        raise Refused(400, f"the chat template cannot render these messages: {e}") from None
    prompt = ep.sample.prompt_ids
    if history is None:
        if ep.answered:
            raise Refused(400, "a session's later calls carry its earlier answers (assistant messages)", "messages")
        if full[:len(prompt)] == prompt:
            return full[len(prompt):]
        if ep.sample.response_ids or ep.sample.turns:
            raise Refused(400, "the first call's messages must begin with the episode's prompt", "messages")
        ep.adopt_prompt(full)
        return []
    if full[:len(history)] != history:
        raise Refused(400, "the chat template renders this history differently with more messages after it")
    so_far = prompt + ep.sample.response_ids[:ep.answered]
    if history[:len(so_far)] == so_far:
        # What the template writes after the tokens generated (the end-of-turn token of an answer
        # cut at max_tokens) comes from the environment: appended masked, like the new messages.
        return history[len(so_far):] + full[len(history):]
    ep.ctx.runner.counters.prefix_mismatch += 1
    return full[len(history):]
