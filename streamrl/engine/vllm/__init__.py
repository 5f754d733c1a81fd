"""Real vLLM servers as rollout engines: `VLLMClient` speaks vLLM's token API and returns SGLang-shaped
results; `VLLMServer` launches one server from vLLM's own virtual environment. See docs/vllm.md."""

from .client import PAUSE_MODES, VLLMClient, vllm_sampling_params
from .launcher import VLLMServer, find_vllm_python

__all__ = ["PAUSE_MODES", "VLLMClient", "VLLMServer", "find_vllm_python", "vllm_sampling_params"]
