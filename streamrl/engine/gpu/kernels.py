"""Triton kernels of the paged runner: one launch where eager PyTorch takes five to ten.

A decode step of a small model on a GPU is bound by how many kernels it launches, not by the GPU's
bandwidth: RMSNorm is ~8 eager kernels, rotary embedding ~5, a KV write by `index_put` several more.
Inside a CUDA graph the launches are cheap, but each kernel still costs its fixed few microseconds of
GPU time, so the step fuses what it can:

- `add_rms_norm`: the residual add and RMSNorm (Llama/Qwen2's, rounding as transformers does).
- `silu_mul`: SwiGLU's `silu(gate) * up` from the fused gate/up projection.
- `rope_store`: rotary embedding of q and k in place in the fused qkv projection, and k, v written
  to their KV-cache slots (a slot < 0 writes nothing: padded rows of a CUDA-graph batch).
- `paged_decode_attention`: one query per row against its paged KV ("flash decoding": each row's
  keys split across programs, partial softmaxes merged by log-sum-exp); lengths are read from a
  device tensor, so one captured graph serves every length.
- `sample`: temperature sampling by the Gumbel-max trick with counter-based noise (a hash of the
  request's seed, the token's place and the vocabulary index), the token's log-probability at the
  same temperature: one pass over the logits, the same token for the same seed whatever shares the
  batch, and no per-request generator.

Every kernel runs on CPU tensors under `TRITON_INTERPRET=1`, which is how the tests check each one
against a PyTorch reference where there is no GPU. The environment variable is read when this module
is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---- RMSNorm (+ residual) ----------------------------------------------------------------------------


@triton.jit
def _add_rms_norm(X, R, W, OUT, stride_x, stride_r, stride_o, n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in a long prefill
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(X + row * stride_x + cols, mask=m, other=0.0)
    if HAS_RES:
        # transformers adds in the model's dtype, then normalises that sum: round, store, go on from it.
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(R + row * stride_r + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(W + cols, mask=m, other=0.0)
    y = (xf * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(OUT + row * stride_o + cols, y.to(OUT.dtype.element_ty), mask=m)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); `residual` is updated in place. Without a residual:
    (RMSNorm(x), x). x: [N, H]."""
    n, h = x.shape
    out = torch.empty_like(x)
    r = x if residual is None else residual
    _add_rms_norm[(n,)](x, r, weight, out, x.stride(0), r.stride(0), out.stride(0), h, eps,
                        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(h))
    return out, r


# ---- SwiGLU -------------------------------------------------------------------------------------------


