"""LoRA against full fine-tuning, side by side in one process run (CPU).

    python bench/lora.py [--parts push,decode,trainer,quickstart] [--shapes tiny,qwen2.5-0.5b] [--pools local,http,vllm]

- **push**: what one weight push moves and how long it takes, full weights vs a rank-8 adapter on every
  linear layer, for each model shape: bytes (in memory, and the folder a server loads), the in-process
  push into a TorchEngine (`update_weights_from_state_dict` vs `load_lora_adapter`, which merges the
  adapter from the kept base), the disk push to a launched `streamrl serve` (folder written + loaded),
  and for the tiny shape a real vLLM server (`reload_weights` vs `/v1/load_lora_adapter`) where
  vLLM is installed.
- **decode**: the engine's decode speed with the adapter merged into its weights (what streamrl does)
  vs applied at run time (peft's LoRA layers injected into the engine's model: two extra matmuls per
  adapted layer per step) vs no adapter at all, and what each costs a push.
- **trainer**: a train step's time and the process's peak memory, full vs LoRA, each in its own process.
- **quickstart**: `streamrl run configs/quickstart.yaml`, then the same with `--set trainer.lora.rank=8`
  (warm start from the cache, so both start from the same model), on each pool of `--pools`: held-out
  accuracy, RL time, push time per step, tokens discarded.

Writes bench/results/lora.json; a run of some `--parts` replaces those parts and keeps the others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _table import print_table, write_results

from streamrl.engine import TorchEngine
from streamrl.engine.http import SGLangClient
from streamrl.weights import Adapter, DiskSync, load_folder

REPO = Path(__file__).parents[1]
RESULTS = REPO / "bench" / "results"
RANK = 8
# The engines' KV cache: a 0.5 B shape's 32k-token context in 64 slots would take ~50 GB.
SMALL_KV = {"max_running_requests": 8, "max_seq_len": 256}


def make_model(shape: str, root: Path) -> Path:
    from streamrl.tasks import build_tiny_model

    return build_tiny_model(root / shape, preset=shape)


def make_adapter(model: Path, seed: int = 0) -> Adapter:
    """A rank-8 adapter on every linear layer of `model` (peft's all-linear), B non-zero."""
    from streamrl.config import TrainerConfig
    from streamrl.config.schema import LoraConfig
    from streamrl.trainer.trainer import Trainer

    t = Trainer(TrainerConfig(lora=LoraConfig(rank=RANK)), str(model))
    g = torch.Generator().manual_seed(seed)
    ad = t.state_dict_for_engines()
    assert isinstance(ad, Adapter)
    tensors = {k: (torch.randn(v.shape, generator=g) * 0.01 if "lora_B" in k else v.clone()) for k, v in ad.tensors.items()}
    return Adapter(tensors, ad.rank, ad.alpha)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def timed(fn: Any, n: int = 3) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


async def atimed(fn: Any, n: int = 3) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


async def push_part(shape: str, root: Path) -> dict[str, Any]:
    from streamrl.engine.args import EngineArgs
    from streamrl.rollout.http_pool import ServerProcess

    model = make_model(shape, root)
    full, adapter = load_folder(model), make_adapter(model)
    row: dict[str, Any] = {"shape": shape, "params": sum(v.numel() for v in full.values()),
                           "full_bytes": sum(v.numel() * v.element_size() for v in full.values()),
                           "lora_bytes": adapter.nbytes(), "lora_modules": len(adapter.modules())}
    row["lora_fraction"] = row["lora_bytes"] / row["full_bytes"]
    async with TorchEngine(str(model), num_threads=2, **SMALL_KV) as e:
        v = iter(range(1, 100))
        first = await atimed(lambda: e.load_lora_adapter(adapter, str(next(v))), 1)  # copies the base first
        row["local_full_s"] = statistics.median(await atimed(lambda: e.update_weights_from_state_dict(full, str(next(v)))))
        row["local_lora_first_s"] = first[0]
        row["local_lora_s"] = statistics.median(await atimed(lambda: e.load_lora_adapter(adapter, str(next(v)))))
    server = ServerProcess(str(model), EngineArgs(num_threads=2, **SMALL_KV), log_path=root / f"serve-{shape}.log")
    url = await server.start()
    try:
        async with SGLangClient(url) as c:
            sync = DiskSync([c])
            v = iter(range(1, 100))
            row["disk_full_s"] = statistics.median(await atimed(lambda: sync.load(full, next(v))))
            row["disk_lora_s"] = statistics.median(await atimed(lambda: sync.load(adapter, next(v))))
            await sync.aclose()
            sync = DiskSync([c])
            await sync.stage(full, 0)
            row["full_folder_bytes"] = folder_bytes(sync._staged[1])  # type: ignore[index]
            await sync.stage(adapter, 1)
            row["lora_folder_bytes"] = folder_bytes(sync._staged[1])  # type: ignore[index]
            await sync.aclose()
    finally:
        await server.stop()
    if shape == "tiny":
        row |= await vllm_push(model, full, adapter, root)
    return row


async def vllm_push(model: Path, full: dict, adapter: Adapter, root: Path) -> dict[str, Any]:
    from streamrl.engine.vllm import VLLMClient, VLLMServer, find_vllm_python
    from streamrl.rollout.http_pool import vllm_cache_dir

    python = find_vllm_python()
    if python is None:
        return {"vllm": "not installed"}
    server = VLLMServer(python, str(model), log_path=root / "vllm.log", cache_dir=vllm_cache_dir(), lora_rank=RANK)
    url = await server.start()
    try:
        async with VLLMClient(url) as c:
            sync, v = DiskSync([c]), iter(range(1, 100))
            out = {"vllm_full_s": statistics.median(await atimed(lambda: sync.load(full, next(v)))),
                   "vllm_lora_s": statistics.median(await atimed(lambda: sync.load(adapter, next(v))))}
            await sync.aclose()
            return out
    finally:
        await server.stop()


async def decode_part(shape: str, root: Path, batch: int = 8, new: int = 64) -> dict[str, Any]:
    from peft import LoraConfig, inject_adapter_in_model

    model = make_model(shape, root)
    adapter = make_adapter(model)
    prompts = [[1] + [4 + (i + j) % 18 for j in range(15)] for i in range(batch)]
    params = {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}
    row: dict[str, Any] = {"shape": shape, "batch": batch, "new_tokens": new}
    for mode in ("base", "merged", "runtime") * 3:  # alternated: the machine drifts
        async with TorchEngine(str(model), num_threads=2, **{**SMALL_KV, "max_running_requests": batch}) as e:
            push = 0.0
            if mode == "merged":
                t0 = time.perf_counter()
                await e.load_lora_adapter(adapter, "1")
                push = time.perf_counter() - t0
            elif mode == "runtime":  # peft's LoRA layers in the engine's model: B(A x) added at every step
                inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=adapter.alpha, target_modules="all-linear"), e.model)
                params_of = dict(e.model.named_parameters())
                t0 = time.perf_counter()
                with torch.no_grad():
                    for k, val in adapter.tensors.items():
                        params_of[k.replace(".weight", ".default.weight")].copy_(val)
                push = time.perf_counter() - t0
            await e.generate_many(prompts[:2], [dict(params, max_new_tokens=2)] * 2, ["w0", "w1"])  # warm-up
            t0 = time.perf_counter()
            out = await e.generate_many(prompts, [params] * batch, [f"r{i}" for i in range(batch)])
            dt = time.perf_counter() - t0
        tok = sum(len(r["output_ids"]) for r in out)
        row.setdefault(f"{mode}_tok_s", []).append(tok / dt)
        row.setdefault(f"{mode}_push_s", []).append(push)
    for k in [k for k in row if isinstance(row[k], list)]:
        row[k + "_rounds"], row[k] = row[k], statistics.median(row[k])
    return row


