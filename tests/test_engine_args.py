"""EngineArgs: one struct of engine settings from `engines.*`, passed whole to every engine kind; a
launched `streamrl serve` server runs with exactly the settings the config gives it (read back from
the server)."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from streamrl.config import EnginesConfig
from streamrl.engine import TorchEngine
from streamrl.engine.args import FROM_CONFIG, POOL_SETTINGS, EngineArgs
from streamrl.engine.http.client import SGLangClient
from streamrl.rollout import build_pool


def test_every_engines_key_is_an_engine_setting_or_a_pools_own() -> None:
    """A new `engines.*` key must say where it goes: into EngineArgs (and so to every engine and every
    launched server), or to its pool. None can be dropped on the way."""
    keys = {f.name for f in msgspec.structs.fields(EnginesConfig)}
    assert keys == set(FROM_CONFIG) | POOL_SETTINGS and not set(FROM_CONFIG) & POOL_SETTINGS
    fields = {f.name for f in msgspec.structs.fields(EngineArgs)}
    assert set(FROM_CONFIG.values()) <= fields


def test_flags_parse_back_into_the_same_settings() -> None:
    args = EngineArgs(device="cpu", dtype="bfloat16", max_running_requests=5, max_total_tokens=321, seed=7,
                      weight_version="3", num_threads=2, kv_cache_fraction=0.5, runner="slots", cpu_kernel=False,
                      max_seq_len=48, max_prefill_tokens=100)
    p = argparse.ArgumentParser()
    EngineArgs.add_flags(p)
    assert EngineArgs.from_flags(p.parse_args(args.flags())) == args
    assert EngineArgs.from_flags(p.parse_args([])) == EngineArgs()
    with pytest.raises(msgspec.ValidationError, match="max_running_requests"):
        EngineArgs.from_flags(p.parse_args(["--max-running-requests", "0"]))


def test_a_local_engine_runs_with_the_settings_it_is_given(tiny_model_dir: Path) -> None:
    args = EngineArgs.from_config(EnginesConfig(device="cpu", max_running_requests=3, max_total_tokens=100), seed=4)
    eng = TorchEngine(str(tiny_model_dir), args.replica(1), max_prefill_tokens=77)
    assert eng.args == args.with_(seed=5, max_prefill_tokens=77)
    assert eng.scheduler.max_running == 3 and eng.scheduler.max_total_tokens == 100


async def test_a_launched_server_gets_every_engine_setting(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`engines.pool: http` launching `streamrl serve`: each server reports the settings it runs with,
    and they are the config's, replica i with seed + i (before, max_total_tokens, kv_cache_fraction
    and the seed never reached a launched server)."""
    cfg = EnginesConfig(pool="http", num_replicas=2, device="cpu", max_running_requests=5, max_total_tokens=200,
                        kv_cache_fraction=0.25, threads=1)
    pool = build_pool(cfg, str(tiny_model_dir), run_dir=tmp_path, seed=11)
    want = EngineArgs.from_config(cfg, seed=11)
    async with pool:
        for i, url in enumerate(pool.urls):
            async with SGLangClient(url) as c:
                info = await c.server_info()
            assert info["engine_args"] == want.replica(i).as_dict()
            assert info["max_total_num_tokens"] == 200 and info["max_running_requests"] == 5
