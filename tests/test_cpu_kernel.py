"""The compiled CPU decode-attention kernel: exact against plain PyTorch, strict about its inputs, the
same tokens and logprobs as the SDPA path inside the engine, and a clean fallback where it cannot build."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch
from test_engine import hf, hf_logprobs

from streamrl.engine import TorchEngine, kernels
from streamrl.engine.model_runner import ModelRunner


def reference(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention in float64, one row at a time over exactly its keys."""
    b, h, _ = q.shape
    group = h // kt.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(b):
        n = int(lens[r])
        for j in range(h):
            k = kt[r, j // group, :, :n].double()  # [D, n]
            w = torch.softmax((q[r, j].double() @ k) * scale, -1)  # [n]
            out[r, j] = w @ v[r, j // group, :n].double()
    return out


@pytest.fixture(scope="module")
def kernel():
    op = kernels.decode_attention()
    assert op is not None, "the kernel must build on Linux with a C++ compiler (see the log warning above)"
    return op


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 32), (8, 2, 64), (2, 1, 16)])
def test_matches_plain_attention(kernel, heads: int, kv_heads: int, dim: int) -> None:
    g = torch.Generator().manual_seed(heads * 100 + dim)
    rows, max_len, b = 9, 70, 7
    kt = torch.randn(rows, kv_heads, dim, max_len, generator=g)
    v = torch.randn(rows, kv_heads, max_len, dim, generator=g)
    q = torch.randn(b, heads, dim, generator=g) * 3  # peaked softmax: max-subtraction matters
    lens = torch.tensor([1, 70, 2, 33, 69, 5, 17])  # block edges (16, 32, 64) and a partial last block
    kb = kernels.block_keys(kt.transpose(-1, -2)).contiguous()
    assert kb.shape == (rows, kv_heads, 5, dim, kernels.BLOCK)
    got = kernel(q, kb, v, lens, dim**-0.5)
    assert got.shape == (b, heads, dim) and got.dtype == torch.float32
    assert (got.double() - reference(q, kt, v, lens, dim**-0.5)).abs().max() <= 1e-5
    # Rows b.. of the cache and positions past each row's length play no part.
    kt[b:], v[b:] = float("nan"), float("nan")
    for r, n in enumerate(lens.tolist()):
        kt[r, :, :, n:], v[r, :, n:] = float("nan"), float("nan")
    kb = kernels.block_keys(kt.transpose(-1, -2)).contiguous()
    assert torch.equal(kernel(q, kb, v, lens, dim**-0.5), got)


def test_rejects_bad_input(kernel) -> None:
    q, kb, v = torch.randn(2, 4, 8), torch.randn(2, 4, 1, 8, 16), torch.randn(2, 4, 16, 8)
    for lens, msg in [(torch.tensor([0, 3]), "lens out of range"), (torch.tensor([3, 17]), "lens out of range"),
                      (torch.tensor([3.0, 3.0]), "int64")]:
        with pytest.raises(RuntimeError, match=msg):
            kernel(q, kb, v, lens, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(q.double(), kb, v, torch.tensor([3, 3]), 1.0)
    ok = torch.tensor([3, 3])
    for bad_kb, bad_v in [(kb, torch.randn(2, 4, 17, 8)),  # 17 positions do not fit one block
                          (kb, torch.randn(2, 4, 16, 7)), (torch.randn(2, 4, 1, 8, 8), v)]:
        with pytest.raises(RuntimeError, match="shape mismatch"):
            kernel(q, bad_kb, bad_v, ok, 1.0)
    with pytest.raises(RuntimeError, match="bad ranks"):  # the [D, L] layout of 2026-12-01
        kernel(q, torch.randn(2, 4, 8, 16), v, ok, 1.0)


async def test_engine_same_tokens_and_logprobs_with_and_without_kernel(tiny_model_dir: Path) -> None:
    """Mixed prompt lengths and budgets, so rows finish at different steps and the cache is compacted
    (rows move) while others keep decoding."""
    prompts = [[1] + [4 + (i * j) % 17 for j in range(n)] for i, n in enumerate([2, 30, 3, 45, 5, 12])]
    budgets = [3, 12, 7, 16, 1, 9]
    results = {}
    for use in (True, False):
        async with TorchEngine(str(tiny_model_dir), device="cpu", max_running_requests=8, cpu_kernel=use) as eng:
            assert isinstance(eng.runner, ModelRunner) and eng.runner.k_blocked is use
            results[use] = await asyncio.gather(*[
                eng.generate(p, {"max_new_tokens": n, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True})
                for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))
            ])
    model = hf(tiny_model_dir)
    for p, a, b in zip(prompts, results[True], results[False], strict=True):
        assert a["output_ids"] == b["output_ids"]
        la = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
        lb = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) <= 1e-5
        assert max(abs(x - y) for x, y in zip(la, hf_logprobs(model, p, a["output_ids"]), strict=True)) <= 1e-4


def test_unavailable_kernel_means_sdpa(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils import cpp_extension

    model = hf(tiny_model_dir)
    try:
        kernels.decode_attention.cache_clear()
        monkeypatch.setenv("STREAMRL_CPU_KERNELS", "0")
        assert kernels.decode_attention() is None
        runner = ModelRunner(model, 4, 32)
        assert runner.kernel is None and not runner.k_blocked
        assert runner.k_cache[0].shape == runner.v_cache[0].shape

        kernels.decode_attention.cache_clear()
        monkeypatch.delenv("STREAMRL_CPU_KERNELS")

        def broken(**_: object) -> None:
            raise RuntimeError("Error building extension 'x': no compiler")

        monkeypatch.setattr(cpp_extension, "load", broken)
        with caplog.at_level(logging.WARNING):
            assert kernels.decode_attention() is None
        assert "no compiler" in caplog.text and "using PyTorch SDPA" in caplog.text
    finally:
        kernels.decode_attention.cache_clear()
