"""The Triton kernels behind vt.torch.paged_attention on CUDA (imported only there: this
module needs Triton).

_split: grid (rows, kv_heads, splits). Program (n, g, p) takes the p-th span of row n's live
tokens (spans of whole BLOCK_N tiles, bounds from seq_lens on the device) for the `group`
query heads of KV head g, so each K/V row is read once for all its heads (no per-head copy):
the group's queries are the rows of one [BLOCK_H, head_dim] tile, padded to the 16 rows a
tensor-core dot needs. It keeps an online softmax and writes the span's unnormalized
accumulator, running max and sum (float32) to the workspace; a span past the row's tokens
(at 256 live tokens, 56 of the 64 spans a one-row step of the 8B shape has) writes nothing.
The merge reads the spans that hold tokens, rescales them to their common max, divides by
the sum and writes the output. Below FOLD_MIN_ROWS rows a _merge kernel, grid (rows, heads),
does it after the split kernel. From there on the split kernel does (merges_in_split): the
last program of each (row, KV head) to finish its span merges the group's heads
(_merge_group). "Last" is an atomic count per (row, KV head) in span_counters (int32 zeros),
which that program sets back to 0, so a caller that keeps one zeroed buffer for its steps
(vt.torch.llama's decoder) adds no memset to them. Each span's workspace stores come before a
CTA barrier and the count's acquire-release add, and the merge reads them through L2 (.cg),
so the merging program sees every span's values.

_rope_split: _split that starts from the fused q/k/v projection of a decode step (vt.torch.
paged_attention.rope_cache_decode_attention): each program rotates its group's queries and
its KV head's new key (RoPE, rounded to the storage dtype as vt.torch.fused.rope_and_cache
rounds them), takes the new key and value for the row's last position from registers instead
of the cache, and program p = 0 of each (row, KV head) writes them to the row's cache slot.
No program reads that slot, so the write and the reads do not race. With PDL (a one-row
step) each program loads its span's first tile of the cache before it waits for the qkv
projection. The merge as above.

_varlen: an eager step's tokens, every sequence's at once (vt.torch.paged_attention.
paged_varlen_attention). Grid (sequences, query tiles, kv_heads): program (i, t, g) takes
BLOCK_M of sequence i's new tokens (query tile t; a tile past the sequence's count exits) for
the `group` heads of KV head g, as the BLOCK_M * BLOCK_G rows of one tile (token-major), so a
K/V row is read once for the tile's tokens and heads. It walks the sequence's cache from
position 0 up to its tile's last token, causal (new token j of n in a context of L sees
positions 0 .. L - n + j), with an online softmax. No split: a prompt chunk's query tiles
fill the GPU, and a decode row of an eager step is one tile.

kv_tile and softmax_step are also the steps of vt.torch.triton_invariant's batch-invariant
attention kernels.

An FP8 cache (FP8_KV; vt.torch.kv_fp8): each kernel loads a tile's e4m3 codes (half the bytes
of bf16) and feeds them to its dots in q's dtype, which holds every e4m3 value exactly; K's
scale multiplies the scores (score_scale) and V's the accumulator (value_scaled), in float32,
as the CPU reference reads them. _rope_split writes the new key and value as codes (kv_code)
and takes those codes from registers. The scales are device tensors, loaded in the kernel:
nothing is read on the host, so the steps capture as they did.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vt.torch import triton_pdl as pdl
from vt.torch.triton_fused import kv_code, kv_scale_args

# Keys per tile of the split decode kernels: two vt blocks of 16, or LONG_BLOCK_N from
# LONG_TILE_MIN_ROWS rows (decode_splits gives those rows 3 spans or fewer, so each span is
# long). On an H100, 8B shape (8 KV heads, head_dim 128), us a layer, 32-key tiles against 128:
#   rows x live   bf16 cache      FP8 cache
#    2 x  256     6.3 /  7.6      6.3 /  8.3
#   16 x  256     9.7 / 11.3      9.8 / 11.6
#   16 x 2048    51.6 / 56.4     52.3 / 42.5
#   32 x  256    17.4 / 16.7     16.5 / 16.5
#   32 x 2048   113.3 / 98.5     89.4 / 69.4
#  128 x 2048   410.8 / 360.2   281.8 / 239.1
# A longer tile needs more shared memory for its K and V: only caches whose rows (head_dim
# elements) are at most LONG_TILE_MAX_ROW_BYTES take it (a float32 cache of head_dim 128 does
# not fit an H100's shared memory in _rope_split).
BLOCK_N = 32
LONG_BLOCK_N = 128
LONG_TILE_MIN_ROWS = 32
LONG_TILE_MAX_ROW_BYTES = 256
NUM_WARPS = 4
# From this many rows the split kernels merge their own spans (merges_in_split). Measured on an
# H100 (8B shape): at 32 rows 62.1 us a layer against 63.9 for the split and merge kernels
# (FP8 cache; bf16 81.7 against 83.7), at 64 rows 119.0 against 119.9; at one row, where PDL
# hides the merge kernel's launch, the fold made the step 2.4-3.6 % slower.
FOLD_MIN_ROWS = 32
# _split converts an FP8 cache's V tile as loaded (_converted_as_loaded); False: as Triton
# places it (for comparison)
PIN_FP8_V = True
# _split and _rope_split read an FP8 cache's codes into a bf16 or fp16 model's dots with
# integer instructions (_codes_as); False: through Triton's conversion (for comparison).
# _split, measured on an H100 (8B shape, 32 rows x 2,048 live tokens, 3 spans), us a layer:
# both 61.5, the bits alone 65.9, the pin alone 67.8; a bf16 cache 95.4. _rope_split (one row,
# 8B shape) compiles to 176 registers a thread instead of 210 (Triton 3.9, sm_90; 152 over a
# bf16 cache); not timed apart.
FP8_CODES_BY_BITS = True


def split_block_n(rows: int, k_cache: torch.Tensor) -> int:
    """Keys per tile of the split decode kernels for a step of `rows` rows over k_cache (see
    BLOCK_N)."""
    if (rows >= LONG_TILE_MIN_ROWS
            and k_cache.shape[-1] * k_cache.element_size() <= LONG_TILE_MAX_ROW_BYTES):
        return LONG_BLOCK_N
    return BLOCK_N


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, block_size: int, splits: int,
                 k_scale=None, v_scale=None, span_counters=None):
    """vt.torch.paged_attention.paged_decode_attention's CUDA path (arguments checked there)."""
    S, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    check_layout("paged_decode_attention", q, k_cache, v_cache)
    acc, stats, out = _span_buffers(S, heads, head_dim, splits, q.dtype, q.device)
    if S == 0:
        return out
    block_n = split_block_n(S, k_cache)
    launch = pdl.launch_options(q.device, S)
    fold = merges_in_split(S, kv_heads, span_counters)
    _split[(S, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, acc, stats,
        _counters(span_counters, S * kv_heads, q.device, fold), out,
        *kv_scale_args(k_cache, k_scale, v_scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0), out.stride(0),
        out.stride(1), 1.0 / head_dim ** 0.5,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_N=block_n, BLOCK_SIZE=block_size, SPLITS=splits,
        BLOCK_P=triton.next_power_of_2(splits), PRECISION=dot_precision(q.dtype),
        FP8_KV=k_scale is not None, FOLD=fold,
        PIN_V=PIN_FP8_V and k_scale is not None and q.is_cuda,   # the interpreter runs no PTX
        BY_BITS=_codes_by_bits(k_scale, q), num_warps=NUM_WARPS, **launch)
    return out if fold else _merge_spans(acc, stats, seq_lens, out, splits, block_n)


def rope_paged_decode(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables,
                      seq_lens, *, heads: int, kv_heads: int, head_dim: int, block_size: int,
                      splits: int, k_scale=None, v_scale=None, span_counters=None):
    """vt.torch.paged_attention.rope_cache_decode_attention's CUDA path (arguments checked
    there)."""
    half = head_dim // 2
    if half < 16 or half & (half - 1):
        raise ValueError(f"rope_cache_decode_attention: the Triton kernel needs head_dim / 2 a "
                         f"power of two of at least 16, got head_dim {head_dim}")
    if (qkv.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1
            or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0)):
        raise ValueError("rope_cache_decode_attention: qkv, the caches and cos, sin need a "
                         "contiguous last dim, cos and sin one row stride")
    S = qkv.shape[0]
    group = heads // kv_heads
    acc, stats, out = _span_buffers(S, heads, head_dim, splits, qkv.dtype, qkv.device)
    if S == 0:
        return out
    block_n = split_block_n(S, k_cache)
    launch = pdl.launch_options(qkv.device, S)
    fold = merges_in_split(S, kv_heads, span_counters)
    _rope_split[(S, kv_heads, splits)](
        qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
        acc, stats, _counters(span_counters, S * kv_heads, qkv.device, fold), out,
        *kv_scale_args(k_cache, k_scale, v_scale), qkv.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0), out.stride(0),
        out.stride(1), 1.0 / head_dim ** 0.5,
        HEADS=heads, KV_HEADS=kv_heads, GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)), HALF=half,
        BLOCK_N=block_n, BLOCK_SIZE=block_size, SPLITS=splits,
        BLOCK_P=triton.next_power_of_2(splits), PRECISION=dot_precision(qkv.dtype),
        FP8_KV=k_scale is not None, FOLD=fold,
        BY_BITS=_codes_by_bits(k_scale, qkv), num_warps=NUM_WARPS, **launch)
    return out if fold else _merge_spans(acc, stats, seq_lens, out, splits, block_n)