TRAINER_CHILD = r"""
import json, sys, time, random, torch
from streamrl.config import TrainerConfig
from streamrl.config.schema import LoraConfig
from streamrl.trainer.trainer import Trainer
from streamrl.types import Group, Sample
model, rank, groups, n, plen, rlen, steps = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:8])
torch.set_num_threads(2)
rng = random.Random(0)
def batch():
    out = []
    for g in range(groups):
        prompt = [1] + [rng.randrange(4, 22) for _ in range(plen - 1)]
        ss = []
        for i in range(n):
            s = Sample(group_id=f"g{g}", index=i, prompt_ids=prompt, reward=float(i % 2))
            s.append([rng.randrange(4, 22) for _ in range(rlen)], [-1.0] * rlen, 0)
            ss.append(s)
        out.append(Group(group_id=f"g{g}", samples=ss))
    return out
t = Trainer(TrainerConfig(lr=1e-5, loss="decoupled_ppo", lora=LoraConfig(rank=rank)), model)
times = []
for _ in range(steps + 1):
    b = batch(); t0 = time.perf_counter(); t.train_step(b); times.append(time.perf_counter() - t0)
trainable = sum(p.numel() for p in t._params)
print(json.dumps({"step_s": min(times[1:]), "trainable_params": trainable,
                  "optimizer_bytes": sum(v.numel() * v.element_size() for s in t.optimizer.state.values()
                                          for v in s.values() if torch.is_tensor(v)),
                  # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking parent
                  "peak_rss_mib": int(next(x for x in open("/proc/self/status") if x.startswith("VmHWM")).split()[1]) / 1024}))
"""


