"""TorchEngine (continuous batching) vs transformers `model.generate` (static batches) on a rollout-like
workload, in one process run so the machine's noise hits both sides alike.

Workload: 256 requests submitted at once, prompt lengths 4-12 tokens, output lengths fixed per request
(ignore_eos + max_new_tokens). "longtail": most outputs a few tokens, ~10% ten times longer.
"uniform": every output the same length, where static batching is at its best.
`generate` runs arrival-order static batches of 32 (each runs until its longest member finishes);
TorchEngine receives all 256 at once with at most 32 running. Tokens/s counts *useful* tokens only
(the tokens each request asked for), the same numerator for both sides.

    python bench/engine_throughput.py [--models tiny,bench100m] [--requests 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from _table import print_table
from transformers import AutoModelForCausalLM, GenerationConfig

from streamrl.engine import TorchEngine
from streamrl.tasks.tiny_model import build_tiny_model

RESULTS = Path(__file__).parent / "results"


def workload(kind: str, n: int, context: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    short, long_ = (4, 40) if context <= 64 else (16, 160)
    for _ in range(n):
        prompt = [1] + [rng.randrange(4, 20) for _ in range(rng.randint(3, 11))]
        if kind == "uniform":
            length = short * 2
        else:
            length = long_ if rng.random() < 0.1 else rng.randint(max(1, short // 2), short)
        out.append((prompt, min(length, context - len(prompt))))
    return out


def run_generate(model, reqs, batch: int, seed: int) -> float:
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        att = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):  # left padding, as generate() expects for decoder-only
            ids[j, width - len(p) :] = torch.tensor(p)
            att[j, width - len(p) :] = 1
        gc = GenerationConfig(
            max_new_tokens=max(n for _, n in chunk), min_new_tokens=max(n for _, n in chunk),
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0,
        )
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=att, generation_config=gc)
    return time.perf_counter() - t0


async def run_engine(engine, reqs, seed: int) -> float:  # noqa: ANN001 - TorchEngine or VLLMClient: same generate()
    t0 = time.perf_counter()
    results = await asyncio.gather(*[
        engine.generate(p, {"max_new_tokens": n, "ignore_eos": True, "temperature": 1.0, "sampling_seed": seed + i})
        for i, (p, n) in enumerate(reqs)
    ])
    wall = time.perf_counter() - t0
    assert all(r["meta_info"]["completion_tokens"] == n for r, (_, n) in zip(results, reqs, strict=True))
    return wall


def bench_model(name: str, path: str, n: int, batch: int, seed: int, repeats: int) -> list[dict]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    context = model.config.max_position_embeddings
    rows = []

    async def engine_side(reqs):
        async with TorchEngine(path, device="cpu", max_running_requests=batch, load_tokenizer=False) as eng:
            await run_engine(eng, reqs[:batch], seed)  # warm-up
            return min([await run_engine(eng, reqs, seed) for _ in range(repeats)])

    for kind in ("longtail", "uniform"):
        reqs = workload(kind, n, context, seed)
        useful = sum(k for _, k in reqs)
        run_generate(model, reqs[:batch], batch, seed)  # warm-up
        gen_wall = min(run_generate(model, reqs, batch, seed) for _ in range(repeats))
        eng_wall = asyncio.run(engine_side(reqs))
        rows.append({
            "model": name, "params_m": round(params / 1e6, 2), "workload": kind, "requests": n,
            "useful_tokens": useful, "generate_wall_s": round(gen_wall, 3), "engine_wall_s": round(eng_wall, 3),
            "generate_tps": round(useful / gen_wall, 1), "engine_tps": round(useful / eng_wall, 1),
            "engine_wall_over_generate": round(eng_wall / gen_wall, 3),
        })
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,bench100m", help="presets of streamrl init-model")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "engine_throughput.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.models.split(","):
            path = build_tiny_model(Path(tmp) / preset, preset=preset, seed=args.seed)
            rows += bench_model(preset, str(path), args.requests, args.batch, args.seed, args.repeats)
    print_table(
        "TorchEngine vs model.generate (useful tokens/s, CPU)",
        ("model", "params M", "workload", "generate tok/s", "engine tok/s", "engine wall / generate wall"),
        ((r["model"], r["params_m"], r["workload"], r["generate_tps"], r["engine_tps"], r["engine_wall_over_generate"])
         for r in rows),
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "torch": torch.__version__, "python": sys.version.split()[0]}
    Path(args.out).write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