def _codes_by_bits(k_scale, x) -> bool:
    """Whether a split kernel reads an FP8 cache's codes by bits (_codes_as): the switch on,
    an FP8 cache, on CUDA (the interpreter runs no PTX), a bf16 or fp16 model."""
    return (FP8_CODES_BY_BITS and k_scale is not None and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16))


def check_layout(name: str, q, k_cache, v_cache) -> None:
    """What the query-tensor kernels need beyond paged_attention's shape checks: a contiguous
    last dim in q and the caches, and a power-of-two head_dim."""
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{name}: q and the caches need a contiguous last dim")
    head_dim = q.shape[-1]
    if head_dim & (head_dim - 1):
        raise ValueError(f"{name}: the Triton kernel needs a power-of-two head_dim, got "
                         f"{head_dim}")


def _span_buffers(S, heads, head_dim, splits, dtype, device):
    """The split kernels' float32 workspace (each span's accumulator, and its max and sum)
    and the output."""
    acc = torch.empty(S, heads, splits, head_dim, dtype=torch.float32, device=device)
    stats = torch.empty(S, heads, splits, 2, dtype=torch.float32, device=device)
    return acc, stats, torch.empty(S, heads, head_dim, dtype=dtype, device=device)


def merges_in_split(rows: int, kv_heads: int, span_counters=None) -> bool:
    """Whether the split kernels of a rows-row step merge their spans themselves (the last
    span program of each (row, KV head)) rather than a _merge kernel after them: from
    FOLD_MIN_ROWS rows, where there is a count for each (row, KV head): span_counters None (a
    fresh buffer) or of at least rows * kv_heads. A step of more rows than the caller's buffer
    covers (a speculative verify step: k + 1 rows per sequence, more than the sequences
    LlamaDecoder sizes its buffer for) merges in the _merge kernel."""
    return rows >= FOLD_MIN_ROWS and (span_counters is None
                                      or span_counters.numel() >= rows * kv_heads)


