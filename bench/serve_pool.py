"""The Ray Serve pool against the in-process pool, and weight-broadcast time against replica count, in one run.

Part 1, per-request overhead: the same requests (6-token prompt, 8 new tokens, greedy) through a
`LocalPool` (one TorchEngine in this process) and a `RayServePool` with one replica (one TorchEngine in
a Serve replica process), at 1 and 64 concurrent callers. The difference at 1 caller is the cost of
the Serve path (handle, router, streaming, the extra process hop) per request.

Part 2, weight updates: `weight_sync.load` (one `ray.put`, a broadcast, every replica pulls the object
and loads it) for 1, 2 and 4 replicas, for the tiny model and a larger one, median of 5 updates.

One Ray session for the whole run. Writes the `ray_serve` part of bench/results/pools.json.

    python bench/serve_pool.py [--requests 256] [--models tiny,bench100m]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _table import write_results

from streamrl.config import EnginesConfig
from streamrl.engine import TorchEngine
from streamrl.engine.args import EngineArgs
from streamrl.rollout.pools import LocalPool
from streamrl.rollout.ray_serve_pool import RayServePool, start_ray
from streamrl.tasks import build_tiny_model

RESULTS = Path(__file__).parent / "results"
PROMPT = [1, 7, 11, 14, 8, 12]
PARAMS = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
ENGINE = dict(device="cpu", dtype="float32", max_running_requests=64, weight_version="0")


async def load(pool, callers: int, total: int) -> dict:  # noqa: ANN001 - any EnginePool
    latencies: list[float] = []
    todo = iter(range(total))

    async def caller() -> None:
        for i in todo:
            t0 = time.perf_counter()
            res = await pool.generate(PROMPT, PARAMS, f"b{callers}-{i}-{time.monotonic_ns()}")
            assert len(res["output_ids"]) == PARAMS["max_new_tokens"], res["meta_info"]["finish_reason"]
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*[caller() for _ in range(callers)])
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {"callers": callers, "requests": len(lat), "req_per_s": round(len(lat) / wall, 1),
            "p50_ms": round(statistics.median(lat) * 1e3, 2), "p99_ms": round(lat[int(0.99 * (len(lat) - 1))] * 1e3, 2)}


async def overhead(model: str, run_dir: Path, total: int) -> list[dict]:
    rows = []
    local = LocalPool([TorchEngine(model, num_threads=1, **ENGINE)])
    serve = RayServePool(model, EnginesConfig(pool="ray_serve", num_replicas=1, cpus_per_replica=1), EngineArgs(num_threads=1, **ENGINE),
                         run_dir=run_dir)
    await local.start()
    await serve.start()
    try:
        for callers in (1, 64):
            n = total if callers > 1 else total // 4
            for name, pool in (("local", local), ("ray_serve", serve)):
                await load(pool, callers, 16)  # warm-up
                r = await load(pool, callers, n)
                rows.append({"pool": name, **r})
                print(f"  {name:9s} callers={callers:2d}: {r['req_per_s']:7.1f} req/s, p50 {r['p50_ms']:.2f} ms")
    finally:
        await serve.aclose()
        await local.aclose()
    return rows


async def broadcast(model: str, label: str, run_dir: Path, replicas: int, repeats: int = 5) -> dict:
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model).state_dict()
    pool = RayServePool(model, EnginesConfig(pool="ray_serve", num_replicas=replicas, cpus_per_replica=0.5),
                        EngineArgs(num_threads=1, **ENGINE), run_dir=run_dir)
    t0 = time.perf_counter()
    await pool.start()
    start_s = time.perf_counter() - t0
    times = []
    try:
        for v in range(1, repeats + 1):
            new = {k: t + 1e-3 * v for k, t in state.items()}
            t0 = time.perf_counter()
            await pool.weight_sync.load(new, v)
            times.append(time.perf_counter() - t0)
        await pool.refresh_stats()
        versions = sorted({s["weight_version"] for s in pool.stats()["replicas"]})
        assert versions == [str(repeats)], versions
    finally:
        await pool.aclose()
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    row = {"model": label, "weights_mb": round(mb, 1), "replicas": replicas, "start_s": round(start_s, 1),
           "update_s_median": round(statistics.median(times), 4), "update_s_min": round(min(times), 4)}
    print(f"  {label:9s} {mb:7.1f} MB x {replicas} replicas: update {row['update_s_median'] * 1e3:8.1f} ms "
          f"(start {start_s:.1f} s)")
    return row


async def main_async(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    out: dict = {"requests": args.requests}
    with tempfile.TemporaryDirectory(prefix="sp-", dir="/tmp") as tmp:
        run_dir = Path(tmp) / "run"
        models = {name: str(build_tiny_model(Path(tmp) / name, preset=name)) for name in args.models.split(",")}
        start_ray(run_dir, num_cpus=4)  # one session for every pool below (each pool leaves it running)
        print("per-request overhead (tiny model, 8 new tokens, greedy)")
        out["overhead"] = await overhead(models["tiny"], run_dir, args.requests)
        print("weight update: ray.put once, broadcast, every replica pulls and loads")
        out["broadcast"] = []
        for label, path in models.items():
            for n in (1, 2, 4):
                out["broadcast"].append(await broadcast(path, label, run_dir, n))
        import ray

        ray.shutdown()
    return out


def summarize(out: dict) -> None:
    by = {(r["pool"], r["callers"]): r for r in out["overhead"]}
    print("\n| callers | local req/s | ray_serve req/s | ratio | p50 local | p50 ray_serve | added p50 |")
    print("|---|---|---|---|---|---|---|")
    for c in (1, 64):
        a, b = by[("local", c)], by[("ray_serve", c)]
        print(f"| {c} | {a['req_per_s']} | {b['req_per_s']} | {b['req_per_s'] / a['req_per_s']:.2f}x | "
              f"{a['p50_ms']} ms | {b['p50_ms']} ms | +{b['p50_ms'] - a['p50_ms']:.1f} ms |")
    print("\n| model | MB | 1 replica | 2 replicas | 4 replicas | 4 vs 1 |")
    print("|---|---|---|---|---|---|")
    for label in dict.fromkeys(r["model"] for r in out["broadcast"]):
        rows = {r["replicas"]: r for r in out["broadcast"] if r["model"] == label}
        cells = " | ".join(f"{rows[n]['update_s_median'] * 1e3:.0f} ms" for n in (1, 2, 4))
        print(f"| {label} | {rows[1]['weights_mb']} | {cells} | "
              f"{rows[4]['update_s_median'] / rows[1]['update_s_median']:.2f}x |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--models", default="tiny,bench100m", help="comma-separated presets; tiny is always needed")
    args = ap.parse_args()
    if "tiny" not in args.models.split(","):
        args.models = "tiny," + args.models
    out = asyncio.run(main_async(args))
    summarize(out)
    write_results(RESULTS / "pools.json", {"requests": args.requests, "models": args.models}, out["requests"],
                  section="ray_serve", overhead=out["overhead"], broadcast=out["broadcast"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
