"""Decode step of the embedded engine: compiled CPU attention kernel vs PyTorch SDPA, side by side.

One `ModelRunner.decode` step (the whole forward: projections, MLPs, attention, logits) at several
batch sizes, rows with long-tail context lengths (most short, as in RL rollouts, plus a few long
ones; `--contexts long` makes every row long, as in the tail of a batch). Each size runs both paths
in short alternating blocks (medians reported), so the machine's drift hits both alike. Also the attention op
alone (one layer). Single thread, as the engine runs here.

    python bench/decode_attention.py [--presets tiny,bench100m] [--rows 1,3,10,20,40]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _table import print_table
from transformers import AutoModelForCausalLM

from streamrl.engine import kernels
from streamrl.engine.model_runner import ModelRunner
from streamrl.tasks.tiny_model import build_tiny_model

RESULTS = Path(__file__).parent / "results"


def paired_ms(fns: dict, reps: int, blocks: int) -> dict[str, float]:  # noqa: ANN001
    """Median ms per call of each function, timed in short alternating blocks: the machine's drift
    (20-40 % within minutes here) then hits every side alike."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(blocks):
        for k, fn in fns.items():
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            times[k].append((time.perf_counter() - t) / reps * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def lengths(n: int, context: int, kind: str, rng: random.Random) -> list[int]:
    if kind == "long":
        return [rng.randint(context // 3, context - 2) for _ in range(n)]
    # ~1 row in 5 long (a thought being generated), the rest short answers
    return [rng.randint(context // 3, context - 2) if rng.random() < 0.2 else rng.randint(4, 16) for _ in range(n)]


def time_rows(runners: dict[str, ModelRunner], lens: list[int], reps: int, blocks: int) -> dict[str, float]:
    b, kr = len(lens), runners["kernel"]
    out = {}
    with torch.inference_mode():
        # Both decode over the same (untrained, zero) cache: timing only; tests check the numbers.
        steps = paired_ms({k: (lambda r=r: r.decode([3] * b, lens)) for k, r in runners.items()}, reps, blocks)
        for name, ms in steps.items():
            out[f"step_ms_{name}"] = round(ms, 3)
        q = torch.randn(b, kr.num_heads, kr.head_dim)
        keys = torch.tensor(lens) + 1
        span = int(keys.max())
        mask = (torch.arange(span)[None, :] < keys[:, None])[:, None, None, :]
        kc, vc = runners["sdpa"].k_cache[0], runners["sdpa"].v_cache[0]
        attn = paired_ms({
            "kernel": lambda: kr.kernel(q, kr.k_cache[0], kr.v_cache[0], keys, kr.scale),
            "sdpa": lambda: F.scaled_dot_product_attention(
                q[:, :, None], kc[:b, :, :span], vc[:b, :, :span], attn_mask=mask, scale=kr.scale),
        }, reps * 4, blocks)
    out["attn_us_kernel"], out["attn_us_sdpa"] = round(1e3 * attn["kernel"], 1), round(1e3 * attn["sdpa"], 1)
    return out


def bench_preset(preset: str, rows: list[int], context: int, kind: str, blocks: int, tmp: Path) -> list[dict]:
    """Every row count, both paths; the attention op alone on layer 0's cache."""
    path = tmp / preset
    build_tiny_model(path, preset=preset, seed=0, max_position_embeddings=context)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runners = {"kernel": ModelRunner(model, max(rows), context),
               "sdpa": ModelRunner(model, max(rows), context, cpu_kernel=False)}
    assert runners["kernel"].kernel is not None, "the kernel did not build; see the warning above"
    rng = random.Random(0)
    out = []
    for b in rows:
        lens = lengths(b, context, kind, rng)
        row = {"preset": preset, "rows": b, "contexts": kind, "mean_context": round(sum(lens) / b, 1),
               **time_rows(runners, lens, 20 if preset == "tiny" else 2, blocks)}
        row["step_speedup"] = round(row["step_ms_sdpa"] / row["step_ms_kernel"], 2)
        row["attn_speedup"] = round(row["attn_us_sdpa"] / row["attn_us_kernel"], 2)
        print(row, flush=True)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,bench100m")
    ap.add_argument("--rows", default="1,3,10,20,40")
    ap.add_argument("--context", type=int, default=320, help="model context (the async bench's think task: 320)")
    ap.add_argument("--contexts", default="mixed,long", help="row length mixes to run: mixed, long")
    ap.add_argument("--blocks", type=int, default=30, help="alternating timing blocks per side")
    ap.add_argument("--out", default=str(RESULTS / "decode_attention.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [int(x) for x in args.rows.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            for kind in args.contexts.split(","):
                results += bench_preset(preset, rows, args.context, kind, args.blocks, Path(tmp))

    cols = ["preset", "contexts", "rows", "mean_context", "step_ms_sdpa", "step_ms_kernel", "step_speedup",
            "attn_us_sdpa", "attn_us_kernel", "attn_speedup"]
    print_table("decode step, compiled CPU kernel vs PyTorch SDPA (1 thread)", cols,
                ([r[c] for c in cols] for r in results))
    meta = {"context": args.context, "threads": 1, "torch": torch.__version__, "python": sys.version.split()[0],
            "kernel": kernels.decode_attention() is not None}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
