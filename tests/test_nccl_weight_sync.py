"""`/update_weights_from_distributed` over NCCL: a trainer on GPU 0 broadcasts new weights to a
`streamrl serve` process whose engine runs on GPU 1. Runs only where two CUDA GPUs are visible."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from streamrl.engine.http import SGLangClient
from streamrl.weights import BroadcastSync

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL weight sync needs two CUDA GPUs (none on the CPU CI machines)"
)
PROMPT = [1, 5, 6, 7]


def greedy(path: Path, n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, 4:].tolist()


async def test_nccl_broadcast_updates_a_gpu_server(engine_model_dir: Path, tiny_model_dir_b: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "streamrl.engine.http.server", "--model", str(engine_model_dir), "--port", "0",
           "--device", "cuda"]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, env=env)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        url = line.split(" on ")[1].strip()
        params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
        async with SGLangClient(url) as c:
            before = await c.generate(PROMPT, params)
            assert before["output_ids"] == greedy(engine_model_dir, 10)
            sync = BroadcastSync([c], backend="nccl", device="cuda:0")
            await sync.connect()
            await sync.load(load_file(tiny_model_dir_b / "model.safetensors"), 17)
            after = await c.generate(PROMPT, params)
            assert after["meta_info"]["weight_version"] == "17"
            assert after["output_ids"] == greedy(tiny_model_dir_b, 10) != before["output_ids"]
            await sync.aclose()
    finally:
        proc.terminate()
        await proc.wait()
