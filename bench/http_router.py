"""`/generate` direct to `streamrl serve` workers vs through the real sglang-router, in one run.

Two `streamrl serve` processes (tiny model, CPU, one torch thread each) and one sglang-router
(round robin) on 127.0.0.1. For 1, 16 and 64 concurrent clients, each path gets the same number of
requests (8 new tokens each, greedy, prompts of 6 tokens); "direct" spreads requests over the two
workers client-side, round robin. Reports requests/s and p50/p99 latency, and the router's overhead.

    python bench/http_router.py [--requests 256]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
from _table import print_table, write_results

from streamrl.engine.args import EngineArgs
from streamrl.rollout.http_pool import RouterProcess, ServerProcess
from streamrl.tasks import build_tiny_model

RESULTS = Path(__file__).parent / "results"
BODY = {"input_ids": [1, 7, 11, 14, 8, 12], "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                "ignore_eos": True}}


async def load(urls: list[str], clients: int, total: int) -> dict:
    latencies: list[float] = []
    order = itertools.cycle(urls)
    todo = iter(range(total))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def client() -> None:
            for _ in todo:
                url = next(order)
                t0 = time.perf_counter()
                async with s.post(f"{url}/generate", json=BODY) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*[client() for _ in range(clients)])
        wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {"requests": len(lat), "req_per_s": round(len(lat) / wall, 1),
            "p50_ms": round(statistics.median(lat) * 1e3, 2), "p99_ms": round(lat[int(0.99 * (len(lat) - 1))] * 1e3, 2)}


async def main_async(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "m", preset="tiny")
        args = EngineArgs(device="cpu", max_running_requests=64, num_threads=1, weight_version="0")
        servers = [ServerProcess(str(model), args.replica(i), log_path=Path(tmp) / f"w{i}.log") for i in range(2)]
        router = RouterProcess(Path(tmp) / "router.log")
        try:
            workers = await asyncio.gather(*[s.start() for s in servers])
            router_url = await router.start(list(workers))
            await load(list(workers), 4, 16)  # warm-up both paths
            await load([router_url], 4, 16)
            rows = []
            for c in (1, 16, 64):
                direct = await load(list(workers), c, args.requests)
                routed = await load([router_url], c, args.requests)
                rows.append({"clients": c, "direct": direct, "router": routed,
                             "router_p50_overhead_ms": round(routed["p50_ms"] - direct["p50_ms"], 2),
                             "router_rps_ratio": round(routed["req_per_s"] / direct["req_per_s"], 3)})
                print(rows[-1], flush=True)
            return rows
        finally:
            await router.stop()
            await asyncio.gather(*[s.stop() for s in servers])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--out", default=str(RESULTS / "pools.json"), help="its `router` part")
    args = ap.parse_args(argv)
    rows = asyncio.run(main_async(args))
    print_table(
        "/generate: direct to 2 workers vs through sglang-router (CPU, tiny model)",
        ("clients", "direct req/s", "router req/s", "direct p50/p99 ms", "router p50/p99 ms"),
        ((r["clients"], r["direct"]["req_per_s"], r["router"]["req_per_s"],
          f"{r['direct']['p50_ms']} / {r['direct']['p99_ms']}", f"{r['router']['p50_ms']} / {r['router']['p99_ms']}")
         for r in rows),
    )
    write_results(args.out, {"requests": args.requests}, rows, section="router")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
