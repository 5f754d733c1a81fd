"""Tensors for TorchEngine: the model, a per-slot KV cache, batched prefill and decode.

The runner computes; it decides nothing. The scheduler tells it which rows to prefill and when to
decode. Running requests occupy KV rows 0..B-1 *contiguously* (the engine compacts rows when a request
leaves), so a decode step attends over a view ``cache[:B, :, :L]`` with no gather, where L is the
longest live context in the batch rather than the model's maximum: the cost follows the real lengths.
On CPU in float32, decode attention is the compiled kernel of `kernels/` (keys cached in blocks of 16
positions; each row reads exactly its blocks); elsewhere SDPA with `split_span`.

For Llama-family decoders (Llama, Qwen2, Qwen3, Mistral: `model.model.layers[i].self_attn.{q,k,v,o}_proj`)
the runner walks the Hugging Face modules itself and only replaces attention + cache, so norms, MLPs,
rotary scaling and biases stay exactly transformers' code. Other architectures use `FallbackRunner`,
which recomputes the whole sequence every step: correct, slow, and said so in the docs.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from ..batching import length_buckets
from .kernels import BLOCK, block_keys, decode_attention
from .shape import LlamaShape


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _default_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class ModelRunner(LlamaShape):
    """Per-slot KV cache runner for Llama-family models."""

    def __init__(self, model: Any, num_rows: int, max_len: int, *, cpu_kernel: bool = True) -> None:
        super().__init__(model)
        attn0 = self.layers[0].self_attn
        mod = sys.modules.get(type(attn0).__module__)
        self._rope = getattr(mod, "apply_rotary_pos_emb", None) or _default_rope
        self.num_rows = num_rows
        self.max_len = max_len
        # On CPU in float32, decode attention is a compiled kernel that wants keys in blocks of 16
        # positions ([rows, kv heads, max_len / 16, head_dim, 16]); elsewhere SDPA over
        # [rows, kv heads, max_len, head_dim].
        use = cpu_kernel and self.device.type == "cpu" and self.dtype == torch.float32
        self.kernel = decode_attention() if use else None
        self.k_blocked = self.kernel is not None
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.allocate()

    def allocate(self) -> None:
        shape = (self.num_rows, self.num_kv_heads, self.max_len, self.head_dim)
        blocks = -(-self.max_len // BLOCK)
        kshape = (*shape[:2], blocks, self.head_dim, BLOCK) if self.k_blocked else shape
        self.k_cache = [torch.zeros(kshape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]

    def free(self) -> None:
        self.k_cache, self.v_cache = [], []

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)

    def free_row(self, row: int) -> None:
        """The request in `row` is done (its KV is simply overwritten by the next one)."""

    def move_row(self, src: int, dst: int, length: int | None = None) -> None:
        """Compaction: the request in row `src` (with `length` cached positions, default all) now
        lives in row `dst`."""
        self.copy_rows([src], [dst], self.max_len if length is None else length)

    def copy_rows(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first `length` cached positions of rows `src[i]` into rows `dst[i]` (every layer)."""
        if len(src) == 1:  # plain slices: no index tensors for the common compaction move
            s, d = slice(src[0], src[0] + 1), slice(dst[0], dst[0] + 1)
        else:
            s, d = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        nb = -(-length // BLOCK)
        for k, v in zip(self.k_cache, self.v_cache, strict=True):
            if self.k_blocked:
                k[d, :, :nb] = k[s, :, :nb]
            else:
                k[d, :, :length] = k[s, :, :length]
            v[d, :, :length] = v[s, :, :length]

    def _attend(self, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        attn = layer.self_attn
        b, t, _ = h.shape
        q = attn.q_proj(h).view(b, t, -1, self.head_dim)
        k = attn.k_proj(h).view(b, t, -1, self.head_dim)
        v = attn.v_proj(h).view(b, t, -1, self.head_dim)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3 normalises q/k per head before rope
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, hd]
        q, k = self._rope(q, k, cos, sin)
        out = attend(q, k, v)  # [B, heads, T, hd]
        return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads,
        )

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, attend_layer) -> torch.Tensor:
        inner = self.model.model
        h = inner.embed_tokens(ids)  # [B, T, H]
        cos, sin = inner.rotary_emb(h, pos)
        for i, layer in enumerate(self.layers):
            a = self._attend(
                layer, layer.input_layernorm(h), cos, sin, lambda q, k, v, i=i: attend_layer(i, q, k, v),
            )
            h = h + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(h)).float()

    def prefill(self, rows: list[int], seqs: list[list[int]], reserve: list[int] | None = None) -> torch.Tensor:
        """Compute and store KV for whole sequences; return next-token logits [n, V]. (`reserve`: the
        paged runner's; every row here holds max_len positions.)

        The samples of a GRPO group arrive together with one prompt: each distinct sequence is
        computed once and its KV copied to the rows that repeat it (SGLang gets the same from its
        radix cache), which cuts a group's prompt prefill by its size.
        """
        first: dict[tuple[int, ...], int] = {}
        rep = [first.setdefault(tuple(s), i) for i, s in enumerate(seqs)]
        if len(first) == len(seqs):
            return self._prefill_distinct(rows, seqs)
        uniq = list(first.values())
        logits = self._prefill_distinct([rows[i] for i in uniq], [seqs[i] for i in uniq])
        dups = [i for i in range(len(seqs)) if rep[i] != i]
        self.copy_rows([rows[rep[i]] for i in dups], [rows[i] for i in dups], max(len(seqs[i]) for i in dups))
        slot = {i: j for j, i in enumerate(uniq)}
        return logits[[slot[r] for r in rep]]

    def _prefill_distinct(self, rows: list[int], seqs: list[list[int]]) -> torch.Tensor:
        """A padded batch costs its longest sequence times its size. Sequences of mixed lengths (new
        prompts beside partial samples resumed after a weight update) are therefore prefilled in
        buckets of similar length: in a mix of 10..280 tokens that halves the work.
        """
        buckets = length_buckets([len(s) for s in seqs], max_padding=0.25)
        if len(buckets) == 1:
            return self._prefill_padded(rows, seqs)
        out: torch.Tensor | None = None
        for b in buckets:
            logits = self._prefill_padded([rows[i] for i in b], [seqs[i] for i in b])
            if out is None:
                out = logits.new_empty((len(seqs), logits.shape[-1]))
            out[b] = logits
        assert out is not None
        return out

    def _prefill_padded(self, rows: list[int], seqs: list[list[int]]) -> torch.Tensor:
        n, lmax = len(seqs), max(len(s) for s in seqs)
        dev = self.device
        ids = torch.zeros((n, lmax), dtype=torch.long, device=dev)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        lens = torch.tensor([len(s) for s in seqs], device=dev)  # [n]
        pos = torch.arange(lmax, device=dev)[None, :].expand(n, lmax)  # [n, Lp]
        # Right padding: row i's keys beyond its length are masked out; causal within the row.
        causal = torch.ones((lmax, lmax), dtype=torch.bool, device=dev).tril()
        key_ok = pos < lens[:, None]  # [n, Lp]
        mask = (causal[None] & key_ok[:, None, :])[:, None]  # [n, 1, Lp, Lp]
        row_idx = torch.tensor(rows, device=dev)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if self.k_blocked:
                kb = block_keys(k)
                self.k_cache[i][row_idx, :, : kb.shape[2]] = kb
            else:
                self.k_cache[i][row_idx, :, :lmax] = k
            self.v_cache[i][row_idx, :, :lmax] = v
            return self._sdpa(q, k, v, mask)

        h = self._forward(ids, pos, attend)
        last = h[torch.arange(n, device=dev), lens - 1]  # [n, H]
        return self._logits(last)

    def decode(self, tokens: list[int], ctx_lens: list[int]) -> torch.Tensor:
        """One token for each of rows 0..B-1; row i has ctx_lens[i] cached tokens. Returns [B, V]."""
        b, dev = len(tokens), self.device
        ids = torch.tensor(tokens, dtype=torch.long, device=dev)[:, None]  # [B, 1]
        pos = torch.tensor(ctx_lens, dtype=torch.long, device=dev)  # [B]
        if self.kernel is not None:
            return self._decode_kernel(ids, pos)
        span, long_rows = split_span([c + 1 for c in ctx_lens])
        ar = torch.arange(b, device=dev)
        mask = (torch.arange(span, device=dev)[None, :] <= pos[:, None])[:, None, None, :]  # [B,1,1,span]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[ar, :, pos] = k[:, :, 0]
            vc[ar, :, pos] = v[:, :, 0]
            # Every row over the first `span` keys (rows longer than that get a wrong answer here),
            # then each longer row alone over exactly its keys, replacing it: no row reads padding.
            out = self._sdpa(q, kc[:b, :, :span], vc[:b, :, :span], mask)  # [B, heads, 1, hd]
            for r in long_rows:
                n = ctx_lens[r] + 1
                out[r : r + 1] = self._sdpa(q[r : r + 1], kc[r : r + 1, :, :n], vc[r : r + 1, :, :n], None)
            return out

        h = self._forward(ids, pos[:, None], attend)  # [B, 1, H]
        return self._logits(h[:, 0])

    def _decode_kernel(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b = ids.shape[0]
        ar = torch.arange(b, device=ids.device)
        blk, off = pos // BLOCK, pos % BLOCK
        keys = pos + 1  # row r attends to its ctx_lens[r] cached positions and the new one
        kernel = self.kernel
        assert kernel is not None

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[ar, :, blk, :, off] = k[:, :, 0]
            vc[ar, :, pos] = v[:, :, 0]
            return kernel(q[:, :, 0].contiguous(), kc, vc, keys, self.scale)[:, :, None]  # [B, heads, 1, hd]

        h = self._forward(ids, pos[:, None], attend)  # [B, 1, H]
        return self._logits(h[:, 0])


# One extra attention call costs about as much as reading this many cached positions of one row
# (measured on CPU: ~11 us per call vs ~0.037 us per row-position). The rule only picks a split; any
# value gives exact results.
_CALL_COST_POSITIONS = 300


def split_span(keys: list[int]) -> tuple[int, list[int]]:
    """Decode attention over a batch whose rows attend to `keys[r]` cached positions.

    One dense call over ``B x max(keys)`` reads every short row's padding; with long-tail batches
    (a few long resumed samples among many short ones) that padding is most of the work. Returns
    ``(span, long_rows)``: a dense call covers ``span`` positions of every row and each row in
    ``long_rows`` is attended alone, choosing the span that minimises positions read plus calls.
    """
    order = sorted(range(len(keys)), key=keys.__getitem__, reverse=True)
    best_cost, best_k = len(keys) * keys[order[0]], 0
    alone = 0  # cost of the k longest rows attended alone
    for k in range(1, len(order)):
        alone += keys[order[k - 1]] + _CALL_COST_POSITIONS
        cost = len(keys) * keys[order[k]] + alone
        if cost < best_cost:
            best_cost, best_k = cost, k
    return keys[order[best_k]], order[:best_k]


class FallbackRunner:
    """Any causal LM: no KV cache, the full sequence is recomputed each step (O(n^2), but exact)."""

    def __init__(self, model: Any, num_rows: int, max_len: int) -> None:
        self.model = model
        self.num_rows = num_rows
        self.max_len = max_len
        self.rows: list[list[int]] = [[] for _ in range(num_rows)]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def allocate(self) -> None:
        self.rows = [[] for _ in range(self.num_rows)]

    def free(self) -> None:
        self.rows = []

    def kv_bytes(self) -> int:
        return 0

    def free_row(self, row: int) -> None:
        self.rows[row] = []

    def move_row(self, src: int, dst: int, length: int | None = None) -> None:
        self.rows[dst] = self.rows[src]

    def _run(self, seqs: list[list[int]]) -> torch.Tensor:
        n, lmax = len(seqs), max(len(s) for s in seqs)
        ids = torch.zeros((n, lmax), dtype=torch.long, device=self.device)
        att = torch.zeros((n, lmax), dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            att[i, : len(s)] = 1
        logits = self.model(input_ids=ids, attention_mask=att).logits  # [n, Lp, V]
        last = torch.tensor([len(s) - 1 for s in seqs], device=self.device)
        return logits[torch.arange(n, device=self.device), last].float()

    def prefill(self, rows: list[int], seqs: list[list[int]], reserve: list[int] | None = None) -> torch.Tensor:
        for r, s in zip(rows, seqs, strict=True):
            self.rows[r] = list(s)
        return self._run(seqs)

    def decode(self, tokens: list[int], ctx_lens: list[int]) -> torch.Tensor:
        for r, t in enumerate(tokens):
            self.rows[r].append(t)
        return self._run(self.rows[: len(tokens)])
