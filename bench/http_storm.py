"""Valid requests to `streamrl serve` alone, then in a storm of malformed and hostile requests, in one run.

One `streamrl serve` through the console script (tiny model, CPU, one torch thread). Phase "quiet":
only the valid requests (4 sampled tokens each) and a /health probe every 50 ms. Phase "storm": the
same valid requests spread evenly among N hostile ones (out-of-range sampling values, broken and
deeply nested JSON, huge prompts and fan-out, wrong content types, Origin headers, glob weight paths,
lying Content-Length, unknown methods) at 32 in flight. Reports the answers' status counts, the valid
requests' success and latency, the worst /health latency and the server's RSS. tests/test_http_limits.py
runs the same storm, smaller, and asserts on it.

    python bench/http_storm.py [--hostile 3000] [--valid 150]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

RESULTS = Path(__file__).parent / "results"
STREAMRL = str(Path(sys.executable).parent / "streamrl")
PROMPT = [1, 5, 6, 14, 7, 17]
ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions", "/pause_generation", "/continue_generation",
          "/update_weights_from_disk", "/update_weight_version", "/init_weights_update_group", "/abort_request",
          "/release_memory_occupation", "/flush_cache"]


class Serve:
    """`streamrl serve` through the console script, stderr to `log`; entering gives (url, process)."""

    def __init__(self, model: Path, log: Path, *args: str) -> None:
        self.cmd = [STREAMRL, "serve", "--model", str(model), "--port", "0", "--device", "cpu",
                    "--num-threads", "1", *args]
        self.log = log

    def __enter__(self) -> tuple[str, subprocess.Popen]:
        self.err = self.log.open("w")
        self.p = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self.err, text=True)
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        while "listening on" not in line:
            assert line, f"the server exited before listening: {self.log.read_text()}"
            line = self.p.stdout.readline()
        return line.rsplit(" ", 1)[-1].strip(), self.p

    def __exit__(self, *exc: object) -> None:
        self.p.terminate()
        self.p.wait(30)
        self.err.close()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def hostile(rng: random.Random) -> tuple[str, str, bytes, dict[str, str]]:
    """One malformed or hostile request: (method, path, body, headers)."""
    j = {"Content-Type": "application/json"}
    sp = rng.choice([
        {"top_k": 2**64 - 1}, {"top_k": 0}, {"max_new_tokens": -1}, {"max_new_tokens": 2**80}, {"temperature": -1},
        {"temperature": "hot"}, {"top_p": 0}, {"min_p": 2}, {"n": 10**9}, {"n": 0}, {"n": True},
        {"stop": [""] * 100}, {"stop_token_ids": [10**12]}, {"sampling_seed": 2**65}, {"frequency_penalty": 1},
        {"bogus": 1}, {"max_new_tokens": 10**6}, {"stop": 5},
    ])
    choice = rng.randrange(14)
    if choice == 0:
        return "POST", "/generate", json.dumps({"input_ids": PROMPT, "sampling_params": sp}).encode(), j
    if choice == 1:
        return "POST", "/generate", rng.choice([b"{", b"[]", b"null", b"\xff\xfe", b"{\"input_ids\": [1,", b"1e999",
                                                b"[" * 5000 + b"]" * 5000, b"{\"text\": " * 3000]), j
    if choice == 2:
        return "POST", "/generate", json.dumps(rng.choice([
            {"input_ids": [-1]}, {"input_ids": [10**30]}, {"input_ids": []}, {"input_ids": [[]]}, {"text": 5},
            {"text": "x", "input_ids": [1]}, {"input_ids": [1] * 5000}, {"input_ids": [PROMPT] * 5000},
            {"text": "9" * 300_000}, {"rid": 5, "input_ids": PROMPT}, {"input_ids": PROMPT, "return_logprob": "y"},
            {"input_ids": PROMPT, "logprob_start_len": 3}, {"input_ids": PROMPT, "lora_path": "x"},
        ])).encode(), j
    if choice == 3:
        return "POST", rng.choice(ROUTES), b'{"mode": "abort"}', {"Content-Type": rng.choice(
            ["text/plain", "application/x-www-form-urlencoded", "image/png"])}
    if choice == 4:
        return "POST", rng.choice(ROUTES), b"{}", {**j, "Origin": "http://evil.example"}
    if choice == 5:
        return "POST", "/update_weights_from_disk", json.dumps({"model_path": rng.choice(
            ["/etc/*", "/", "/nonexistent", "*", "../../..", 5, "/proc/self"])}).encode(), j
    if choice == 6:
        return "POST", "/pause_generation", json.dumps({"mode": rng.choice(["nope", 5, None, "x" * 1000])}).encode(), j
    if choice == 7:
        return "POST", "/init_weights_update_group", json.dumps(rng.choice([
            {}, {"master_address": 5}, {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1,
                                        "world_size": 2},
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "mpi"},
        ])).encode(), j
    if choice == 8:
        return "POST", "/v1/completions", json.dumps(rng.choice([
            {"prompt": None}, {"prompt": "1+2=", "n": 10**9}, {"prompt": "1+2=", "max_tokens": -5},
            {"prompt": "1+2=", "top_k": 2**64}, {"prompt": [[-1]]}, {"prompt": "1", "logit_bias": {"1": 5}},
            {"prompt": "1", "echo": True}, {"prompt": "1+2=", "seed": 2**70},
        ])).encode(), j
    if choice == 9:
        return "POST", "/v1/chat/completions", json.dumps(rng.choice([
            {"messages": []}, {"messages": [{"role": 5}]}, {"messages": "hi"},
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            {"messages": [{"role": "user", "content": "1"}], "tools": [{"type": "function"}]},
            {"messages": [{"role": "user", "content": "1"}], "n": 2**40},
        ])).encode(), j
    if choice == 10:
        return rng.choice(["GET", "DELETE", "PATCH"]), rng.choice(ROUTES + ["/nope", "/v1/models/x"]), b"", {}
    if choice == 11:
        return "POST", "/abort_request", json.dumps(rng.choice([{"rid": 5}, {"abort_all": "yes"}, [1]])).encode(), j
    if choice == 12:
        return "POST", "/update_weight_version", json.dumps(rng.choice([{}, {"new_version": 5}])).encode(), j
    return "POST", "/generate", b'{"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 3}}', {
        "Content-Type": "application/json", "Content-Length": "999999999"}


async def storm(url: str, pid: int, *, n_hostile: int, n_valid: int, concurrency: int = 32) -> dict[str, Any]:
    """`n_valid` valid requests spread evenly among `n_hostile` hostile ones, `concurrency` in flight."""
    rng = random.Random(0)
    total = n_hostile + n_valid
    valid_at = {i * total // n_valid for i in range(n_valid)}
    stats: dict[str, Any] = {"hostile": 0, "5xx": 0, "4xx": 0, "valid": 0, "valid_ok": 0, "health_worst_s": 0.0,
                             "rss_max_mb": 0.0, "statuses": {}}
    latencies: list[float] = []
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=60)
    # Valid requests and health probes on connections of their own: the server closes a connection
    # after refusing a body it did not read, and a client reusing it would see that, not the server.
    async with aiohttp.ClientSession(timeout=timeout) as s, aiohttp.ClientSession(timeout=timeout) as good:

        async def health() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                async with good.get(url + "/health") as r:
                    assert r.status == 200
                stats["health_worst_s"] = max(stats["health_worst_s"], time.monotonic() - t0)
                stats["rss_max_mb"] = max(stats["rss_max_mb"], rss_mb(pid))
                await asyncio.sleep(0.05)

        async def one(k: int) -> None:
            if k in valid_at:
                stats["valid"] += 1
                body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True,
                                                                 "temperature": 1.0, "top_k": 5}}
                t0 = time.monotonic()
                async with good.post(url + "/generate", json=body) as r:
                    out = await r.json()
                    stats["valid_ok"] += r.status == 200 and len(out["output_ids"]) == 4
                latencies.append(time.monotonic() - t0)
                return
            method, path, body, headers = hostile(rng)
            try:
                async with s.request(method, url + path, data=body, headers=headers) as r:
                    await r.read()
                    code = r.status
            except (TimeoutError, aiohttp.ClientError):  # the server may cut a lying body short
                code = -1
            stats["hostile"] += 1
            stats["statuses"][code] = stats["statuses"].get(code, 0) + 1
            stats["5xx"] += code >= 500
            stats["4xx"] += 400 <= code < 500

        prober = asyncio.ensure_future(health())
        sem = asyncio.Semaphore(concurrency)

        async def bounded(k: int) -> None:
            async with sem:
                await one(k)

        t0 = time.monotonic()
        await asyncio.gather(*[bounded(k) for k in range(total)])
        stats["wall_s"] = time.monotonic() - t0
        stop.set()
        await prober
    lat = sorted(latencies)
    stats |= {"valid_p50_ms": statistics.median(lat) * 1e3, "valid_p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1e3}
    return stats


def main(argv: list[str] | None = None) -> int:
    from _table import print_table, write_results

    from streamrl.tasks import build_tiny_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hostile", type=int, default=3000)
    ap.add_argument("--valid", type=int, default=150)
    ap.add_argument("--out", default=str(RESULTS / "http_storm.json"))
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "m", preset="tiny", initializer_range=0.5)
        log = Path(tmp) / "serve.log"
        with Serve(model, log, "--max-running-requests", "16") as (url, proc):
            rss0 = rss_mb(proc.pid)
            for phase, n in (("quiet", 0), ("storm", args.hostile)):
                st = asyncio.run(storm(url, proc.pid, n_hostile=n, n_valid=args.valid))
                rows.append({"phase": phase, "rss_start_mb": round(rss0, 1), **st})
            alive = proc.poll() is None
        tracebacks = log.read_text().count("Traceback")
    print_table("streamrl serve: valid requests, alone and in a storm", [
        "phase", "hostile", "5xx", "4xx", "valid ok", "valid p50 / p99 ms", "/health worst ms", "RSS max MB"],
        [(r["phase"], r["hostile"], r["5xx"], r["4xx"], f"{r['valid_ok']}/{r['valid']}",
          f"{r['valid_p50_ms']:.0f} / {r['valid_p99_ms']:.0f}", f"{r['health_worst_s'] * 1e3:.0f}",
          f"{r['rss_max_mb']:.0f} (start {r['rss_start_mb']:.0f})") for r in rows])
    print(f"server alive after the storm: {alive}; tracebacks in its log: {tracebacks}")
    write_results(args.out, {"hostile": args.hostile, "valid": args.valid, "concurrency": 32,
                             "server": "streamrl serve, tiny model, CPU, 1 thread, --max-running-requests 16"},
                  rows, server_alive=alive, tracebacks_in_log=tracebacks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
