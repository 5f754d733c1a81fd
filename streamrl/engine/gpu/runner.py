"""PagedRunner: TorchEngine's tensors on a GPU — paged KV sized by a token budget, Triton kernels,
and CUDA graphs for decode.

Same duties as `model_runner.ModelRunner` (the scheduler decides, the runner computes; rows 0..B-1 of
the running batch are dense), different means, because on a GPU a small model's decode step is bound
by kernel launches and host work, not by the GPU:

- **KV in pages** of `PAGE` tokens from one pool of `max_total_tokens` slots ([layers, k/v, slots,
  kv heads, head dim]); a request holds the pages of its reservation (prompt + max_new_tokens, as the
  scheduler admits it), listed in its row of a block table. Memory follows the token budget, not
  rows x context; moving a request to another row moves its block-table row, not its KV.
- **Our own Llama/Qwen2 forward** over the Hugging Face module's weights (the q/k/v and gate/up
  projections rebound as views of one fused weight each, so a weight update through the module's
  state_dict writes the fused ones): 10 kernels a layer (`kernels.py` fuses norm+residual, SwiGLU,
  rope+KV write, paged attention).
- **CUDA graphs** of the whole decode step — embedding to sampled token — at bucketed batch sizes,
  captured once per KV allocation; a step is three small copies in, one replay, one copy out.
  Inputs beyond the live rows are padding: KV slot -1 (not written), length 0 (zero attention).
- **Sampling on the GPU** (`kernels.sample`), one host sync per step.

Prefill runs eagerly: the prompt tokens of every request in one flat batch through the GEMMs, and
causal attention per length bucket by SDPA (FlashAttention or memory-efficient; never cuDNN, whose
per-shape graph build costs more than the attention).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...batching import length_buckets
from ..shape import LlamaShape
from .kernels import add_rms_norm, decode_splits, paged_decode_attention, rope_store, sample, silu_mul

PAGE = 16
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def supports_paged(model: Any) -> str | None:
    """None if PagedRunner can run `model`, else why not (the engine then uses ModelRunner)."""
    cfg, inner = model.config, getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "rotary_emb"):
        return "not a Llama-family decoder"
    attn, mlp = layers[0].self_attn, layers[0].mlp
    if getattr(attn, "q_norm", None) is not None:
        return "per-head q/k norms (Qwen3)"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return "not a SwiGLU MLP"
    if getattr(cfg, "hidden_act", "silu") != "silu" or mlp.gate_proj.bias is not None:
        return f"MLP activation {getattr(cfg, 'hidden_act', '?')} / MLP bias"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):
        # Their frequencies depend on the sequence's length: one table for every position would not do.
        return f"rope_type {rope.get('rope_type', rope.get('type'))}"
    head_dim = int(getattr(attn, "head_dim", cfg.hidden_size // cfg.num_attention_heads))
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim {head_dim} is not a power of two >= 16"
    if len({p.bias is None for p in (attn.q_proj, attn.k_proj, attn.v_proj)}) > 1:
        return "q/k/v biases on some projections only"
    return None


def _eps(norm: Any) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class PagedRunner(LlamaShape):
    page_size = PAGE
    paged = True  # the engine samples through it (counter-based noise) and reserves KV in pages

    def __init__(self, model: Any, num_rows: int, max_len: int, *, max_total_tokens: int,
                 cuda_graphs: bool | None = None) -> None:
        super().__init__(model)
        inner = model.model
        self.num_rows, self.max_len = num_rows, max_len
        self.num_pages = -(-max_total_tokens // PAGE)
        self.vocab = int(model.lm_head.weight.shape[0])
        self._fuse_weights()
        with torch.no_grad():  # the rotary tables of every position, as transformers computes them
            probe = torch.zeros(1, dtype=torch.float32, device=self.device)
            cos, sin = inner.rotary_emb(probe, torch.arange(max_len, device=self.device)[None])
        self.cos, self.sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        if self.cos.shape[-1] != self.head_dim:
            raise ValueError("PagedRunner: partial rotary embeddings are not supported")
        dev = self.device
        pin = dev.type == "cuda"
        self.block_table = torch.zeros((num_rows, -(-max_len // PAGE)), dtype=torch.int32, device=dev)
        self._bt_host = torch.zeros(self.block_table.shape, dtype=torch.int32, pin_memory=pin)
        self._bt_dirty = False
        self.pages: list[list[int]] = [[] for _ in range(num_rows)]
        self._free: list[int] = []
        self.cuda_graphs = dev.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graph_sizes = [b for b in GRAPH_BATCH_SIZES if b < num_rows] + [num_rows] if num_rows <= 512 else [
            b for b in GRAPH_BATCH_SIZES]
        big = max(self.graph_sizes[-1], num_rows)
        # Decode inputs, written in place each step (a captured graph reads these addresses):
        # token, position, new token's slot, length, sampling offset, seed; and the temperature.
        self._inp = torch.zeros((6, big), dtype=torch.int64, device=dev)
        self._temp = torch.ones(big, dtype=torch.float32, device=dev)
        self._inp_host = torch.zeros((6, big), dtype=torch.int64, pin_memory=pin)
        self._temp_host = torch.ones(big, dtype=torch.float32, pin_memory=pin)
        splits = decode_splits(1, self.num_kv_heads)
        self._mid_o = torch.empty(big * self.num_heads * splits * self.head_dim, dtype=torch.float32, device=dev)
        self._mid_l = torch.empty(big * self.num_heads * splits, dtype=torch.float32, device=dev)
        self.kv: torch.Tensor | None = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self._weights_host: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] | None = None
        self.allocate()

    # ---- weights -------------------------------------------------------------------------------------
    def _fuse_weights(self) -> None:
        """q/k/v (and gate/up) as views of one weight each: one GEMM instead of three (two), and a
        weight update into the module's parameters lands in the fused tensor."""
        self.qkv_w, self.qkv_b, self.gate_up_w = [], [], []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            self.qkv_w.append(_fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            self.qkv_b.append(_fuse([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None
                              else None)
            self.gate_up_w.append(_fuse([m.gate_proj.weight, m.up_proj.weight]))

    def _weight_storages(self) -> list[torch.UntypedStorage]:
        """Each distinct storage of the weights once (a fused tensor once, tied embeddings once)."""
        seen: dict[int, torch.UntypedStorage] = {}
        for t in [*self.model.parameters(), *self.model.buffers()]:
            st = t.untyped_storage()
            seen.setdefault(st.data_ptr(), st)
        return list(seen.values())

    def weight_bytes(self) -> int:
        return sum(st.nbytes() for st in self._weight_storages())

    # ---- KV pages ------------------------------------------------------------------------------------
    def allocate(self) -> None:
        shape = (len(self.layers), 2, self.num_pages * PAGE, self.num_kv_heads, self.head_dim)
        self.kv = torch.empty(shape, dtype=self.dtype, device=self.device)  # read only where written
        self._free = list(range(self.num_pages - 1, -1, -1))
        self.pages = [[] for _ in range(self.num_rows)]
        self._graphs = {}
        if self.cuda_graphs:
            with torch.inference_mode():
                self.capture()

    def free(self) -> None:
        self.kv, self._graphs, self.pages, self._free = None, {}, [[] for _ in range(self.num_rows)], []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def kv_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    def release(self, weights: bool) -> None:
        """Give the GPU back (colocated training): the KV pool and the graphs, and with `weights` the
        weights too, copied to host memory. The weight tensors stay (their storage emptied), so the
        module's parameters and the fused views keep pointing at them; `restore` refills them."""
        self.free()
        if weights and self.device.type == "cuda" and self._weights_host is None:  # on CPU, host memory already
            self._weights_host = [(st, st.cpu()) for st in self._weight_storages()]
            for st, _ in self._weights_host:
                st.resize_(0)
            torch.cuda.empty_cache()

    def restore(self) -> None:
        """Weights back (if released) and a new KV pool; the graphs are captured again, since the
        new memory has new addresses."""
        if self._weights_host is not None:
            for st, host in self._weights_host:
                st.resize_(host.nbytes())
                st.copy_(host)
            self._weights_host = None
        self.allocate()

    def _take_pages(self, row: int, tokens: int) -> None:
        need = -(-tokens // PAGE) - len(self.pages[row])
        if need <= 0:
            return
        if need > len(self._free):
            raise RuntimeError(f"KV pool exhausted: {need} pages wanted, {len(self._free)} free (the scheduler's "
                               "token budget and the pool disagree)")
        got = [self._free.pop() for _ in range(need)]
        start = len(self.pages[row])
        self.pages[row] += got
        self._bt_host[row, start : start + need] = torch.tensor(got, dtype=torch.int32)
        self._bt_dirty = True

    def free_row(self, row: int) -> None:
        """The request in `row` is done: its pages go back to the pool."""
        self._free += reversed(self.pages[row])
        self.pages[row] = []

    def move_row(self, src: int, dst: int, length: int | None = None) -> None:
        """Compaction: the request in row `src` now lives in row `dst` (its pages move, not its KV)."""
        self.pages[dst], self.pages[src] = self.pages[src], []
        self._bt_host[dst] = self._bt_host[src]
        self._bt_dirty = True

    def _sync_block_table(self) -> None:
        if self._bt_dirty:
            self.block_table.copy_(self._bt_host, non_blocking=True)
            self._bt_dirty = False

    def _slots(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.block_table[rows, pos // PAGE].to(torch.int64) * PAGE + pos % PAGE

    # ---- the forward -----------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, attend: Any) -> torch.Tensor:
        """Tokens [N] at positions [N], their K/V stored at slots [N]; `attend(i, qkv)` -> [N, heads*hd]."""
        inner = self.model.model
        assert self.kv is not None
        h = F.embedding(ids, inner.embed_tokens.weight)
        residual = None
        hq, hk, hd = self.num_heads, self.num_kv_heads, self.head_dim
        for i, layer in enumerate(self.layers):
            x, residual = add_rms_norm(h, residual, layer.input_layernorm.weight, _eps(layer.input_layernorm))
            qkv = F.linear(x, self.qkv_w[i], self.qkv_b[i])
            rope_store(qkv, self.cos, self.sin, pos, slots, self.kv[i, 0], self.kv[i, 1], hq, hk, hd)
            o = layer.self_attn.o_proj
            h = F.linear(attend(i, qkv), o.weight, o.bias)
            x, residual = add_rms_norm(h, residual, layer.post_attention_layernorm.weight,
                                         _eps(layer.post_attention_layernorm))
            down = layer.mlp.down_proj
            h = F.linear(silu_mul(F.linear(x, self.gate_up_w[i])), down.weight, down.bias)
        x, _ = add_rms_norm(h, residual, inner.norm.weight, _eps(inner.norm))
        return x

    def _lm_head(self, x: torch.Tensor) -> torch.Tensor:
        head = self.model.lm_head
        return F.linear(x, head.weight, head.bias)

    # ---- prefill ---------------------------------------------------------------------------------------
    def prefill(self, rows: list[int], seqs: list[list[int]], reserve: list[int] | None = None) -> torch.Tensor:
        """KV for whole sequences into their rows' pages (taken now, for `reserve[i]` tokens, if the row
        has none); next-token logits [n, V] (float32). Sequences that repeat one (a GRPO group's
        prompt) are computed once and their KV copied."""
        for i, (r, s) in enumerate(zip(rows, seqs, strict=True)):
            self._take_pages(r, max(len(s), reserve[i] if reserve else len(s)))
        self._sync_block_table()
        first: dict[tuple[int, ...], int] = {}
        rep = [first.setdefault(tuple(s), i) for i, s in enumerate(seqs)]
        uniq = list(first.values())
        logits = self._prefill_distinct([rows[i] for i in uniq], [seqs[i] for i in uniq])
        dups = [i for i in range(len(seqs)) if rep[i] != i]
        if dups:
            self._copy_kv([rows[rep[i]] for i in dups], [rows[i] for i in dups], [len(seqs[i]) for i in dups])
        slot = {i: j for j, i in enumerate(uniq)}
        return logits[[slot[r] for r in rep]] if dups else logits

    def _copy_kv(self, src: list[int], dst: list[int], lens: list[int]) -> None:
        dev = self.device
        n = torch.tensor(lens, device=dev)
        pos = torch.cat([torch.arange(k, device=dev) for k in lens])
        s_rows = torch.repeat_interleave(torch.tensor(src, device=dev), n)
        d_rows = torch.repeat_interleave(torch.tensor(dst, device=dev), n)
        assert self.kv is not None
        self.kv[:, :, self._slots(d_rows, pos)] = self.kv[:, :, self._slots(s_rows, pos)]

    def _prefill_distinct(self, rows: list[int], seqs: list[list[int]]) -> torch.Tensor:
        dev = self.device
        lens = [len(s) for s in seqs]
        n_tok = sum(lens)
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=dev)
        pos = torch.cat([torch.arange(k, device=dev) for k in lens])
        starts = torch.tensor([0, *lens[:-1]], device=dev).cumsum(0)
        slots = self._slots(torch.repeat_interleave(torch.tensor(rows, device=dev), torch.tensor(lens, device=dev)), pos)
        # Per length bucket: an index that right-pads each sequence (with its own first token, which
        # causal attention hides from every real query) and the flat places of its real tokens.
        buckets = []
        for b in length_buckets(lens, max_padding=0.25):
            width = max(lens[i] for i in b)
            j = torch.arange(width, device=dev)[None, :]
            bl = torch.tensor([lens[i] for i in b], device=dev)[:, None]
            idx = starts[b][:, None] + torch.minimum(j, bl - 1)
            buckets.append((idx, (j < bl).reshape(-1)))
        hq, hk, hd = self.num_heads, self.num_kv_heads, self.head_dim

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
            q = qkv[:, : hq * hd].view(n_tok, hq, hd)
            k = qkv[:, hq * hd : (hq + hk) * hd].view(n_tok, hk, hd)
            v = qkv[:, (hq + hk) * hd :].view(n_tok, hk, hd)
            out = torch.empty((n_tok, hq * hd), dtype=qkv.dtype, device=dev)
            for idx, real in buckets:
                qp, kp, vp = (t[idx].transpose(1, 2) for t in (q, k, v))  # [nb, heads, width, hd]
                if hk != hq:
                    kp, vp = kp.repeat_interleave(hq // hk, 1), vp.repeat_interleave(hq // hk, 1)
                with _sdpa_backends(dev):
                    o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale)
                out[idx.reshape(-1)[real]] = o.transpose(1, 2).reshape(-1, hq * hd)[real]
            return out

        x = self._forward(ids, pos, slots, attend)
        last = starts + torch.tensor(lens, device=dev) - 1
        return self._lm_head(x[last]).float()

    # ---- decode ----------------------------------------------------------------------------------------
    def _stage(self, tokens: list[int], ctx_lens: list[int], temps: list[float] | None,
               seeds: list[int] | None, offsets: list[int] | None) -> int:
        """Write a decode step's inputs into the static buffers; returns the batch size it runs at."""
        b = len(tokens)
        bs = next((g for g in self.graph_sizes if g >= b), b) if self._graphs else b
        host = self._inp_host
        slots = [self.pages[r][c // PAGE] * PAGE + c % PAGE for r, c in enumerate(ctx_lens)]
        host[0, :b] = torch.tensor(tokens)
        host[1, :b] = torch.tensor(ctx_lens)
        host[2, :b] = torch.tensor(slots)
        host[3, :b] = host[1, :b] + 1
        if offsets is not None:
            host[4, :b] = torch.tensor(offsets)
            host[5, :b] = torch.tensor(seeds)
            self._temp_host[:b] = torch.tensor(temps)
        if bs > b:  # padding rows: no KV write, no keys, greedy
            host[:, b:bs] = 0
            host[2, b:bs] = -1
            self._temp_host[b:bs] = 0.0
        self._sync_block_table()
        self._inp[:, :bs].copy_(host[:, :bs], non_blocking=True)
        self._temp[:bs].copy_(self._temp_host[:bs], non_blocking=True)
        return bs

    def _decode_body(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inp = self._inp
        seq_lens = inp[3, :bs]
        # (Triton's interpreter, on CPU, runs programs one by one: one split there.)
        splits = decode_splits(bs, self.num_kv_heads) if self.device.type == "cuda" else 1
        hq, hk, hd = self.num_heads, self.num_kv_heads, self.head_dim

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
            assert self.kv is not None
            return paged_decode_attention(qkv[:, : hq * hd], self.kv[i, 0], self.kv[i, 1], self.block_table,
                                            seq_lens, self.scale, heads=hq, kv_heads=hk, head_dim=hd, page=PAGE,
                                            splits=splits, mid_o=self._mid_o, mid_l=self._mid_l)

        x = self._forward(inp[0, :bs], inp[1, :bs], inp[2, :bs], attend)
        logits = self._lm_head(x)
        tokens, logps = sample(logits, self._temp[:bs], inp[5, :bs], inp[4, :bs])
        return logits, tokens, logps

    def _run_decode(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        graph = self._graphs.get(bs)
        if graph is None:
            return self._decode_body(bs)
        graph[0].replay()
        return graph[1]  # type: ignore[return-value]

    def decode(self, tokens: list[int], ctx_lens: list[int]) -> torch.Tensor:
        """Logits [B, V] (float32) of one step for rows 0..B-1 (row i has ctx_lens[i] cached tokens):
        for rows whose sampling the kernel does not do (top-k, top-p, min-p)."""
        bs = self._stage(tokens, ctx_lens, None, None, None)
        return self._run_decode(bs)[0][: len(tokens)].float()

    def decode_sample(self, tokens: list[int], ctx_lens: list[int], temps: list[float], seeds: list[int],
                      offsets: list[int]) -> tuple[list[int], list[float]]:
        """One step for rows 0..B-1 and its sampled tokens with their logprobs (`kernels.sample`)."""
        b = len(tokens)
        bs = self._stage(tokens, ctx_lens, temps, seeds, offsets)
        _, tok, lp = self._run_decode(bs)
        return tok[:b].tolist(), lp[:b].tolist()

    def capture(self) -> None:
        """A CUDA graph of the decode step at every bucketed batch size (largest first, one memory
        pool). Padding inputs only: nothing is written to the KV cache."""
        self._graphs = {}
        pool = torch.cuda.graph_pool_handle()
        self._inp.zero_()
        self._inp[2].fill_(-1)
        self._temp.zero_()
        self._sync_block_table()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bs in reversed(self.graph_sizes):
                self._decode_body(bs)  # compiles the Triton kernels, sets up cuBLAS for the shape
        torch.cuda.current_stream().wait_stream(side)
        for bs in reversed(self.graph_sizes):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                out = self._decode_body(bs)
            self._graphs[bs] = (g, out)
        torch.cuda.synchronize()

    def sample(self, logits: torch.Tensor, temps: list[float], seeds: list[int], offsets: list[int]
               ) -> tuple[list[int], list[float]]:
        dev = logits.device
        tok, lp = sample(logits, torch.tensor(temps, dtype=torch.float32, device=dev),
                           torch.tensor(seeds, dtype=torch.int64, device=dev),
                           torch.tensor(offsets, dtype=torch.int64, device=dev))
        return tok.tolist(), lp.tolist()


def _fuse(params: list[torch.nn.Parameter]) -> torch.Tensor:
    fused = torch.cat([p.data for p in params], 0)
    start = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[start : start + n]
        start += n
    return fused


class _sdpa_backends:
    """Prefill attention on CUDA by FlashAttention or the memory-efficient kernel (math for what
    neither takes); cuDNN's would build a graph per new shape."""

    def __init__(self, device: torch.device) -> None:
        self._ctx: Any = None
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            self._ctx = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
