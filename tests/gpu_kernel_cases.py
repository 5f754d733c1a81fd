"""The paged runner's Triton kernels (streamrl/engine/gpu) against PyTorch references, the runner's
forward against transformers, and TorchEngine through it. Collected by tests/test_gpu_kernels.py: on
a GPU in its own process, compiled, in float32 and bfloat16; elsewhere in a child process under
Triton's interpreter (TRITON_INTERPRET=1: CPU tensors, numpy), which checks the kernels' logic
(indexing, masks, the online softmax, the hash) but not their speed or the GPU's arithmetic.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", "on CPU these run under TRITON_INTERPRET=1 (test_gpu_kernels.py)"

from transformers import AutoModelForCausalLM  # noqa: E402

from streamrl.engine.gpu import kernels as K  # noqa: E402
from streamrl.engine.gpu.runner import PAGE, PagedRunner, supports_paged  # noqa: E402
from streamrl.engine.sampling import SamplingBatch, counter_uniforms, sample_counter  # noqa: E402
from streamrl.tasks.tiny_model import build_tiny_model  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_transformers_norm_of_the_residual_sum(dtype: torch.dtype) -> None:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = Qwen2RMSNorm(96, eps=1e-6)
    norm.weight.data = torch.rand(96, generator=g) + 0.5
    norm = norm.to(DEV, dtype)
    x, res = (torch.randn(5, 96, generator=g).to(DEV, dtype) for _ in range(2))
    out, new_res = K.add_rms_norm(x, res.clone(), norm.weight, 1e-6)
    ref_res = x + res
    _close(new_res, ref_res, dtype)
    _close(out, norm(ref_res), dtype)
    out0, same = K.add_rms_norm(x, None, norm.weight, 1e-6)  # the first layer: no residual yet
    assert same is x
    _close(out0, norm(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_swiglu(dtype: torch.dtype) -> None:
    gu = torch.randn(3, 2 * 70, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    _close(K.silu_mul(gu), torch.nn.functional.silu(gu[:, :70]) * gu[:, 70:], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_rotates_q_k_in_place_and_writes_the_cache(dtype: torch.dtype) -> None:
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    heads, kv_heads, hd, n, max_len = 6, 2, 32, 7, 50
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * hd, generator=g).to(DEV, dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.outer(torch.arange(max_len).float(), inv)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(DEV), emb.sin().to(DEV)
    pos = torch.tensor([0, 3, 49, 7, 7, 12, 1], device=DEV)
    slots = torch.tensor([5, -1, 0, 9, 2, 30, 31], device=DEV)
    kc = torch.zeros(40, kv_heads, hd, dtype=dtype, device=DEV)
    vc = torch.zeros_like(kc)
    before = qkv.clone()
    K.rope_store(qkv, cos, sin, pos, slots, kc, vc, heads, kv_heads, hd)
    q0 = before[:, : heads * hd].view(n, heads, hd).transpose(0, 1).float()
    k0 = before[:, heads * hd : (heads + kv_heads) * hd].view(n, kv_heads, hd).transpose(0, 1).float()
    q_ref, k_ref = apply_rotary_pos_emb(q0[None], k0[None], cos[pos][None], sin[pos][None])
    q_ref, k_ref = q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)  # [n, heads, hd]
    _close(qkv[:, : heads * hd].view(n, heads, hd), q_ref, dtype)
    _close(qkv[:, heads * hd : (heads + kv_heads) * hd].view(n, kv_heads, hd), k_ref, dtype)
    v = before[:, (heads + kv_heads) * hd :].view(n, kv_heads, hd)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            _close(kc[s], k_ref[t], dtype)
            torch.testing.assert_close(vc[s], v[t])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(40) if s not in written]
    assert kc[untouched].abs().sum() == 0 and vc[untouched].abs().sum() == 0  # slot -1 wrote nothing


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4, 16])
def test_paged_decode_attention_equals_sdpa_over_each_rows_keys(dtype: torch.dtype, splits: int) -> None:
    heads, kv_heads, hd, pages = 6, 2, 32, 24
    g = torch.Generator().manual_seed(3)
    kc = torch.randn(pages * PAGE, kv_heads, hd, generator=g).to(DEV, dtype)
    vc = torch.randn(pages * PAGE, kv_heads, hd, generator=g).to(DEV, dtype)
    lens = [1, 17, 0, 64, 5, 100]
    perm = torch.randperm(pages, generator=g).tolist()
    table = torch.zeros(len(lens), 8, dtype=torch.int32)
    for r, n in enumerate(lens):  # each row's pages scattered over the pool
        k = -(-n // PAGE)
        table[r, :k] = torch.tensor(perm[:k], dtype=torch.int32)
        perm = perm[k:] + perm[:k]
    table = table.to(DEV)
    # q as a strided view, as the runner passes it (the first heads*hd columns of qkv)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * hd, generator=g).to(DEV, dtype)
    q = qkv[:, : heads * hd]
    mid_o = torch.empty(len(lens) * heads * splits * hd, device=DEV)
    mid_l = torch.empty(len(lens) * heads * splits, device=DEV)
    out = K.paged_decode_attention(q, kc, vc, table, torch.tensor(lens, device=DEV), 0.125, heads=heads,
                                   kv_heads=kv_heads, head_dim=hd, page=PAGE, splits=splits, mid_o=mid_o, mid_l=mid_l)
    for r, n in enumerate(lens):
        if n == 0:
            assert out[r].abs().sum() == 0
            continue
        pos = torch.arange(n, device=DEV)
        slots = table[r, pos // PAGE].long() * PAGE + pos % PAGE
        k, v = kc[slots].transpose(0, 1).float(), vc[slots].transpose(0, 1).float()  # [kv_heads, n, hd]
        qr = q[r].view(heads, 1, hd).float()
        ref = torch.nn.functional.scaled_dot_product_attention(
            qr, k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0), scale=0.125)
        _close(out[r].view(heads, hd), ref[:, 0], dtype)


def test_the_kernels_noise_is_counter_uniforms_bit_for_bit() -> None:
    """The sampled token is the argmax of logits/T + Gumbel(u) with u = counter_uniforms(seed, offset):
    checked by giving the kernel logits where only the noise decides (all equal)."""
    vocab = 300
    seeds = torch.tensor([0, 1, 2**40 + 7, -5, 123456789], device=DEV)
    offsets = torch.tensor([0, 0, 3, 17, 1000], device=DEV)
    logits = torch.zeros(len(seeds), vocab, device=DEV)
    tok, lp = K.sample(logits, torch.ones(len(seeds), device=DEV), seeds, offsets)
    u = counter_uniforms(seeds, offsets, vocab)
    assert tok.tolist() == (-(-u.log()).log()).argmax(-1).tolist()
    torch.testing.assert_close(lp, torch.full_like(lp, -math.log(vocab)))
    assert len(set(tok.tolist())) > 1  # the seed and the offset both move the draw
    again, _ = K.sample(logits[[2, 0]], torch.ones(2, device=DEV), seeds[[2, 0]], offsets[[2, 0]])
    assert again.tolist() == [tok[2].item(), tok[0].item()]  # a row's draw is its own, whatever its batch


def test_sample_kernel_greedy_logprobs_and_distribution() -> None:
    g = torch.Generator().manual_seed(4)
    vocab = 5000  # more than one block of the kernel's vocabulary loop
    logits = (3 * torch.randn(4, vocab, generator=g)).to(DEV)
    temps = torch.tensor([0.0, 1.0, 0.7, 1.3], device=DEV)
    tok, lp = K.sample(logits, temps, torch.arange(4, device=DEV), torch.zeros(4, dtype=torch.int64, device=DEV))
    assert tok[0] == logits[0].argmax()
    t = torch.where(temps < 1e-6, 1.0, temps)
    ref = torch.log_softmax(logits / t[:, None], -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, atol=1e-4, rtol=1e-4)
    # Frequencies over many seeds follow softmax(logits / T): a chi-square test on 6 tokens.
    small = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5, -3.0]], device=DEV)
    n = 3000
    toks, _ = K.sample(small.expand(n, 6).contiguous(), torch.full((n,), 0.8, device=DEV),
                       torch.arange(n, device=DEV) * 7919, torch.full((n,), 5, dtype=torch.int64, device=DEV))
    counts = torch.bincount(toks.cpu(), minlength=6).double()
    expect = torch.softmax(small[0].cpu().double() / 0.8, -1) * n
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    assert chi2 < 20.5, (counts.tolist(), expect.tolist())  # p ~ 0.001 at 5 degrees of freedom


def test_sample_counter_draws_the_kernels_tokens_and_truncates() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 64, generator=g).to(DEV)
    seeds, offsets = [11, 12, 13, 14, 15, 16], [0, 1, 2, 3, 4, 5]
    batch = SamplingBatch(temperatures=[1.0, 0.5, 0.0, 1.0, 1.0, 2.0], top_ps=[1.0] * 6, top_ks=[-1] * 6,
                          min_ps=[0.0] * 6, generators=[None] * 6)
    tok, lp = sample_counter(logits, batch, seeds, offsets)
    ktok, klp = K.sample(logits, torch.tensor(batch.temperatures, device=DEV), torch.tensor(seeds, device=DEV),
                         torch.tensor(offsets, device=DEV))
    assert tok.tolist() == ktok.tolist()
    torch.testing.assert_close(lp, klp, atol=1e-4, rtol=1e-4)
    top1 = SamplingBatch(temperatures=[1.0] * 6, top_ps=[1.0] * 6, top_ks=[1] * 6, min_ps=[0.0] * 6,
                         generators=[None] * 6)
    assert sample_counter(logits, top1, seeds, offsets)[0].tolist() == logits.argmax(-1).tolist()


# ---- the runner's forward ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 with grouped KV heads (4 query heads, 2 KV heads) and q/k/v biases."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "gqa", preset="tiny", seed=3,
                            num_key_value_heads=2, initializer_range=0.3)


def test_paged_runner_prefill_and_decode_equal_transformers(gqa_model_dir: Path) -> None:
    ref = AutoModelForCausalLM.from_pretrained(gqa_model_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(gqa_model_dir, dtype=torch.float32).to(DEV).eval()
    assert supports_paged(model) is None
    runner = PagedRunner(model, 4, 64, max_total_tokens=200, cuda_graphs=False)
    seqs = [[1, 5, 6, 7, 8, 9], [1, 9], [1, 5, 6, 7, 8, 9], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]

    def hf_next(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return ref(torch.tensor([seq])).logits[0, -1]

    with torch.inference_mode():
        logits = runner.prefill([0, 1, 2, 3], seqs, [s + 20 for s in map(len, seqs)])
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i].cpu(), hf_next(s), atol=1e-4, rtol=1e-4)
        assert sum(map(len, runner.pages)) == sum(-(-(len(s) + 20) // PAGE) for s in seqs)  # the reservations
        for step in range(18):  # crosses page boundaries; row 1 leaves after 6 steps
            if step == 6:  # as the engine does: free the row, move the last one into it
                runner.free_row(1)
                runner.move_row(3, 1)
                seqs, logits = [seqs[0], seqs[3], seqs[2]], logits[[0, 3, 2]]
            nxt = logits.argmax(-1).tolist()
            for s, t in zip(seqs, nxt, strict=True):
                s.append(t)
            logits = runner.decode([s[-1] for s in seqs], [len(s) - 1 for s in seqs])
            for i, s in enumerate(seqs):
                torch.testing.assert_close(logits[i].cpu(), hf_next(s), atol=1e-4, rtol=1e-4)
        # The same step again with sampling on the device: greedy rows take the argmax of those logits.
        tok, lp = runner.decode_sample([s[-1] for s in seqs], [len(s) - 1 for s in seqs], [0.0] * 3, [0] * 3, [0] * 3)
    assert tok == logits.argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(lp), torch.log_softmax(logits.cpu(), -1).max(-1).values, atol=1e-4, rtol=1e-4)
    assert len(runner._free) + sum(map(len, runner.pages)) == runner.num_pages  # no page lost or doubled


async def test_torch_engine_through_the_paged_runner(gqa_model_dir: Path) -> None:
    """TorchEngine on the paged runner (here through Triton's interpreter; tests/test_engine.py runs the
    whole contract on it with STREAMRL_TEST_DEVICE=cuda): greedy tokens equal transformers' in a
    staggered batch, seeded sampling is the same whatever shares the batch, top-k takes the PyTorch
    path, and the KV pool goes and comes back."""
    import asyncio

    from streamrl.engine import TorchEngine

    ref = AutoModelForCausalLM.from_pretrained(gqa_model_dir, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    prompts = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 9, 10]]
    greedy = {"temperature": 0, "ignore_eos": True}
    async with TorchEngine(str(gqa_model_dir), device=DEV, runner="paged", max_running_requests=4,
                           max_total_tokens=128) as eng:
        assert eng.stats()["runner"] == "PagedRunner" and eng.stats()["kv_tokens"] == 128

        async def late(i: int, p: list[int]) -> dict:
            await asyncio.sleep(0.01 * i)
            return await eng.generate(p, {"max_new_tokens": 6 + 2 * i, **greedy})

        outs = await asyncio.gather(*[late(i, p) for i, p in enumerate(prompts)])
        for i, (p, r) in enumerate(zip(prompts, outs, strict=True)):
            want = ref.generate(torch.tensor([p]), max_new_tokens=6 + 2 * i, do_sample=False, pad_token_id=0)
            assert r["output_ids"] == want[0, len(p):].tolist()
        seeded = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
        alone = await eng.generate(prompts[0], seeded)
        together, _ = await asyncio.gather(eng.generate(prompts[0], seeded), eng.generate(prompts[2], seeded))
        assert alone["output_ids"] == together["output_ids"]
        # A seed beyond int64 (SGLang takes any integer) is folded, not an error for its batch-mates.
        big, _ = await asyncio.gather(eng.generate(prompts[0], {**seeded, "sampling_seed": 2**64 - 1}),
                                      eng.generate(prompts[2], seeded))
        assert len(big["output_ids"]) == 8 and big["meta_info"]["finish_reason"]["type"] == "length"
        top1 = await eng.generate(prompts[1], {"max_new_tokens": 6, "ignore_eos": True, "top_k": 1})
        assert top1["output_ids"] == outs[1]["output_ids"][:6]
        await eng.release_memory()
        assert eng.stats()["kv_cache_bytes"] == 0
        await eng.resume_memory()
        again = await eng.generate(prompts[1], {"max_new_tokens": 8, **greedy})
        assert again["output_ids"] == outs[1]["output_ids"]
        assert eng.stats()["running"] == 0 and len(eng.runner._free) == eng.runner.num_pages  # every page back
