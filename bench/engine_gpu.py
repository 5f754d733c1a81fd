"""TorchEngine on a GPU against transformers' `generate` and the memory-bandwidth roofline, one process run.

The model has Qwen2.5-0.5B's shape and vocabulary (random weights, bf16, built here offline). Every
side decodes greedily with EOS ignored from 128-token prompts: TorchEngine `--new` tokens per request
(all requests submitted at once, wall time from submission to the last result, prefill included);
`generate` one static batch of `--generate-new` tokens (fewer: its per-token rate is the same or
better at the shorter context, so the comparison flatters it). The roofline is one decode step's bytes
(the weights, plus every row's KV at the mean context) at the device-to-device copy bandwidth
measured in the same run. Also reported: the engine's KV pool and the GPU memory it took.

    python bench/engine_gpu.py [--batches 1,32,128,256] [--new 256] [--generate-new 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch
from _table import print_table, write_results

from streamrl.engine import TorchEngine
from streamrl.tasks import build_tiny_model

RESULTS = Path(__file__).parent / "results"


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write counted), best of 10 on 2 GiB."""
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del a, b
    return 2 * (1 << 31) / best


async def engine_rate(model_dir: Path, batch: int, prompt: int, new: int, runner: str) -> dict:
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    eng = TorchEngine(str(model_dir), device="cuda", dtype="bfloat16", max_running_requests=batch,
                      max_total_tokens=batch * (prompt + new), runner=runner, load_tokenizer=False)
    start_s = time.perf_counter() - t0
    params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 150000, (prompt,), generator=g).tolist() for _ in range(batch)]
    async with eng:
        warm = prompts[: min(2, batch)]
        await eng.generate_many(warm, [params | {"max_new_tokens": 8}] * len(warm), [None] * len(warm))
        s0 = eng.stats()
        t1 = time.perf_counter()
        out = await eng.generate_many(prompts, [params] * batch, [None] * batch)
        wall = time.perf_counter() - t1
        stats = eng.stats()
        steps = stats["num_steps"] - s0["num_steps"]  # of the timed run only (prefill steps included)
        replay_ms = graph_replay_ms(eng.runner, batch)
    assert all(len(r["output_ids"]) == new for r in out)
    row = {"tokens_per_s": round(batch * new / wall, 1), "wall_s": round(wall, 3), "start_s": round(start_s, 2),
           "kv_tokens": stats["kv_tokens"], "kv_gib": round(stats["kv_cache_bytes"] / 2**30, 3),
           "gpu_gib": round((torch.cuda.max_memory_allocated() - before) / 2**30, 3), "runner": stats["runner"],
           "step_ms": round(1000 * (stats["busy_s"] - s0["busy_s"]) / max(steps, 1), 3), "graph_replay_ms": replay_ms}
    del eng
    torch.cuda.empty_cache()
    return row


def graph_replay_ms(runner, batch: int) -> float | None:
    """GPU time of one decode step alone: the captured graph of `batch` replayed back to back."""
    graphs = getattr(runner, "_graphs", None)
    if not graphs:
        return None
    size = min(g for g in graphs if g >= batch)
    graph = graphs[size][0]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) * 1000 / 50, 3)


def generate_rate(model, batch: int, prompt: int, new: int) -> float:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, 150000, (batch, prompt), generator=g).cuda()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    torch.cuda.synchronize()
    assert out.shape[1] == prompt + new
    return batch * new / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--generate-new", type=int, default=64)
    ap.add_argument("--runner", default="paged", choices=["paged", "slots"], help="TorchEngine's runner")
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "gpu.json"), help="its `engine` part")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    bw = copy_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "qwen", preset="qwen2.5-0.5b", vocab_size=151936, dtype="bfloat16")
        from transformers import AutoModelForCausalLM

        cfg = json.loads((model_dir / "config.json").read_text())
        rows = []
        for b in batches:
            row = {"batch": b} | asyncio.run(engine_rate(model_dir, b, args.prompt, args.new, args.runner))
            rows.append(row)
            print(row, flush=True)
        hf = None if args.skip_generate else AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16).cuda().eval()
        weight_bytes = sum(p.numel() * 2 for p in (hf or AutoModelForCausalLM.from_pretrained(model_dir)).parameters())
        kv_per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg[
            "num_attention_heads"]) * 2
        for row in rows:
            b = row["batch"]
            ctx = args.prompt + args.new / 2
            row["roofline_tokens_per_s"] = round(b / ((weight_bytes + b * ctx * kv_per_token) / bw))
            row["engine_vs_roofline"] = round(row["tokens_per_s"] / row["roofline_tokens_per_s"], 4)
            if hf is not None:
                with torch.inference_mode():
                    row["generate_tokens_per_s"] = round(generate_rate(hf, b, args.prompt, args.generate_new), 1)
                row["engine_vs_generate"] = round(row["tokens_per_s"] / row["generate_tokens_per_s"], 2)
            print(row, flush=True)
    cols = ["batch", "tokens_per_s", "generate_tokens_per_s", "engine_vs_generate", "roofline_tokens_per_s",
            "engine_vs_roofline", "step_ms", "graph_replay_ms", "kv_tokens", "kv_gib", "gpu_gib", "start_s"]
    print_table(f"TorchEngine ({args.runner}) vs generate, Qwen2.5-0.5B shape, bf16, {args.prompt}-token prompts, "
                f"{args.new} new tokens (generate: {args.generate_new})", cols,
                ([r.get(c) for c in cols] for r in rows))
    write_results(args.out, section="engine", meta={"device": torch.cuda.get_device_name(), "copy_bandwidth_tb_s": round(bw / 1e12, 2),
                             "prompt": args.prompt, "new": args.new, "generate_new": args.generate_new,
                             "runner": args.runner}, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