def _counters(span_counters, needed: int, device, fold: bool) -> torch.Tensor:
    """The split kernels' per-(row, KV head) counts when they fold the merge: the caller's
    buffer (int32 zeros, which the kernels leave zero; merges_in_split checked its length), or
    a fresh one of `needed`. Without the fold the kernels read none (an empty tensor stands
    in). A caller's buffer of another dtype, device or rank is refused either way."""
    if span_counters is not None and (span_counters.dtype != torch.int32
                                      or span_counters.device != device
                                      or span_counters.dim() != 1):
        raise ValueError(f"span_counters: int32 [rows x KV heads] on {device} expected, got "
                         f"{span_counters.dtype} {tuple(span_counters.shape)} on "
                         f"{span_counters.device}")
    if not fold:
        return torch.empty(0, dtype=torch.int32, device=device)
    if span_counters is None:
        return torch.zeros(needed, dtype=torch.int32, device=device)
    return span_counters


def _merge_spans(acc, stats, seq_lens, out, splits: int, block_n: int):
    """_merge over the spans a split kernel of block_n-key tiles wrote (the tile length fixes
    where each span starts: _span_tokens)."""
    S, heads, head_dim = out.shape
    _merge[(S, heads)](acc, stats, seq_lens, out, out.stride(0), out.stride(1),
                       HEAD_DIM=head_dim, SPLITS=splits,
                       BLOCK_P=triton.next_power_of_2(splits), BLOCK_N=block_n,
                       num_warps=NUM_WARPS, **pdl.launch_options(out.device, S))
    return out


def dot_precision(dtype) -> str:
    # tl.dot rounds float32 inputs to TF32 by default: a float32 model's attention would then
    # differ from torch's at ~1e-3, enough to flip a greedy token.
    return "ieee" if dtype == torch.float32 else "tf32"


ROWS = 64   # query rows (token x head) per _varlen tile: a tensor-core dot's M


def paged_varlen(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, *,
                 block_size: int, max_query_len: int, k_scale=None, v_scale=None):
    """vt.torch.paged_attention.paged_varlen_attention's CUDA path (arguments checked there)."""
    T, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    B = seq_lens.shape[0]
    check_layout("paged_varlen_attention", q, k_cache, v_cache)
    out = torch.empty_like(q)
    if T == 0 or B == 0 or max_query_len < 1:
        return out
    block_g = triton.next_power_of_2(group)
    block_m = max(1, ROWS // block_g)
    grid = (B, triton.cdiv(max_query_len, block_m), kv_heads)
    _varlen[grid](
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out,
        *kv_scale_args(k_cache, k_scale, v_scale), q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), 1.0 / head_dim ** 0.5,
        GROUP=group, BLOCK_G=block_g, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_N=BLOCK_N,
        BLOCK_SIZE=block_size, PRECISION=dot_precision(q.dtype), FP8_KV=k_scale is not None,
        num_warps=NUM_WARPS)
    return out


