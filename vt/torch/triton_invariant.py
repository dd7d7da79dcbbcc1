"""Batch-invariant Triton kernels for vt.torch on CUDA (imported only there: this module needs
Triton): the bits of a row's result depend on that row alone, not on how many rows the call
has, on what the other rows hold, or on which path computes it. vt.torch.llama's
batch_invariant mode runs its matmuls and its attention through them (its norms, RoPE and
SiLU product are one program per row already: vt.torch.triton_fused).

linear(x, weight, bias): y = x @ weight.T (+ bias) as one Triton matmul whose block shape
is a function of the weight's shape and dtype only (linear_config), never of M: each row
of x is a row of a BLOCK_M tile (rows past M read as zeros), and each output is summed over
K in BLOCK_K steps, in order, by the same instructions whatever M is. No split-K and no
autotuning: the autotuner could pick another shape in another process, and it times on its
first call, which may come inside a capture. Everything is sized from the shapes (no host
sync), so a call captures in a CUDA graph as it is; its output comes from torch's allocator
(vt's private pool under capture).

Paged attention (vt.torch.paged_attention's functions with invariant=True): each query
token's keys are cut into spans of SPAN positions from position 0 (SPAN fixed: decode
attention's own split count, decode_splits, follows the rows), each span is an online
softmax over BLOCK_N tiles (_span), and the spans are folded in order by one formula
(_fold). A decode step runs its spans as programs of their own (_decode_spans writes each
span's max, sum and accumulator) and folds them in a second kernel (_fold_spans); a step
with prompt tokens (_varlen_spans: prompt chunks and a mixed step's decode rows) folds
each tile's spans in the program that computed them. Both run those helpers on query tiles
of one shape, ROWS rows by HEAD_DIM (a decode row's group of heads, or ROWS // BLOCK_G
tokens of a sequence times their heads), so the same dots and the same float32 steps
reach a token's output on either path, and a chunk boundary only moves which program
computes a token. The kernels are compiled without floating-point contraction (no
multiply-add fused into an FMA differently in one kernel than in the other).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vt.torch import triton_attention as ta

# Positions per attention span. A one-row decode step of the 8B shape runs 8 KV heads x
# cdiv(live, SPAN) span programs: 64 at 1,024 live tokens.
SPAN = 128
NUM_WARPS = ta.NUM_WARPS


def linear_config(N: int, K: int, dtype: torch.dtype) -> dict:
    """The one block shape of linear() for a weight [N, K] of dtype: BLOCK_M rows of x a
    program, BLOCK_N output columns, BLOCK_K of the reduction a step."""
    if dtype == torch.float32:   # exact float32 dots run on the CUDA cores: smaller tiles
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=16, BLOCK_N=32 if N <= 8192 else 64, BLOCK_K=128, num_warps=4,
                num_stages=4)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias [N], added in float32 before the one rounding) ->
    [M, N] in weight's dtype; bf16, fp16 or float32 (float32: exact dots, as F.linear's
    default). config: a block shape other than linear_config's (a benchmark's candidate;
    rows computed under two configs need not agree)."""
    _check_linear(x, weight, bias)
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=weight.dtype, device=weight.device)
    if M == 0:
        return y
    c = dict(linear_config(N, K, weight.dtype) if config is None else config)
    grid = (triton.cdiv(M, c["BLOCK_M"]), triton.cdiv(N, c["BLOCK_N"]))
    _matmul[grid](x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0),
                  weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                  EVEN_K=K % c["BLOCK_K"] == 0, PRECISION=ta.dot_precision(weight.dtype), **c)
    return y


def _check_linear(x, weight, bias):
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"triton_invariant.linear: x [M, K] and weight [N, K] expected, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"triton_invariant.linear: x and weight must share a dtype of bf16, "
                         f"fp16 or float32, got {x.dtype} and {weight.dtype}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"triton_invariant.linear: bias [{weight.shape[0]}] of {x.dtype} "
                         f"expected, got {tuple(bias.shape)} of {bias.dtype}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("triton_invariant.linear: x and weight need a contiguous last dim")


# M is a value the kernel must not specialize on (Triton compiles M == 1 apart by default):
# one compiled kernel serves every M.
@triton.jit(do_not_specialize=["M"])
def _matmul(X, W, BIAS, Y, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
            EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (m, n): grid axis 0 (the fastest) walks the row tiles, so the tiles that read
    # one weight slab run together and share it through L2.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm[:, None] < M
    nmask = rn[:, None] < N
    x_ptr = X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptr = W + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr, mask=mmask, other=0.0)
            w = tl.load(w_ptr, mask=nmask, other=0.0)
        else:
            kmask = (k0 + rk)[None, :] < K
            x = tl.load(x_ptr, mask=mmask & kmask, other=0.0)
            w = tl.load(w_ptr, mask=nmask & kmask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=mmask & (rn[None, :] < N))


