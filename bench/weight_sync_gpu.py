"""Weight updates and memory on one GPU (colocated mode), one process run.

The policy has Qwen2.5-0.5B's shape and vocabulary (random weights). The trainer holds it in float32
on the GPU, a TorchEngine in bfloat16 beside it, as `engines.colocate` runs them. Measured:

- **GPU copy** (colocated, one process): `LocalPool.push_weights` — pause, every tensor copied from
  the trainer's GPU memory into the engine's (dtype cast on the GPU), resume; no disk, no host.
- **disk**: the trainer saves a safetensors folder, the engine loads it (`update_weights_from_disk`):
  what an engine in another process without a shared GPU gets.
- **release / restore** (colocated step): the engine frees its KV cache (and with weights offload its
  weights too) and takes them back, graphs recaptured; its GPU memory while released, against its
  serving footprint (KV cache + weights + graphs, from the allocator's counters).

NCCL broadcast (the disaggregated path) needs two GPUs; it is not measured here.

    python bench/weight_sync_gpu.py [--repeats 5] [--kv-tokens 262144]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _table import print_table, write_results

from streamrl.config import TrainerConfig
from streamrl.engine import TorchEngine
from streamrl.rollout.pools import LocalPool
from streamrl.tasks import build_tiny_model
from streamrl.trainer import Trainer

RESULTS = Path(__file__).parent / "results"


async def measure(model_dir: Path, repeats: int, kv_tokens: int, work: Path) -> list[dict]:
    trainer = Trainer(TrainerConfig(device="cuda"), str(model_dir))
    weights = trainer.state_dict_for_engines()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    eng = TorchEngine(str(model_dir), device="cuda", dtype="bfloat16", max_running_requests=128,
                      max_total_tokens=kv_tokens, load_tokenizer=False)
    pool = LocalPool([eng])
    rows = []
    async with pool:
        await eng.generate([1, 2, 3], {"max_new_tokens": 4})
        torch.cuda.synchronize()
        serving = torch.cuda.memory_allocated() - base
        version = 0
        gpu, disk = [], []
        for _ in range(repeats):
            version += 1
            gpu.append(await pool.push_weights(weights, version))
        folder = work / "weights"
        for _ in range(repeats):
            version += 1
            t0 = time.perf_counter()
            trainer.model.save_pretrained(folder)
            await eng.update_weights_from_disk(str(folder), str(version))
            disk.append(time.perf_counter() - t0)
        rows.append({"method": "GPU copy (colocated, one process)", "seconds": statistics.median(gpu),
                     "seconds_all": [round(x, 4) for x in gpu]})
        rows.append({"method": "disk (safetensors save + load)", "seconds": statistics.median(disk),
                     "seconds_all": [round(x, 3) for x in disk]})
        for offload in (False, True):
            rel, res, during = [], [], []
            for _ in range(repeats):
                await pool.pause("abort")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                await pool.release_memory(weights=offload)
                torch.cuda.synchronize()
                rel.append(time.perf_counter() - t0)
                during.append(torch.cuda.memory_allocated() - base)
                t1 = time.perf_counter()
                await pool.resume_memory()
                version += 1
                await pool.push_weights(weights, version, pause=None)
                await pool.resume()
                torch.cuda.synchronize()
                res.append(time.perf_counter() - t1)
            out = await eng.generate([1, 2, 3], {"max_new_tokens": 4})
            assert len(out["output_ids"]) == 4  # serving again after the restore
            rows.append({"method": f"release {'KV + weights' if offload else 'KV'} / restore + push",
                         "seconds": statistics.median(rel), "restore_s": statistics.median(res),
                         "engine_gib_serving": serving / 2**30, "engine_gib_released": max(during) / 2**30,
                         "released_frac": max(during) / serving})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-tokens", type=int, default=262144, help="the engine's KV pool (engines.max_total_tokens)")
    ap.add_argument("--out", default=str(RESULTS / "gpu.json"), help="its `weights` part")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "qwen", preset="qwen2.5-0.5b", vocab_size=151936)
        rows = asyncio.run(measure(model_dir, args.repeats, args.kv_tokens, Path(tmp)))
    for r in rows:
        for k, v in list(r.items()):
            if isinstance(v, float):
                r[k] = round(v, 4)
    cols = ["method", "seconds", "restore_s", "engine_gib_serving", "engine_gib_released", "released_frac"]
    print_table("weight updates and engine memory, Qwen2.5-0.5B shape (494 M parameters), one GPU", cols,
                ([r.get(c) for c in cols] for r in rows))
    write_results(args.out, section="weights", meta={"device": torch.cuda.get_device_name(), "kv_tokens": args.kv_tokens,
                             "repeats": args.repeats}, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
