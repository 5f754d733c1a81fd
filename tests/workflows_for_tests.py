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


async def chat_via_openai(record: dict[str, Any], episode: Any) -> None:
    """Two chat turns through the `openai` SDK, pointed at the episode's capture endpoint."""
    import openai

    client = openai.AsyncOpenAI(base_url=await episode.openai_url(), api_key="streamrl", max_retries=0)
    messages = list(record["prompt"])
    r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "1+1="}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    await client.close()


async def chat_native(record: dict[str, Any], episode: Any) -> None:
    """The same two turns through the episode itself: what the SDK path must reproduce token for token."""
    tok = episode.tokenizer
    messages = list(record["prompt"])
    first = await episode.generate(max_new_tokens=6)
    ids = episode.sample.response_ids[first.start:first.end]
    if first.finish == "stop" and ids and ids[-1] in tok.all_special_ids:
        ids = ids[:-1]
    messages += [{"role": "assistant", "content": tok.decode(ids, skip_special_tokens=False)},
                 {"role": "user", "content": "1+1="}]
    so_far = episode.sample.prompt_ids + episode.sample.response_ids
    history = tok.apply_chat_template(messages[:-1], tokenize=True)["input_ids"]
    full = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    if history[:len(so_far)] == so_far:  # as generated, or cut at max_tokens: the template closes it
        episode.observe_ids(full[len(so_far):])
    else:  # ended with another end-of-turn token (<eos>): the generated tokens stand
        episode.observe_ids(full[len(history):])
    await episode.generate(max_new_tokens=6)