def trainer_part(shape: str, root: Path) -> dict[str, Any]:
    model = make_model(shape, root)
    size = (2, 4, 32, 32, 2) if "0.5b" in shape else (8, 8, 8, 8, 10)
    row: dict[str, Any] = {"shape": shape, "batch": f"{size[0]}x{size[1]} samples, {size[2]}+{size[3]} tokens"}
    for name, rank in (("full", 0), ("lora", RANK)):
        out = subprocess.run([sys.executable, "-c", TRAINER_CHILD, str(model), str(rank), *map(str, size)],
                             capture_output=True, text=True, check=True)
        for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items():
            row[f"{name}_{k}"] = v
    return row


POOLS = {"local": [], "http": ["--set", "engines.pool=http"],
         "vllm": ["--set", "engines.pool=http", "--set", "engines.backend=vllm"]}


def quickstart_part(root: Path, pools: list[str]) -> list[dict[str, Any]]:
    rows = []
    runs = [(f"{pool} {name}", POOLS[pool] + sets) for pool in pools
            for name, sets in (("full", []), ("LoRA rank 8", ["--set", "trainer.lora.rank=8"]))]
    for name, sets in runs:
        run_dir = root / f"qs-{name.replace(' ', '-')}"
        cmd = [str(Path(sys.executable).parent / "streamrl"), "run", str(REPO / "configs" / "quickstart.yaml"),
               "--no-progress", "--set", f"run_dir={run_dir}", *sets]
        subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
        s = json.loads((run_dir / "summary.json").read_text())
        m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows.append({"run": name, "sampled_before": s["eval_before"]["sampled"], "sampled_after": s["eval_after"]["sampled"],
                     "greedy_after": s["eval_after"]["greedy"], "rl_s": s["train_wall_s"],
                     "push_ms": 1000 * statistics.mean(r["weight_sync_s"] for r in m),
                     "train_step_ms": 1000 * statistics.mean(r["train_s"] for r in m),
                     "tokens_discarded": sum(r["tokens_discarded"] for r in m)})
    return rows


