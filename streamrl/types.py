"""The one record that flows through streamrl: a `Sample`, grouped per prompt into a `Group`.

A sample travels prompt -> engine -> rollout manager -> buffer -> trainer. It carries everything the
trainer needs to compute an off-policy-corrected loss without asking the engine again: the behaviour
logprob and the weight version of every response token. This module knows nothing about torch, Ray
or HTTP; records are msgspec Structs so they serialise cheaply to JSONL, to Ray and to checkpoints.
"""

from __future__ import annotations

from itertools import compress
from typing import Any, Literal

import msgspec

SampleStatus = Literal["pending", "partial", "completed", "truncated", "aborted", "failed"]


class Turn(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One turn of a multi-turn sample: the response tokens `[start, end)` that the model produced
    (`kind="model"`, trainable) or that a tool or the environment returned (`kind="tool"`, masked).

    The turns of a sample are its journal: a sample continued from a checkpoint replays them instead
    of generating or calling a tool again."""

    kind: Literal["model", "tool"]
    start: int
    end: int
    finish: str | None = None  # model: stop | length; None while the turn is still being generated
    tool: str | None = None  # tool: its name
    call: str | None = None  # tool: the call's arguments as the model wrote them
    error: str | None = None  # tool: why it failed (the observation says so too)
    result: str | None = None  # tool run by the agent itself (`Episode.run_tool`): what it returned
    seconds: float = 0.0  # tool: how long it ran


class Sample(msgspec.Struct, kw_only=True):
    """One response to one prompt.

    Invariant: ``len(response_ids) == len(logprobs) == len(versions) == len(loss_mask)``.
    """

    group_id: str
    index: int = 0
    prompt_ids: list[int]
    response_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] = msgspec.field(default_factory=list)  # behaviour logprobs, one per token
    versions: list[int] = msgspec.field(default_factory=list)  # weight version that produced each token
    loss_mask: list[int] = msgspec.field(default_factory=list)  # 0 for tool / environment tokens
    reward: float | None = None
    status: SampleStatus = "pending"
    finish_reason: str | None = None
    num_resumes: int = 0  # times this sample was interrupted and continued from its partial tokens
    prompt_text: str = ""
    response_text: str = ""
    meta: dict[str, Any] = msgspec.field(default_factory=dict)  # task fields, e.g. the reference answer
    timings: dict[str, float] = msgspec.field(default_factory=dict)
    turns: list[Turn] = msgspec.field(default_factory=list)  # multi-turn samples only (workflows)

    def append(self, token_ids: list[int], logprobs: list[float], version: int, trainable: bool = True) -> None:
        """Extend the response with tokens produced by weights of ``version``."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} logprobs")
        self.response_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.versions.extend([version] * len(token_ids))
        self.loss_mask.extend([1 if trainable else 0] * len(token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.response_ids)

    def oldest_version(self) -> int | None:
        """Version of the oldest trainable token, or None for an empty response."""
        return min(compress(self.versions, self.loss_mask), default=None)  # C loops: called per buffer wake-up


class Group(msgspec.Struct, kw_only=True):
    """The n samples of one prompt; GRPO normalises advantages within it."""

    group_id: str
    samples: list[Sample]
    admitted_version: int = 0  # trainer version when the controller admitted this group
    meta: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def rewards(self) -> list[float]:
        return [s.reward if s.reward is not None else 0.0 for s in self.samples]

    def oldest_version(self) -> int:
        vs = [v for s in self.samples if (v := s.oldest_version()) is not None]
        return min(vs) if vs else self.admitted_version

    def newest_version(self) -> int:
        vs = [max(s.versions) for s in self.samples if s.versions]
        return max(vs) if vs else self.admitted_version

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)


_encoder = msgspec.json.Encoder()


def encode_jsonl(records: list[Sample] | list[Group]) -> bytes:
    return b"".join(_encoder.encode(r) + b"\n" for r in records)


def decode_groups(data: bytes) -> list[Group]:
    dec = msgspec.json.Decoder(Group)
    return [dec.decode(line) for line in data.splitlines() if line.strip()]