@triton.jit
def _varlen(Q, K, V, QSL, LENS, BT, OUT, K_SCALE, V_SCALE, stride_qt, stride_qh, stride_kt,
            stride_kh, stride_vt, stride_vh, stride_bt, stride_ot, stride_oh, scale,
            GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            PRECISION: tl.constexpr, FP8_KV: tl.constexpr):
    i = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    first = tl.load(QSL + i)
    n = tl.load(QSL + i + 1) - first          # the sequence's new tokens in this step
    if tile * BLOCK_M < n:
        prefix = tl.load(LENS + i) - n        # its cached positions before them
        r = tl.arange(0, BLOCK_M * BLOCK_G)
        token = tile * BLOCK_M + r // BLOCK_G
        hig = r % BLOCK_G
        live = (token < n) & (hig < GROUP)
        head = kvh * GROUP + hig
        d = tl.arange(0, HEAD_DIM)
        row = (first + token).to(tl.int64)
        q = tl.load(Q + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=live[:, None], other=0.0)                       # [ROWS, HEAD_DIM]
        pos = prefix + token                  # each query row's position
        hi = prefix + tl.minimum(n, (tile + 1) * BLOCK_M)   # past the tile's last token
        m = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, HEAD_DIM], tl.float32)
        table = BT + i.to(tl.int64) * stride_bt
        scale = score_scale(scale, K_SCALE, FP8_KV)
        for start in range(0, hi, BLOCK_N):
            t, tmask, k, v = kv_tile(K, V, table, start, hi, kvh, d, stride_kt, stride_kh,
                                      stride_vt, stride_vh, BLOCK_N, BLOCK_SIZE)
            k = k.to(Q.dtype.element_ty)   # an FP8 cache's codes: exact in the dtype
            v = v.to(Q.dtype.element_ty)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where((t[None, :] <= pos[:, None]) & tmask[None, :], s, float("-inf"))
            # m is finite from the first tile on: position 0 is every row's key.
            m, l, acc = softmax_step(s, v, m, l, acc, PRECISION)
        o = value_scaled(acc, V_SCALE, FP8_KV) / l[:, None]
        tl.store(OUT + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(OUT.dtype.element_ty), mask=live[:, None])


@triton.jit
def _split(Q, K, V, BT, LENS, ACC, STATS, COUNT, OUT, K_SCALE, V_SCALE, stride_qs, stride_qh,
           stride_kt, stride_kh, stride_vt, stride_vh, stride_bt, stride_os, stride_oh, scale,
           GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
           HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
           SPLITS: tl.constexpr, BLOCK_P: tl.constexpr, PRECISION: tl.constexpr,
           FP8_KV: tl.constexpr, FOLD: tl.constexpr, PDL: tl.constexpr,
           PIN_V: tl.constexpr, BY_BITS: tl.constexpr):
    pdl.launch_next(PDL)
    pdl.wait(PDL)
    n = tl.program_id(0)
    kvh = tl.program_id(1)
    p = tl.program_id(2)
    length = tl.load(LENS + n)
    per = _span_tokens(length, SPLITS, BLOCK_N)
    lo = p * per
    hi = tl.minimum(length, lo + per)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    hmask = h < GROUP
    head = kvh * GROUP + h
    q = tl.load(Q + n * stride_qs + head[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None], other=0.0)                         # [BLOCK_H, HEAD_DIM]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    table = BT + n.to(tl.int64) * stride_bt
    scale = score_scale(scale, K_SCALE, FP8_KV)
    for start in range(lo, hi, BLOCK_N):
        t, tmask, k, v = kv_tile(K, V, table, start, hi, kvh, d, stride_kt, stride_kh,
                                  stride_vt, stride_vh, BLOCK_N, BLOCK_SIZE)
        k = _codes_as(k, Q.dtype.element_ty, BY_BITS)   # an FP8 cache's codes: exact
        v = _converted_as_loaded(_codes_as(v, Q.dtype.element_ty, BY_BITS), PIN_V)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale      # [BLOCK_H, BLOCK_N]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m, l, acc = softmax_step(s, v, m, l, acc, PRECISION)   # m finite: a live key per tile
    acc = value_scaled(acc, V_SCALE, FP8_KV)
    row = (n * (GROUP * tl.num_programs(1)) + head).to(tl.int64) * SPLITS + p   # [n, head, p]
    keep = tl.where(lo < length, hmask, False)   # a span past the row's tokens writes nothing
    tl.store(ACC + row[:, None] * HEAD_DIM + d[None, :], acc, mask=keep[:, None])
    tl.store(STATS + row * 2, m, mask=keep)
    tl.store(STATS + row * 2 + 1, l, mask=keep)
    if FOLD:
        _merge_group(ACC, STATS, COUNT, OUT, n, kvh, GROUP * tl.num_programs(1), head, hmask,
                     d, length, per, stride_os, stride_oh, HEAD_DIM, SPLITS, BLOCK_P)


