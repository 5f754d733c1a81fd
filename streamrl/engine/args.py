"""EngineArgs: every setting of an embedded engine, one typed struct passed whole.

    args = EngineArgs.from_config(cfg.engines, seed=cfg.seed)     built once, from `engines.*`
    TorchEngine(model_dir, args.replica(i))                        a local engine
    [..., *args.flags()]  ->  EngineArgs.from_flags(ns)            a launched `streamrl serve` server
    EngineReplica(model_dir, args, ...)                            a Ray Serve replica

A launched server's command line is generated from the struct and parsed back into it by the
server (`add_flags`), so a setting added here reaches every engine kind with no route to update;
the server reports what it runs with (`/server_info`'s `engine_args`). Settings of a pool (URLs,
health checks, Ray resources, vLLM's own) live with their pool, not here. No torch at import.
"""

from __future__ import annotations

import argparse
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec
from msgspec import Meta

from ..config import EnginesConfig

# `engines.*` keys that are engine settings, and the EngineArgs field each becomes; every other key is
# a setting of the pool itself (POOL_SETTINGS), read by the pool that uses it.
FROM_CONFIG = {"device": "device", "dtype": "dtype", "max_running_requests": "max_running_requests",
               "max_total_tokens": "max_total_tokens", "threads": "num_threads", "kv_cache_fraction": "kv_cache_fraction"}
POOL_SETTINGS = frozenset({
    "pool", "num_replicas", "urls", "router", "backend", "vllm_python", "vllm_kv_cache_gib", "start_timeout_s",
    "health_check_interval_s", "health_check_timeout_s", "control_timeout_s", "max_restarts", "all_lost_timeout_s",
    "engine", "cpus_per_replica", "gpus_per_replica", "stream_interval", "ray_address", "weight_sync", "colocate",
    "colocate_offload_weights",
})


class EngineArgs(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    device: Annotated[str, Meta(description="auto | cpu | cuda (auto: cuda when a GPU is visible)")] = "auto"
    dtype: Annotated[Literal["float32", "bfloat16", "float16"], Meta(description="parameter dtype")] = "float32"
    max_running_requests: Annotated[int, Meta(ge=1, description="requests decoded together at most")] = 64
    max_total_tokens: Annotated[int | None, Meta(description="KV-cache tokens; none: the engine decides")] = None
    max_prefill_tokens: Annotated[int, Meta(ge=1, description="prompt tokens prefilled in one step at most")] = 8192
    max_seq_len: Annotated[int | None, Meta(description="context length; none: the model's")] = None
    seed: Annotated[int, Meta(ge=0, description="seed of requests that bring none")] = 0
    weight_version: Annotated[str, Meta(description="the version the starting weights are reported as")] = "default"
    num_threads: Annotated[int | None, Meta(description="torch threads for model steps; none: torch's default")] = None
    kv_cache_fraction: Annotated[float, Meta(gt=0, le=1, description=(
        "CUDA, without max_total_tokens: the paged KV cache takes at most this fraction of the memory free "
        "after the weights"))] = 0.3
    runner: Annotated[Literal["auto", "paged", "slots"], Meta(description="the model runner")] = "auto"
    cpu_kernel: Annotated[bool, Meta(description="the compiled CPU decode attention where it builds")] = True

    @classmethod
    def from_config(cls, cfg: EnginesConfig, *, seed: int = 0) -> EngineArgs:
        """The settings `engines.*` gives every engine of the pool (replica 0's seed)."""
        return cls(seed=seed, weight_version="0", **{arg: getattr(cfg, key) for key, arg in FROM_CONFIG.items()})

    def replica(self, i: int) -> EngineArgs:
        """Replica `i`'s settings: its own seed (requests without one differ between replicas)."""
        return msgspec.structs.replace(self, seed=self.seed + i)

    def with_(self, **changes: Any) -> EngineArgs:
        return msgspec.structs.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    def flags(self) -> list[str]:
        """The command-line flags that `add_flags` parses back into this struct."""
        out: list[str] = []
        for name, value in self.as_dict().items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                out.append(flag if value else "--no-" + flag[2:])
            elif value is not None:
                out += [flag, str(value)]
        return out

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field (`--max-running-requests N`, `--cpu-kernel/--no-cpu-kernel`), with its
        default and description."""
        default = cls()
        for f in msgspec.structs.fields(cls):
            meta = _meta(f.type)
            flag = "--" + f.name.replace("_", "-")
            value = getattr(default, f.name)
            kind = _scalar(f.type)
            if kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=meta)
            elif get_origin(kind) is Literal:
                parser.add_argument(flag, choices=get_args(kind), default=value, help=meta, dest=f.name)
            else:
                parser.add_argument(flag, type=kind, default=value, help=meta, dest=f.name)

    @classmethod
    def from_flags(cls, ns: argparse.Namespace) -> EngineArgs:
        """The struct from parsed flags (msgspec checks each value's type and bounds)."""
        return msgspec.convert({f.name: getattr(ns, f.name) for f in msgspec.structs.fields(cls)}, cls)


def _meta(tp: Any) -> str | None:
    for m in getattr(tp, "__metadata__", ()):
        if isinstance(m, Meta):
            return m.description
    return None


def _scalar(tp: Any) -> Any:
    """The argparse type of a field: its base type, without Annotated or None (a Literal as it is)."""
    if hasattr(tp, "__metadata__"):  # Annotated[X, Meta]
        tp = get_args(tp)[0]
    if get_origin(tp) in (Union, types.UnionType):  # X | None
        tp = next(a for a in get_args(tp) if a is not type(None))
    return tp