def tile_rows(group: int) -> int:
    """ROWS, the query tile's rows for `group` heads per KV head: the 16 rows a tensor-core dot
    needs at least, or the group padded to a power of two."""
    return max(16, triton.next_power_of_2(group))


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, block_size: int,
                 span: int = SPAN):
    """vt.torch.paged_attention.paged_decode_attention(..., invariant=True)'s CUDA path
    (arguments checked there). span: positions per span (another value gives other bits)."""
    S, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    ta.check_layout("paged_decode_attention", q, k_cache, v_cache)
    spans = triton.cdiv(block_tables.shape[1] * block_size, span)
    acc = torch.empty(S, heads, spans, head_dim, dtype=torch.float32, device=q.device)
    stats = torch.empty(S, heads, spans, 2, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if S == 0:
        return out
    shape = dict(GROUP=group, ROWS=tile_rows(group), HEAD_DIM=head_dim, SPAN=span, SPANS=spans,
                 num_warps=NUM_WARPS, enable_fp_fusion=False)
    _decode_spans[(S, kv_heads, spans)](
        q, k_cache, v_cache, block_tables, seq_lens, acc, stats, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), 1.0 / head_dim ** 0.5, BLOCK_N=ta.BLOCK_N,
        BLOCK_SIZE=block_size, PRECISION=ta.dot_precision(q.dtype), **shape)
    _fold_spans[(S, kv_heads)](acc, stats, seq_lens, out, out.stride(0), out.stride(1), **shape)
    return out


def paged_varlen(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, *,
                 block_size: int, max_query_len: int, span: int = SPAN):
    """vt.torch.paged_attention.paged_varlen_attention(..., invariant=True)'s CUDA path
    (arguments checked there)."""
    T, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    B = seq_lens.shape[0]
    ta.check_layout("paged_varlen_attention", q, k_cache, v_cache)
    out = torch.empty_like(q)
    if T == 0 or B == 0 or max_query_len < 1:
        return out
    rows, block_g = tile_rows(group), triton.next_power_of_2(group)
    tokens = rows // block_g
    _varlen_spans[(B, triton.cdiv(max_query_len, tokens), kv_heads)](
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), 1.0 / head_dim ** 0.5,
        GROUP=group, BLOCK_G=block_g, TOKENS=tokens, ROWS=rows, HEAD_DIM=head_dim,
        BLOCK_N=ta.BLOCK_N, BLOCK_SIZE=block_size, SPAN=span,
        PRECISION=ta.dot_precision(q.dtype), num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out


@triton.jit
def _span(q, pos, K, V, table, lo, hi, kvh, d, stride_kt, stride_kh, stride_vt, stride_vh,
          scale, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
    """The online softmax of the query tile q [ROWS, HEAD_DIM] over one sequence's positions
    lo .. hi - 1, each row seeing those up to its own position pos [ROWS]: (max, sum [ROWS],
    unnormalized accumulator [ROWS, HEAD_DIM]). A row with pos >= lo sees position lo, in
    the first tile, so its max is finite from there on; a row with pos < lo sees none and
    gets NaN, which _fold discards."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        t, tmask, k, v = ta.kv_tile(K, V, table, start, hi, kvh, d, stride_kt, stride_kh,
                                    stride_vt, stride_vh, BLOCK_N, BLOCK_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale     # [ROWS, BLOCK_N]
        s = tl.where((t[None, :] <= pos[:, None]) & tmask[None, :], s, float("-inf"))
        m, l, acc = ta.softmax_step(s, v, m, l, acc, PRECISION)
    return m, l, acc


@triton.jit
def _fold(M, L, ACC, m, l, acc, has):
    """The running (max M, sum L, accumulator ACC) of the spans before, with one more span's
    (m, l, acc) folded in for the rows where `has` (the others keep theirs). The first fold
    into (-inf, 0, 0) gives the span's own values exactly."""
    M_new = tl.maximum(M, m)
    a = tl.exp(M - M_new)
    b = tl.exp(m - M_new)
    L_new = L * a + l * b
    ACC_new = ACC * a[:, None] + acc * b[:, None]
    return (tl.where(has, M_new, M), tl.where(has, L_new, L),
            tl.where(has[:, None], ACC_new, ACC))


@triton.jit
def _finish(ACC, L):
    """The attention output of the folded spans: ACC / L, zeros for a row without keys."""
    return ACC / tl.where(L > 0, L, 1.0)[:, None]


@triton.jit
def _decode_spans(Q, K, V, BT, LENS, ACC, STATS, stride_qs, stride_qh, stride_kt, stride_kh,
                  stride_vt, stride_vh, stride_bt, scale, GROUP: tl.constexpr,
                  ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, SPAN: tl.constexpr,
                  SPANS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  PRECISION: tl.constexpr):
    # Program (n, g, p): span p of row n for the heads of KV head g (tile rows 0 .. GROUP - 1);
    # a span past the row's tokens writes nothing.
    n = tl.program_id(0)
    kvh = tl.program_id(1)
    p = tl.program_id(2)
    length = tl.load(LENS + n)
    lo = p * SPAN
    if lo < length:
        h = tl.arange(0, ROWS)
        hmask = h < GROUP
        head = kvh * GROUP + h
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + n * stride_qs + head[:, None] * stride_qh + d[None, :],
                    mask=hmask[:, None], other=0.0)
        pos = tl.zeros([ROWS], tl.int32) + (length - 1)
        m, l, acc = _span(q, pos, K, V, BT + n.to(tl.int64) * stride_bt, lo,
                          tl.minimum(length, lo + SPAN), kvh, d, stride_kt, stride_kh,
                          stride_vt, stride_vh, scale, ROWS, HEAD_DIM, BLOCK_N, BLOCK_SIZE,
                          PRECISION)
        row = (n * (GROUP * tl.num_programs(1)) + head).to(tl.int64) * SPANS + p   # [n, head, p]
        tl.store(ACC + row[:, None] * HEAD_DIM + d[None, :], acc, mask=hmask[:, None])
        tl.store(STATS + row * 2, m, mask=hmask)
        tl.store(STATS + row * 2 + 1, l, mask=hmask)