@triton.jit
def _silu_mul(GU, OUT, stride_gu, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(GU + row * stride_gu + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + inter + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (g / (1.0 + tl.exp(-g)) * u).to(OUT.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [N, 2I] (gate first): [N, I]."""
    n, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul[(n, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block)
    return out


# ---- rotary embedding + KV write -----------------------------------------------------------------------


@triton.jit
def _rope_store(QKV, COS, SIN, POS, SLOT, KC, VC, stride_qkv, stride_cs, stride_slot, heads, kv_heads,
                D: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr, KB: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t)
    d = tl.arange(0, HALF)[None, :]
    c1 = tl.load(COS + pos * stride_cs + d)
    c2 = tl.load(COS + pos * stride_cs + HALF + d)
    s1 = tl.load(SIN + pos * stride_cs + d)
    s2 = tl.load(SIN + pos * stride_cs + HALF + d)
    row = QKV + t * stride_qkv
    h = tl.arange(0, HB)[:, None]
    hm = h < heads
    q1 = tl.load(row + h * D + d, mask=hm, other=0.0)
    q2 = tl.load(row + h * D + HALF + d, mask=hm, other=0.0)
    q1f, q2f = q1.to(tl.float32), q2.to(tl.float32)
    tl.store(row + h * D + d, (q1f * c1 - q2f * s1).to(q1.dtype), mask=hm)
    tl.store(row + h * D + HALF + d, (q2f * c2 + q1f * s2).to(q1.dtype), mask=hm)
    kh = tl.arange(0, KB)[:, None]
    km = kh < kv_heads
    krow = row + heads * D + kh * D
    k1 = tl.load(krow + d, mask=km, other=0.0)
    k2 = tl.load(krow + HALF + d, mask=km, other=0.0)
    k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
    r1 = (k1f * c1 - k2f * s1).to(k1.dtype)
    r2 = (k2f * c2 + k1f * s2).to(k1.dtype)
    tl.store(krow + d, r1, mask=km)  # prefill attends over the rotated keys in qkv itself
    tl.store(krow + HALF + d, r2, mask=km)
    slot = tl.load(SLOT + t)
    if slot >= 0:
        dst = kh * D + d
        tl.store(KC + slot * stride_slot + dst, r1.to(KC.dtype.element_ty), mask=km)
        tl.store(KC + slot * stride_slot + HALF + dst, r2.to(KC.dtype.element_ty), mask=km)
        vrow = row + (heads + kv_heads) * D + kh * D
        tl.store(VC + slot * stride_slot + dst, tl.load(vrow + d, mask=km, other=0.0), mask=km)
        tl.store(VC + slot * stride_slot + HALF + dst, tl.load(vrow + HALF + d, mask=km, other=0.0), mask=km)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
               head_dim: int) -> None:
    """qkv [N, (heads + 2 kv_heads) * head_dim]: q and k rotated in place at `positions` [N] (cos, sin:
    [max_len, head_dim] tables); k and v written to `k_cache` / `v_cache` [slots, kv_heads, head_dim]
    at `slots` [N] (< 0: not written)."""
    n = qkv.shape[0]
    _rope_store[(n,)](qkv, cos, sin, positions, slots, k_cache, v_cache, qkv.stride(0), cos.stride(0),
                      k_cache.stride(0), heads, kv_heads, D=head_dim, HALF=head_dim // 2,
                      HB=triton.next_power_of_2(heads), KB=triton.next_power_of_2(kv_heads))


# ---- paged decode attention ----------------------------------------------------------------------------


@triton.jit
def _decode_partial(Q, KC, VC, BT, SEQ, MID_O, MID_L, stride_q, stride_slot, stride_bt, scale, heads,
                    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(SEQ + b)
    per = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = s * per
    hi = tl.minimum(lo + per, seq_len)
    hh = tl.arange(0, GP)
    hm = hh < G
    head = g * G + hh
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_q + head[:, None] * D + d[None, :], mask=hm[:, None], other=0.0)
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        tm = t < hi
        page = tl.load(BT + b * stride_bt + t // PAGE, mask=tm, other=0)
        slot = (page * PAGE + t % PAGE).to(tl.int64)
        off = slot[:, None] * stride_slot + g * D + d[None, :]
        k = tl.load(KC + off, mask=tm[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        qk = tl.where(tm[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VC + off, mask=tm[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    ok = l_i > 0
    out = tl.where(ok[:, None], acc / tl.where(ok, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(ok, m_i + tl.log(tl.where(ok, l_i, 1.0)), float("-inf"))
    base = (b * heads + head) * SPLITS + s
    tl.store(MID_O + base[:, None] * D + d[None, :], out, mask=hm[:, None])
    tl.store(MID_L + base, lse, mask=hm)


@triton.jit
def _decode_merge(MID_O, MID_L, OUT, stride_o, heads, D: tl.constexpr, SPLITS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    base = (b * heads + h) * SPLITS + s
    lse = tl.load(MID_L + base)
    top = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - tl.where(top > float("-inf"), top, 0.0)), 0.0)
    o = tl.load(MID_O + base[:, None] * D + d[None, :])
    out = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(OUT + b * stride_o + h * D + d, out.to(OUT.dtype.element_ty))


def decode_splits(batch: int, kv_heads: int) -> int:
    """How many programs share one row's keys: enough to give a GPU's ~132 multiprocessors two
    programs each at small batches, one split once the batch alone fills them."""
    want = triton.cdiv(264, max(1, batch * kv_heads))
    return min(16, triton.next_power_of_2(want))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, *, heads: int,
                           kv_heads: int, head_dim: int, page: int, splits: int, mid_o: torch.Tensor,
                           mid_l: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row: q [B, heads * head_dim] (rows may be strided, e.g. a view into qkv) against
    the first `seq_lens[b]` positions of row b's pages (`block_table` [rows, pages] into the caches
    [slots, kv_heads, head_dim], `page` slots per page). A row with length 0 gets zeros. `mid_o`
    [>= B * heads * splits * head_dim] and `mid_l` [>= B * heads * splits]: float32 scratch.
    Returns [B, heads * head_dim]."""
    b = q.shape[0]
    group = heads // kv_heads
    if out is None:
        out = torch.empty((b, heads * head_dim), dtype=q.dtype, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_partial[(b, kv_heads, splits)](
        q, k_cache, v_cache, block_table, seq_lens, mid_o, mid_l, q.stride(0), k_cache.stride(0),
        block_table.stride(0), scale, heads, G=group, GP=max(16, triton.next_power_of_2(group)), D=head_dim,
        PAGE=page, BLOCK_N=max(16, min(64, page * 4)), SPLITS=splits, PRECISION=precision)
    _decode_merge[(b, heads)](mid_o, mid_l, out, out.stride(0), heads, D=head_dim, SPLITS=splits)
    return out


# ---- sampling -----------------------------------------------------------------------------------------


@triton.jit
def _mix(x):
    # A 32-bit integer hash (Wellons' lowbias32): every input bit moves every output bit.
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _sample(LOGITS, TEMP, SEED, OFFSET, TOK, LOGP, stride, vocab, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.load(TEMP + b)
    greedy = t < 1e-6
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
    seed = tl.load(SEED + b)
    off = tl.load(OFFSET + b)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix(lo ^ _mix(hi ^ _mix(off.to(tl.uint32) ^ 0x9E3779B9)))
    key2 = _mix(key ^ 0x85EBCA6B)
    m = float("-inf")
    total = 0.0
    best = float("-inf")
    best_i = 0
    best_x = 0.0
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        cm = cols < vocab
        x = tl.load(LOGITS + b * stride + cols, mask=cm, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(x, 0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.where(cm, tl.exp(x - m_new), 0.0), 0)
        m = m_new
        bits = _mix(_mix(cols.to(tl.uint32) ^ key) ^ key2)
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where(greedy, x, x - tl.log(-tl.log(u)))
        score = tl.where(cm, score, float("-inf"))
        c_best = tl.max(score, 0)
        c_i = tl.argmax(score, 0)
        c_x = tl.max(tl.where(cols == start + c_i, x, float("-inf")), 0)
        take = c_best > best
        best = tl.where(take, c_best, best)
        best_i = tl.where(take, start + c_i, best_i)
        best_x = tl.where(take, c_x, best_x)
    tl.store(TOK + b, best_i)
    tl.store(LOGP + b, best_x - m - tl.log(total))


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor,
           tokens: torch.Tensor | None = None, logprobs: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits [B, V]: a token drawn from softmax(logits / T) (argmax where T < 1e-6) with
    the noise of (seeds[b], offsets[b]) [B] int64, and its log-probability at T (at 1 for greedy
    rows). Returns (tokens int64 [B], logprobs float32 [B])."""
    b, vocab = logits.shape
    if tokens is None:
        tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    if logprobs is None:
        logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    _sample[(b,)](logits, temperatures, seeds, offsets, tokens, logprobs, logits.stride(0), vocab,
                  BLOCK=min(4096, triton.next_power_of_2(vocab)))
    return tokens, logprobs