async def amain(args: argparse.Namespace) -> None:
    parts, shapes = args.parts.split(","), args.shapes.split(",")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        root = Path(tmp)
        if "push" in parts:
            out["push"] = [await push_part(s, root) for s in shapes]
            print_table("one weight push: full vs LoRA rank 8 (all linear layers)",
                        ["shape", "full MB", "LoRA MB", "LoRA/full", "local full", "local LoRA", "serve full",
                         "serve LoRA", "vLLM full", "vLLM LoRA"],
                        [[r["shape"], f"{r['full_bytes'] / 1e6:.1f}", f"{r['lora_bytes'] / 1e6:.2f}",
                          f"{r['lora_fraction']:.1%}", f"{r['local_full_s'] * 1e3:.1f} ms", f"{r['local_lora_s'] * 1e3:.1f} ms",
                          f"{r['disk_full_s'] * 1e3:.0f} ms", f"{r['disk_lora_s'] * 1e3:.0f} ms",
                          f"{r['vllm_full_s'] * 1e3:.0f} ms" if "vllm_full_s" in r else "-",
                          f"{r['vllm_lora_s'] * 1e3:.0f} ms" if "vllm_lora_s" in r else "-"] for r in out["push"]])
        if "decode" in parts:
            out["decode"] = [await decode_part(s, root) for s in shapes]
            print_table("engine decode with the adapter merged vs applied at run time",
                        ["shape", "no adapter tok/s", "merged tok/s", "run-time tok/s", "first push, merged",
                         "first push, run-time"],
                        [[r["shape"], f"{r['base_tok_s']:.0f}", f"{r['merged_tok_s']:.0f}", f"{r['runtime_tok_s']:.0f}",
                          f"{r['merged_push_s'] * 1e3:.1f} ms", f"{r['runtime_push_s'] * 1e3:.1f} ms"] for r in out["decode"]])
        if "trainer" in parts:
            out["trainer"] = [trainer_part(s, root) for s in shapes]
            print_table("a train step: full vs LoRA rank 8",
                        ["shape", "batch", "full step", "LoRA step", "full peak RSS", "LoRA peak RSS", "full Adam",
                         "LoRA Adam"],
                        [[r["shape"], r["batch"], f"{r['full_step_s']:.2f} s", f"{r['lora_step_s']:.2f} s",
                          f"{r['full_peak_rss_mib']:.0f} MiB", f"{r['lora_peak_rss_mib']:.0f} MiB",
                          f"{r['full_optimizer_bytes'] / 2**20:.1f} MiB", f"{r['lora_optimizer_bytes'] / 2**20:.2f} MiB"]
                         for r in out["trainer"]])
        if "quickstart" in parts:
            out["quickstart"] = quickstart_part(root, args.pools.split(","))
            print_table("the quickstart, full vs LoRA", ["run", "sampled before -> after", "greedy after", "RL",
                                                         "push / step", "train / step", "tokens discarded"],
                        [[r["run"], f"{r['sampled_before']:.3f} -> {r['sampled_after']:.3f}", f"{r['greedy_after']:.3f}",
                          f"{r['rl_s']:.1f} s", f"{r['push_ms']:.1f} ms", f"{r['train_step_ms']:.0f} ms",
                          r["tokens_discarded"]] for r in out["quickstart"]])
    # A run of some parts replaces those parts and keeps the others (each part compares its own sides).
    old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    if "quickstart" in out:  # runs of other pools stay
        mine = {r["run"] for r in out["quickstart"]}
        out["quickstart"] = [r for r in old.get("quickstart", []) if r["run"] not in mine] + out["quickstart"]
    parts_meta = {**old.get("meta", {}).get("parts", {}), **{k: time.strftime("%Y-%m-%d %H:%M") for k in out}}
    kept = {k: v for k, v in old.items() if k not in ("meta", "results")}
    write_results(args.out, {"rank": RANK, "cores": len(os.sched_getaffinity(0)), "parts": parts_meta}, [],
                  **{**kept, **out})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="push,decode,trainer,quickstart")
    ap.add_argument("--shapes", default="tiny,qwen2.5-0.5b")
    ap.add_argument("--pools", default="local", help="quickstart part: local, http (streamrl serve), vllm")
    ap.add_argument("--out", default=str(RESULTS / "lora.json"))
    asyncio.run(amain(ap.parse_args()))


if __name__ == "__main__":
    main()