@triton.jit
def _fold_spans(ACC, STATS, LENS, OUT, stride_os, stride_oh, GROUP: tl.constexpr,
                ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, SPAN: tl.constexpr,
                SPANS: tl.constexpr):
    # Program (n, g): row n's spans that hold tokens, folded in order, for KV head g's heads.
    n = tl.program_id(0)
    kvh = tl.program_id(1)
    length = tl.load(LENS + n)
    h = tl.arange(0, ROWS)
    hmask = h < GROUP
    head = kvh * GROUP + h
    d = tl.arange(0, HEAD_DIM)
    pos = tl.zeros([ROWS], tl.int32) + (length - 1)
    M = tl.full([ROWS], float("-inf"), tl.float32)
    L = tl.zeros([ROWS], tl.float32)
    A = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    base = (n * (GROUP * tl.num_programs(1)) + head).to(tl.int64) * SPANS
    for p in range(0, tl.cdiv(length, SPAN)):
        row = base + p
        m = tl.load(STATS + row * 2, mask=hmask, other=0.0)
        l = tl.load(STATS + row * 2 + 1, mask=hmask, other=0.0)
        acc = tl.load(ACC + row[:, None] * HEAD_DIM + d[None, :], mask=hmask[:, None], other=0.0)
        M, L, A = _fold(M, L, A, m, l, acc, p * SPAN <= pos)
    tl.store(OUT + n * stride_os + head[:, None] * stride_oh + d[None, :],
             _finish(A, L).to(OUT.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _varlen_spans(Q, K, V, QSL, LENS, BT, OUT, stride_qt, stride_qh, stride_kt, stride_kh,
                  stride_vt, stride_vh, stride_bt, stride_ot, stride_oh, scale,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, TOKENS: tl.constexpr,
                  ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, SPAN: tl.constexpr, PRECISION: tl.constexpr):
    # Program (i, t, g): TOKENS of sequence i's new tokens (query tile t; a tile past its
    # count exits) for the heads of KV head g, token-major rows; its spans folded in place.
    i = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    first = tl.load(QSL + i)
    n = tl.load(QSL + i + 1) - first          # the sequence's new tokens in this step
    if tile * TOKENS < n:
        prefix = tl.load(LENS + i) - n        # its cached positions before them
        r = tl.arange(0, ROWS)
        token = tile * TOKENS + r // BLOCK_G
        hig = r % BLOCK_G
        live = (token < n) & (hig < GROUP)
        head = kvh * GROUP + hig
        d = tl.arange(0, HEAD_DIM)
        row = (first + token).to(tl.int64)
        q = tl.load(Q + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=live[:, None], other=0.0)
        pos = prefix + token                  # each query row's position
        hi = prefix + tl.minimum(n, (tile + 1) * TOKENS)   # past the tile's last token
        table = BT + i.to(tl.int64) * stride_bt
        M = tl.full([ROWS], float("-inf"), tl.float32)
        L = tl.zeros([ROWS], tl.float32)
        A = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        for p in range(0, tl.cdiv(hi, SPAN)):
            lo = p * SPAN
            m, l, acc = _span(q, pos, K, V, table, lo, tl.minimum(hi, lo + SPAN), kvh, d,
                              stride_kt, stride_kh, stride_vt, stride_vh, scale, ROWS,
                              HEAD_DIM, BLOCK_N, BLOCK_SIZE, PRECISION)
            M, L, A = _fold(M, L, A, m, l, acc, lo <= pos)
        tl.store(OUT + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 _finish(A, L).to(OUT.dtype.element_ty), mask=live[:, None])
