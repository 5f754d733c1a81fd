"""The embedded engine's GPU runner: paged KV sized by a token budget, Triton kernels, CUDA graphs
(`runner.PagedRunner`). Imports Triton; TorchEngine loads it only when it runs on a GPU."""

from .runner import PAGE, PagedRunner, supports_paged

__all__ = ["PAGE", "PagedRunner", "supports_paged"]