@triton.jit
def _rope_split(QKV, POS, COS, SIN, K, V, SLOT, BT, LENS, ACC, STATS, COUNT, OUT, K_SCALE,
                V_SCALE, stride_qkv, stride_cos,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_bt, stride_os, stride_oh,
                scale, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, SPLITS: tl.constexpr, BLOCK_P: tl.constexpr,
                PRECISION: tl.constexpr, FP8_KV: tl.constexpr, FOLD: tl.constexpr,
                PDL: tl.constexpr, BY_BITS: tl.constexpr):
    # Each head_dim vector is handled as its two halves (what RoPE rotates together), so the
    # scores are two dots of HALF and the accumulator two [BLOCK_H, HALF] tiles.
    pdl.launch_next(PDL)
    # Before the wait: what no kernel of the step writes (the step's inputs, the RoPE tables,
    # the scales) and the span's first tile of this layer's cache, which holds what earlier
    # steps wrote: of this step's kernels only this one writes into it (the new token, after
    # the wait, and read from registers, not the cache). A one-row step's span is one tile,
    # so its loads leave the critical path behind the qkv projection.
    n = tl.program_id(0)
    kvh = tl.program_id(1)
    p = tl.program_id(2)
    dtype = QKV.dtype.element_ty
    length = tl.load(LENS + n)
    pos = tl.load(POS + n).to(tl.int64)
    d = tl.arange(0, HALF)
    c1 = tl.load(COS + pos * stride_cos + d)
    c2 = tl.load(COS + pos * stride_cos + HALF + d)
    s1 = tl.load(SIN + pos * stride_cos + d)
    s2 = tl.load(SIN + pos * stride_cos + HALF + d)
    per = _span_tokens(length, SPLITS, BLOCK_N)
    lo = p * per
    hi = tl.minimum(length, lo + per)
    table = BT + n.to(tl.int64) * stride_bt
    tmask, new, k1, k2, v1, v2 = _cached_tile(K, V, table, lo, hi, length, kvh, d,
                                              stride_kt, stride_kh, stride_vt, stride_vh,
                                              HALF, BLOCK_N, BLOCK_SIZE)
    if FP8_KV:
        ks = tl.load(K_SCALE)
        vs = tl.load(V_SCALE)
    slot = tl.load(SLOT + n).to(tl.int64)
    pdl.wait(PDL)
    src = QKV + n.to(tl.int64) * stride_qkv        # q heads, then k heads, then v heads
    h = tl.arange(0, BLOCK_H)
    hmask = h < GROUP
    head = kvh * GROUP + h
    qh = src + head[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(qh, mask=hmask[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(qh + HALF, mask=hmask[:, None], other=0.0).to(tl.float32)
    q1 = (x1 * c1[None, :] - x2 * s1[None, :]).to(dtype)                # [BLOCK_H, HALF]
    q2 = (x2 * c2[None, :] + x1 * s2[None, :]).to(dtype)
    kh = src + (HEADS + kvh) * (2 * HALF)
    y1 = tl.load(kh + d).to(tl.float32)
    y2 = tl.load(kh + HALF + d).to(tl.float32)
    k1_new = (y1 * c1 - y2 * s1).to(dtype)                               # [HALF]
    k2_new = (y2 * c2 + y1 * s2).to(dtype)
    vh = src + (HEADS + KV_HEADS + kvh) * (2 * HALF)
    v1_new = tl.load(vh + d)
    v2_new = tl.load(vh + HALF + d)
    if FP8_KV:   # written as codes; read back, here as from the cache, as codes
        k1_new = kv_code(k1_new, ks)
        k2_new = kv_code(k2_new, ks)
        v1_new = kv_code(v1_new, vs)
        v2_new = kv_code(v2_new, vs)
    if p == 0:   # one writer per (row, KV head), pad rows included (their slot: scratch)
        tl.store(K + slot * stride_kt + kvh * stride_kh + d, k1_new)
        tl.store(K + slot * stride_kt + kvh * stride_kh + HALF + d, k2_new)
        tl.store(V + slot * stride_vt + kvh * stride_vh + d, v1_new)
        tl.store(V + slot * stride_vt + kvh * stride_vh + HALF + d, v2_new)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc1 = tl.zeros([BLOCK_H, HALF], tl.float32)
    acc2 = tl.zeros([BLOCK_H, HALF], tl.float32)
    # An FP8 cache's scales as loaded before the wait: loading them here (score_scale,
    # value_scaled) would load them again, after the cache stores above.
    if FP8_KV:
        scale = scale * ks
    if lo < hi:   # the first tile, loaded before the wait
        m, l, acc1, acc2 = _rope_tile(q1, q2, k1_new, k2_new, v1_new, v2_new, tmask, new, k1,
                                      k2, v1, v2, m, l, acc1, acc2, scale, PRECISION, BY_BITS)
    for start in range(lo + BLOCK_N, hi, BLOCK_N):
        tmask, new, k1, k2, v1, v2 = _cached_tile(
            K, V, table, start, hi, length, kvh, d, stride_kt, stride_kh, stride_vt,
            stride_vh, HALF, BLOCK_N, BLOCK_SIZE)
        m, l, acc1, acc2 = _rope_tile(q1, q2, k1_new, k2_new, v1_new, v2_new, tmask, new, k1,
                                      k2, v1, v2, m, l, acc1, acc2, scale, PRECISION, BY_BITS)
    if FP8_KV:
        acc1 = acc1 * vs
        acc2 = acc2 * vs
    row = (n * (GROUP * KV_HEADS) + head).to(tl.int64) * SPLITS + p   # [n, head, p]
    keep = tl.where(lo < length, hmask, False)   # a span past the row's tokens writes nothing
    tl.store(ACC + row[:, None] * (2 * HALF) + d[None, :], acc1, mask=keep[:, None])
    tl.store(ACC + row[:, None] * (2 * HALF) + HALF + d[None, :], acc2, mask=keep[:, None])
    tl.store(STATS + row * 2, m, mask=keep)
    tl.store(STATS + row * 2 + 1, l, mask=keep)
    if FOLD:
        _merge_group(ACC, STATS, COUNT, OUT, n, kvh, HEADS, head, hmask,
                     tl.arange(0, 2 * HALF), length, per, stride_os, stride_oh, 2 * HALF,
                     SPLITS, BLOCK_P)


@triton.jit
def _rope_tile(q1, q2, k1_new, k2_new, v1_new, v2_new, tmask, new, k1, k2, v1, v2, m, l, acc1,
               acc2, scale, PRECISION: tl.constexpr, BY_BITS: tl.constexpr):
    """One tile of _rope_split's online softmax: the cached halves k1 .. v2 (_cached_tile)
    with the step's own key and value (k1_new ..: from registers) at its position, in q's
    dtype; returns the new m, l and accumulator halves."""
    dtype = q1.dtype
    k1 = _codes_as(tl.where(new[:, None], k1_new[None, :], k1), dtype, BY_BITS)
    k2 = _codes_as(tl.where(new[:, None], k2_new[None, :], k2), dtype, BY_BITS)
    v1 = _codes_as(tl.where(new[:, None], v1_new[None, :], v1), dtype, BY_BITS)
    v2 = _codes_as(tl.where(new[:, None], v2_new[None, :], v2), dtype, BY_BITS)
    s = (tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
         + tl.dot(q2, tl.trans(k2), input_precision=PRECISION)) * scale
    s = tl.where(tmask[None, :], s, float("-inf"))
    m, alpha, prob, l = _softmax_weights(s, m, l)   # m finite: a live key per tile
    prob = prob.to(dtype)
    acc1 = acc1 * alpha[:, None] + tl.dot(prob, v1, input_precision=PRECISION)
    acc2 = acc2 * alpha[:, None] + tl.dot(prob, v2, input_precision=PRECISION)
    return m, l, acc1, acc2


@triton.jit
def _cached_tile(K, V, table, start, hi, length, kvh, d, stride_kt, stride_kh, stride_vt,
                 stride_vh, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr):
    """_rope_split's tile of positions start .. start + BLOCK_N (those < hi live) from the
    cache: (the live mask, the step's own position length - 1, K's and V's two halves
    [BLOCK_N, HALF]; 0 at dead positions and at the step's own, which the cache does not hold
    yet)."""
    t, tmask, slots = _tile_slots(table, start, hi, BLOCK_N, BLOCK_SIZE)
    new = t == length - 1
    old = (tmask & ~new)[:, None]
    kt = K + slots[:, None] * stride_kt + kvh * stride_kh + d[None, :]
    vt = V + slots[:, None] * stride_vt + kvh * stride_vh + d[None, :]
    return (tmask, new, tl.load(kt, mask=old, other=0.0),
            tl.load(kt + HALF, mask=old, other=0.0), tl.load(vt, mask=old, other=0.0),
            tl.load(vt + HALF, mask=old, other=0.0))


@triton.jit
def _merge_group(ACC, STATS, COUNT, OUT, n, kvh, heads, head, hmask, d, length, per,
                 stride_os, stride_oh, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
                 BLOCK_P: tl.constexpr):
    """After program (n, kvh, p) stored its span: if it is the last of row n's SPLITS spans
    of KV head kvh to get here, the group's heads' output from the spans that hold tokens
    (_span_tokens), each rescaled to their common max, divided by the sum; a row without
    keys gets zeros. That program sets the count back to 0."""
    tl.debug_barrier()   # every thread's stores of this span before the count
    count = COUNT + n * tl.num_programs(1) + kvh
    if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
        tl.store(count, 0)
        p = tl.arange(0, BLOCK_P)
        first = (n * heads + head).to(tl.int64) * SPLITS      # [BLOCK_H]: each head's span 0
        live = hmask[:, None] & ((p < SPLITS) & (p * per < length))[None, :]
        spans = first[:, None] + p[None, :]                     # [BLOCK_H, BLOCK_P]
        m = tl.load(STATS + spans * 2, mask=live, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(STATS + spans * 2 + 1, mask=live, other=0.0, cache_modifier=".cg")
        big = tl.max(m, 1)
        total = tl.sum(l * _span_weights(m, big[:, None]), 1)
        o = tl.zeros([head.shape[0], HEAD_DIM], tl.float32)
        for j in range(SPLITS):   # one span's [heads, HEAD_DIM] at a time: few registers
            holds = tl.where(j * per < length, hmask, False)
            mj = tl.load(STATS + (first + j) * 2, mask=holds, other=float("-inf"),
                         cache_modifier=".cg")
            acc = tl.load(ACC + (first + j)[:, None] * HEAD_DIM + d[None, :],
                          mask=holds[:, None], other=0.0, cache_modifier=".cg")
            o += acc * _span_weights(mj, big)[:, None]
        o = o / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(OUT + n * stride_os + head[:, None] * stride_oh + d[None, :],
                 o.to(OUT.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _span_weights(m, big):
    """The merge's weight of spans with maxima m under the largest, big: exp(m - big); 0 for
    a span without keys (m -inf), and for every span of a row without keys (big -inf)."""
    return tl.where(m == float("-inf"), 0.0,
                    tl.exp(m - tl.where(big == float("-inf"), 0.0, big)))


@triton.jit
def _converted_as_loaded(v, PIN_V: tl.constexpr):
    """V's tile, converted from an FP8 cache's codes, pinned where it was converted: a no-op
    Triton may not move (inline PTX with side effects). The P @ V dot sums over tokens, so it
    reads V's tile transposed. Without the pin, Triton stages the FP8 codes in shared memory
    and reads them in the dot's layout one byte per load (no 8-bit ldmatrix.trans on sm_90),
    then converts; with it, the codes convert as loaded (16-byte loads) and the converted
    tile takes the 16-bit path, ldmatrix.trans. The same products either way, but the dot
    may sum them in another order (measured: outputs differ in their last bits). PIN_V: an FP8
    cache on CUDA (Triton's CPU interpreter runs no PTX)."""
    if PIN_V:
        v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=v.dtype,
                                      is_pure=False, pack=2)
    return v


# e4m3 codes to bf16 / fp16 bits, four codes (one register) at a time: each code moves to the
# high byte of a 16-bit lane (prmt), its exponent and mantissa shift right under the sign by the
# difference of the formats' exponent widths (4 for bf16, 1 for fp16), which makes the code's
# value times 2^-(the difference of the exponent biases: 120, 8), exact for every finite code,
# subnormal ones included; one multiply by that power of two (exact) restores the value.
_E4M3_AS_16 = """{
.reg .b32 a, b, t, f;
prmt.b32 a, 0, $2, 0x5040;
prmt.b32 b, 0, $2, 0x7060;
and.b32 t, a, 0x7f007f00;
shr.b32 t, t, SHIFT;
lop3.b32 a, t, 0x80008000, a, 0xf8;
and.b32 t, b, 0x7f007f00;
shr.b32 t, t, SHIFT;
lop3.b32 b, t, 0x80008000, b, 0xf8;
mov.b32 f, FACTOR;
mul.rn.TYPE $0, a, f;
mul.rn.TYPE $1, b, f;
}"""
_E4M3_AS_BF16 = tl.constexpr(_E4M3_AS_16.replace("SHIFT", "4").replace("FACTOR", "0x7b807b80")
                             .replace("TYPE", "bf16x2"))   # 2^120 twice
_E4M3_AS_F16 = tl.constexpr(_E4M3_AS_16.replace("SHIFT", "1").replace("FACTOR", "0x5c005c00")
                            .replace("TYPE", "f16x2"))     # 2^8 twice


@triton.jit
def _codes_as(x, dtype: tl.constexpr, BY_BITS: tl.constexpr):
    """An FP8 cache's codes x (e4m3) in the dots' dtype, exactly (a 16-bit cache's x as it is).
    BY_BITS (CUDA, dtype bf16 or fp16): with byte permutes, masks, shifts and one multiply
    (_E4M3_AS_16), in place of Triton's conversion (e4m3 pairs to fp16, then, for bf16, each
    element on its own); the same values, but a NaN code (the write stores one only for a NaN
    key or value) reads as +-480."""
    if BY_BITS:
        codes = x.to(tl.uint8, bitcast=True)
        if dtype == tl.bfloat16:
            x = tl.inline_asm_elementwise(_E4M3_AS_BF16, "=r,=r,r", [codes], dtype=tl.bfloat16,
                                          is_pure=True, pack=4)
        else:
            x = tl.inline_asm_elementwise(_E4M3_AS_F16, "=r,=r,r", [codes], dtype=tl.float16,
                                          is_pure=True, pack=4)
    return x.to(dtype)


@triton.jit
def score_scale(scale, K_SCALE, FP8_KV: tl.constexpr):
    """The scores' factor: 1 / sqrt(head_dim), times K's scale over an FP8 cache (whose codes
    the dots take as they are: vt.torch.kv_fp8's read)."""
    if FP8_KV:
        return scale * tl.load(K_SCALE)
    return scale


@triton.jit
def value_scaled(acc, V_SCALE, FP8_KV: tl.constexpr):
    """The attention accumulator (float32) times V's scale over an FP8 cache (its dots took
    V's codes as they are)."""
    if FP8_KV:
        return acc * tl.load(V_SCALE)
    return acc


@triton.jit
def _span_tokens(length, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens per span of a row of `length` live tokens: whole BLOCK_N tiles, as few as
    SPLITS spans need. Span p holds positions p * per ..; the spans from cdiv(length, per) on
    hold none (all of them when length is 0)."""
    return tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _tile_slots(table, start, hi, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Positions t = start .. start + BLOCK_N of one sequence (those < hi live) and their
    cache slots, found through its block table (vt.step.kv_slot; dead ones: slot of block 0):
    (t, the live mask, slots)."""
    t = start + tl.arange(0, BLOCK_N)
    tmask = t < hi
    block = tl.load(table + t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
    return t, tmask, block * BLOCK_SIZE + t % BLOCK_SIZE


@triton.jit
def kv_tile(K, V, table, start, hi, kvh, d, stride_kt, stride_kh, stride_vt, stride_vh,
             BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Positions t = start .. start + BLOCK_N of one sequence (those < hi live), found through
    its block table (vt.step.kv_slot), and their K and V rows of KV head kvh: (t, the live
    mask, k, v [BLOCK_N, HEAD_DIM], dead rows 0)."""
    t, tmask, slot = _tile_slots(table, start, hi, BLOCK_N, BLOCK_SIZE)
    k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                mask=tmask[:, None], other=0.0)
    v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                mask=tmask[:, None], other=0.0)
    return t, tmask, k, v


@triton.jit
def softmax_step(s, v, m, l, acc, PRECISION: tl.constexpr):
    """One tile of the online softmax: scores s [rows, BLOCK_N] (masked ones -inf) and values
    v folded into the running max m, sum l and accumulator acc (float32). Each row's m must
    end finite (a live key in this tile or an earlier one)."""
    m, alpha, prob, l = _softmax_weights(s, m, l)
    acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=PRECISION)
    return m, l, acc


@triton.jit
def _softmax_weights(s, m, l):
    """The online softmax's update for one tile of scores s [rows, BLOCK_N]: (the new running
    max, the factor the old accumulator is rescaled by, the tile's unnormalized probabilities,
    the new running sum)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    prob = tl.exp(s - m_new[:, None])
    return m_new, alpha, prob, l * alpha + tl.sum(prob, 1)


@triton.jit
def _merge(ACC, STATS, LENS, OUT, stride_os, stride_oh, HEAD_DIM: tl.constexpr,
           SPLITS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
           PDL: tl.constexpr):
    pdl.launch_next(PDL)
    pdl.wait(PDL)
    n = tl.program_id(0)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, HEAD_DIM)
    length = tl.load(LENS + n)
    # Only the spans that hold tokens were written (_span_tokens).
    pmask = (p < SPLITS) & (p * _span_tokens(length, SPLITS, BLOCK_N) < length)
    row = (n * heads + h).to(tl.int64) * SPLITS + p
    m = tl.load(STATS + row * 2, mask=pmask, other=float("-inf"))
    l = tl.load(STATS + row * 2 + 1, mask=pmask, other=0.0)
    w = _span_weights(m, tl.max(m, 0))
    acc = tl.load(ACC + row[:, None] * HEAD_DIM + d[None, :], mask=pmask[:, None], other=0.0)
    total = tl.sum(l * w, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + n * stride_os + h * stride_oh + d, o.to(OUT.dtype.element_ty))
