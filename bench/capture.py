"""What the capture endpoint costs per model call: the same one-token turn through the episode's own
API (`observe_ids` + `generate`) and through the capture endpoint (the chat rendered and checked, HTTP
on 127.0.0.1, the answer parsed), with raw aiohttp, the `openai` SDK and the `anthropic` SDK. The real
TorchEngine and the tiny tool-calling model (`init-model --tools`); the ways alternate round by round
in one process, and the medians are compared.

    python bench/capture.py [--rounds 300]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
from _table import print_table, write_results
from transformers import AutoTokenizer

from streamrl.buffer import RolloutBuffer, StalenessController
from streamrl.config import ControllerConfig, RolloutConfig, ToolsConfig
from streamrl.engine import TorchEngine
from streamrl.rollout import LocalPool, RolloutManager, ToolBox
from streamrl.rollout.runner import Episode
from streamrl.tasks import Task, build_tiny_model
from streamrl.tasks.agent_tools import INSTRUCTIONS, TOOL_SCHEMA, TOOLS
from streamrl.types import Sample

RESULTS = Path(__file__).parent / "results"
CHAT = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "123*45="}]


async def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as tmp:
        model = build_tiny_model(Path(tmp) / "m", tools=True)
        tok = AutoTokenizer.from_pretrained(model)
        pool = LocalPool([TorchEngine(str(model), device="cpu", max_running_requests=8)])
        ctl = StalenessController(ControllerConfig(), batch_groups=1, max_groups=1)
        manager = RolloutManager(RolloutConfig(max_new_tokens=64, workflow="multi_turn_tools"), pool=pool,
                                 tokenizer=tok, task=Task(train=[{"prompt": "1", "answer": "1"}], held_out=[],
                                                          reward_fn=lambda t, a: 0.0),
                                 buffer=RolloutBuffer(), controller=ctl,
                                 tools=ToolBox(ToolsConfig(functions=["calculator"])))
        prompt = list(tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=True)["input_ids"])
        await pool.start()

        def episode(native: bool) -> Episode:
            return Episode(manager.ctx, Sample(group_id="b", prompt_ids=prompt if native else [1]), {})

        async def native() -> None:
            await episode(True).generate(max_new_tokens=1)

        http = aiohttp.ClientSession()

        async def raw() -> None:
            url = await episode(False).openai_url()
            async with http.post(url + "/chat/completions",
                                 json={"model": "policy", "messages": CHAT, "tools": TOOLS, "max_tokens": 1}) as r:
                assert r.status == 200, await r.text()
                await r.read()

        async def openai_sdk() -> None:
            ep = episode(False)
            async with openai.AsyncOpenAI(base_url=await ep.openai_url(), api_key="x", max_retries=0) as c:
                t0 = time.perf_counter()
                await c.chat.completions.create(model="policy", messages=CHAT, tools=TOOLS, max_tokens=1)
                return time.perf_counter() - t0

        async def anthropic_sdk() -> None:
            ep = episode(False)
            async with anthropic.AsyncAnthropic(base_url=await ep.anthropic_url(), api_key="x", max_retries=0) as c:
                t0 = time.perf_counter()
                await c.messages.create(model="policy", max_tokens=1, system=INSTRUCTIONS, messages=CHAT[1:],
                                        tools=[{"name": "calculator", "input_schema": TOOL_SCHEMA}])
                return time.perf_counter() - t0

        ways: dict[str, Any] = {"native (episode API)": native, "capture, aiohttp": raw,
                                "capture, openai SDK": openai_sdk, "capture, anthropic SDK": anthropic_sdk}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for i in range(rounds + 20):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                inner = await fn()  # the SDKs' client set-up is the agent's, not a call's: timed inside
                dt = inner if inner is not None else time.perf_counter() - t0
                if i >= 20:  # warm-up rounds left out
                    times[name].append(dt)
        await http.close()
        await manager.aclose()
        await pool.aclose()
    base = statistics.median(times["native (episode API)"])
    rows = [{"way": k, "median_ms": 1e3 * statistics.median(v), "p90_ms": 1e3 * statistics.quantiles(v, n=10)[-1],
             "overhead_ms": 1e3 * (statistics.median(v) - base)} for k, v in times.items()]
    print_table(f"one 1-token model turn, {rounds} rounds each (medians)", ["way", "median", "p90", "over native"],
                [[r["way"], f"{r['median_ms']:.2f} ms", f"{r['p90_ms']:.2f} ms", f"{r['overhead_ms']:+.2f} ms"]
                 for r in rows])
    write_results(RESULTS / "capture.json", {"rounds": rounds, "model": "tiny --tools", "turn": "1 token"}, rows)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300)
    asyncio.run(main(ap.parse_args().rounds))
