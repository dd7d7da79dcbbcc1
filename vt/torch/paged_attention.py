"""Paged attention over each sequence's live KV tokens only (grouped-query), for vt.torch
models: paged_decode_attention (one query token per row: a decode step, captured),
rope_cache_decode_attention (the same from the step's fused q/k/v projection, its RoPE and KV
write in the same kernel) and paged_varlen_attention (any number of new tokens per sequence:
an eager step's prompt chunks and decode rows, in one call).

    out[n, h] = softmax(q[n, h] . K[n]^T / sqrt(head_dim)) V[n]

where K[n], V[n] are the cache rows of row n's first seq_lens[n] positions, found through its
block table: position t lives in cache slot block_tables[n, t // block_size] * block_size +
t % block_size (vt.step.kv_slot). The cost follows the tokens that exist, not max_context.

On CUDA the work runs as two Triton kernels (vt.torch.triton_attention): split-K over the
context (each (row, KV head) is cut into `splits` spans so that one row still fills the GPU),
then a merge of the spans. Every shape is fixed by the call's tensor shapes and `splits`, the
split bounds are read from seq_lens on the device, so the call has no host sync and captures
in a CUDA graph as it is. paged_varlen_attention is one Triton kernel (no split: its query
tiles fill the GPU); its grid depends on the step's longest query, which the caller knows on
the host. With invariant=True (vt.torch.llama's batch_invariant mode) the CUDA path runs
vt.torch.triton_invariant's kernels instead: spans of a fixed length, not a count picked from
the rows, folded in one order that the decode and the varlen kernels share, so a token's
output bits are the same alone, among any other rows, as a decode row of a decode or a mixed
step, and inside any prompt chunk. On the CPU the same functions are vt.torch.cpu_ops's
custom ops, plain torch over each row's live tokens (a sim capture records each as one op,
which reads seq_lens when it is replayed), so CI tests the same semantics; with invariant=True
they compute every prompt token as they compute a decode row. Triton is imported only when a
CUDA tensor arrives: the module imports without it.

Each function also reads an FP8 cache (float8_e4m3fn codes with a float32 k_scale and v_scale
of one element each, vt.torch.kv_fp8): every key and value it loads is code * scale rounded to
q's dtype, on the CPU and in the Triton kernels alike; not with invariant=True.
"""
from __future__ import annotations

import math

import torch

from vt.step import context_slots
from vt.torch import cpu_ops, fused, kv_fp8

# The GPU's resident programs per SM that the split count aims to fill (one wave).
PROGRAMS_PER_SM = 4
MAX_SPLITS = 64
# Below this many tokens per split the merge costs more than the parallelism gains.
MIN_SPLIT_TOKENS = 64


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, *,
                           block_size: int, splits: int | None = None,
                           invariant: bool = False, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           span_counters: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each row's query over its live cache tokens.

    q [S, heads, head_dim]; k_cache, v_cache [num_blocks * block_size, kv_heads, head_dim]
    (one layer's cache, llama.py's layout); block_tables [S, max_blocks] int32; seq_lens [S]
    int32. Returns [S, heads, head_dim] in q's dtype. A row with seq_lens 0 gets zeros.
    splits: context spans per (row, KV head) on CUDA; None picks decode_splits() from the
    shapes (fixed per S, so a captured graph keeps it). invariant: a row's output bits depend
    on that row alone, and equal paged_varlen_attention(..., invariant=True)'s for the same
    token (on CUDA: vt.torch.triton_invariant's fixed spans, so `splits` must be None).
    k_scale, v_scale: an FP8 cache's (float8_e4m3fn; float32 tensors of one element), read as
    vt.torch.kv_fp8 says (the codes as they are, K's scale on the scores, V's on the output);
    None for a cache in q's dtype. span_counters: the CUDA kernel's per-(row, KV head) counts,
    int32 zeros that it leaves zero (a caller's persistent buffer spares each call a memset;
    None: a fresh one). One of fewer than S * kv_heads counts has the step merge its spans in
    a second kernel (vt.torch.triton_attention.merges_in_split).
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, block_size, k_scale=k_scale,
           v_scale=v_scale, invariant=invariant)
    _no_splits_if_invariant(splits, invariant, "paged_decode_attention")
    if not q.is_cuda:
        return cpu_ops.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, block_size,
                                    k_scale, v_scale)
    if invariant:
        return _invariant_module().paged_decode(q, k_cache, v_cache, block_tables, seq_lens,
                                                block_size=block_size)
    triton_attention = _triton_module()
    splits = _cuda_splits(splits, k_cache.shape[1], block_tables, block_size, q.device,
                          "paged_decode_attention")
    return triton_attention.paged_decode(q, k_cache, v_cache, block_tables, seq_lens,
                                         block_size=block_size, splits=splits,
                                         k_scale=k_scale, v_scale=v_scale,
                                         span_counters=span_counters)


def rope_cache_decode_attention(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                                seq_lens: torch.Tensor, *, heads: int, kv_heads: int,
                                head_dim: int, block_size: int, splits: int | None = None,
                                invariant: bool = False, k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None,
                                span_counters: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention from its fused q/k/v projection:
    vt.torch.fused.rope_and_cache (RoPE of q and k, the new key and value written to
    slot_mapping's slots) then paged_decode_attention, as one kernel on CUDA, where the two
    are two kernels.

    qkv [S, (heads + 2 * kv_heads) * head_dim]; positions [S] int; cos, sin [max_context,
    head_dim] float32; the caches, block_tables and seq_lens as paged_decode_attention's;
    slot_mapping [S] int: each row's new slot, that of position seq_lens - 1. Returns
    [S, heads, head_dim] in qkv's dtype, the cache updated as rope_and_cache updates it.
    invariant: paged_decode_attention(..., invariant=True) after rope_and_cache (two kernels
    and the fold on CUDA: the one kernel's two half-width dots sum the scores in another
    order than the varlen path does). k_scale, v_scale: an FP8 cache's (the new key and
    value written as rope_and_cache writes them, every key and value read as
    paged_decode_attention reads them, the new ones included). span_counters: as
    paged_decode_attention's.
    """
    fused.check_rope(qkv, k_cache, v_cache, positions, slot_mapping, heads, kv_heads, head_dim)
    q_shape = qkv[:, :heads * head_dim].unflatten(1, (heads, head_dim))   # a view, to check
    _check(q_shape, k_cache, v_cache, block_tables, seq_lens, block_size,
           "rope_cache_decode_attention", k_scale=k_scale, v_scale=v_scale,
           invariant=invariant)
    _no_splits_if_invariant(splits, invariant, "rope_cache_decode_attention")
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if not qkv.is_cuda:
        q = fused.rope_and_cache(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping,
                                 heads=heads, kv_heads=kv_heads, head_dim=head_dim, **scales)
        return cpu_ops.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, block_size,
                                    k_scale, v_scale)
    if invariant:
        q = fused.rope_and_cache(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping,
                                 heads=heads, kv_heads=kv_heads, head_dim=head_dim)
        return _invariant_module().paged_decode(q, k_cache, v_cache, block_tables, seq_lens,
                                                block_size=block_size)
    splits = _cuda_splits(splits, kv_heads, block_tables, block_size, qkv.device,
                          "rope_cache_decode_attention")
    return _triton_module().rope_paged_decode(
        qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
        splits=splits, span_counters=span_counters, **scales)


def paged_varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, *, block_size: int,
                           max_query_len: int, invariant: bool = False,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a flattened step's tokens over their sequences' cached contexts.

    q [T, heads, head_dim]: sequence i's new tokens are rows query_start_loc[i] ..
    query_start_loc[i + 1] - 1 (query_start_loc [B + 1] int32, non-decreasing); seq_lens [B]
    int32: its context after the step, these tokens included and already written to the
    cache; block_tables [B, max_blocks] int32. New token j of n in a context of L sits at
    position L - n + j and attends to positions 0 .. L - n + j (the diagonal at the bottom
    right). max_query_len: the largest n (the host knows it: vt.torch.TorchInputs's
    query_start_loc_cpu); it sizes the CUDA kernel's grid, which reads query_start_loc on the
    device only, so a value below the largest n leaves the rest of that sequence's rows
    unwritten there, as FlashAttention's max_seqlen_q does. The CPU path reads the lengths
    and refuses such a value, so a caller's tests on the CPU catch it. Returns
    [T, heads, head_dim] in q's dtype. invariant: a token's output bits depend on that token
    alone (not on the other tokens, its chunk's bounds or the step's sequences), and equal
    paged_decode_attention(..., invariant=True)'s for a decode row (on CUDA:
    vt.torch.triton_invariant). k_scale, v_scale: an FP8 cache's, as paged_decode_attention's.
    """
    _check_varlen(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, block_size,
                  k_scale, v_scale, invariant)
    if not q.is_cuda:
        longest = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if len(seq_lens) else 0
        if max_query_len < longest:
            raise ValueError(f"paged_varlen_attention: max_query_len={max_query_len} is below "
                             f"the step's longest query, {longest} tokens")
        return cpu_ops.paged_varlen(q, k_cache, v_cache, query_start_loc, seq_lens,
                                    block_tables, block_size, invariant, k_scale, v_scale)
    if invariant:
        return _invariant_module().paged_varlen(q, k_cache, v_cache, query_start_loc, seq_lens,
                                                block_tables, block_size=block_size,
                                                max_query_len=max_query_len)
    return _triton_module().paged_varlen(q, k_cache, v_cache, query_start_loc, seq_lens,
                                         block_tables, block_size=block_size,
                                         max_query_len=max_query_len, k_scale=k_scale,
                                         v_scale=v_scale)


def decode_splits(rows: int, kv_heads: int, max_context: int, sm_count: int) -> int:
    """Context spans per (row, KV head): enough programs for one wave of PROGRAMS_PER_SM per
    SM, no more spans than max_context has MIN_SPLIT_TOKENS-token pieces, at most MAX_SPLITS."""
    want = math.ceil(PROGRAMS_PER_SM * sm_count / max(1, rows * kv_heads))
    return max(1, min(MAX_SPLITS, want, max_context // MIN_SPLIT_TOKENS))


def _cuda_splits(splits: int | None, kv_heads: int, block_tables: torch.Tensor,
                 block_size: int, device, name: str) -> int:
    """The decode kernels' split count: `splits` checked, or decode_splits() of the shapes
    (rows, KV heads, max_context) and the device's SMs when None."""
    if splits is None:
        splits = decode_splits(block_tables.shape[0], kv_heads,
                               block_tables.shape[1] * block_size, _sm_count(device))
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"{name}: splits={splits} must be in 1..{MAX_SPLITS}")
    return splits


def dense_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, *,
                           block_size: int) -> torch.Tensor:
    """The dense reference: every row gathers all max_blocks * block_size slots of its table
    and masks those at or beyond seq_lens (what a fixed-shape step does without a paged kernel).
    Rows with seq_lens 0 get zeros."""
    S, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    t = torch.arange(block_tables.shape[1] * block_size, device=q.device)
    slots = context_slots(block_tables.long(), t, block_size)   # [S, T]
    keys = k_cache[slots].float().transpose(1, 2)       # [S, kv_heads, T, hd]
    vals = v_cache[slots].float().transpose(1, 2)
    qg = q.float().view(S, kv_heads, heads // kv_heads, head_dim)
    scores = qg @ keys.transpose(-1, -2) / math.sqrt(head_dim)    # [S, kv_heads, group, T]
    live = t < seq_lens.unsqueeze(1)
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1))        # all-masked rows: zeros, not NaN
    return (probs @ vals).reshape(S, heads, head_dim).to(q.dtype)


def live_slots(table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The cache slots of positions 0..length-1 of one row's block table."""
    t = torch.arange(length, device=table_row.device)
    return table_row.long()[t // block_size] * block_size + t % block_size


def _check(q, k_cache, v_cache, block_tables, seq_lens, block_size,
           name: str = "paged_decode_attention", sequences: int | None = None, *,
           k_scale=None, v_scale=None, invariant: bool = False):
    """sequences: the rows of block_tables and seq_lens (None: one per query, q's S)."""
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: q [S, heads, head_dim] and caches [slots, "
                         f"kv_heads, head_dim] expected, got q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    S, heads, head_dim = q.shape
    S = S if sequences is None else sequences
    slots, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or heads % kv_heads:
        raise ValueError(f"{name}: q has {heads} heads of {head_dim}, the cache "
                         f"{kv_heads} KV heads of {cache_dim}: heads must be a multiple of "
                         f"kv_heads and head_dim equal")
    if block_size < 1 or slots % block_size:
        raise ValueError(f"{name}: block_size={block_size} must divide the "
                         f"cache's {slots} slots")
    if block_tables.dim() != 2 or block_tables.shape[0] != S or tuple(seq_lens.shape) != (S,):
        raise ValueError(f"{name}: block_tables [S={S}, max_blocks] and seq_lens "
                         f"[S] expected, got {tuple(block_tables.shape)} and "
                         f"{tuple(seq_lens.shape)}")
    fp8_cache = kv_fp8.is_fp8(k_cache) and kv_fp8.is_fp8(v_cache)
    if not fp8_cache and (q.dtype != k_cache.dtype or q.dtype != v_cache.dtype):
        raise ValueError(f"{name}: q, k_cache, v_cache must share a dtype (or the caches be "
                         f"float8_e4m3fn, both), got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    kv_fp8.check_scales(name, k_cache, k_scale, v_scale)
    if fp8_cache and invariant:
        raise ValueError(f"{name}: an FP8 cache with invariant=True is not implemented (the "
                         f"batch-invariant kernels read a cache in q's dtype)")


def _check_varlen(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, block_size,
                  k_scale=None, v_scale=None, invariant: bool = False):
    B = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if tuple(query_start_loc.shape) != (B + 1,):
        raise ValueError(f"paged_varlen_attention: query_start_loc [B + 1] and seq_lens [B] "
                         f"expected, got {tuple(query_start_loc.shape)} and "
                         f"{tuple(seq_lens.shape)}")
    _check(q, k_cache, v_cache, block_tables, seq_lens, block_size, "paged_varlen_attention",
           sequences=B, k_scale=k_scale, v_scale=v_scale, invariant=invariant)


def _no_splits_if_invariant(splits, invariant: bool, name: str) -> None:
    if invariant and splits is not None:
        raise ValueError(f"{name}: splits={splits} with invariant=True: the batch-invariant "
                         f"kernels cut the context into fixed spans; pass splits=None")


def _invariant_module():
    _triton_module()   # the same error where Triton is missing
    from vt.torch import triton_invariant
    return triton_invariant


def _triton_module():
    try:
        from vt.torch import triton_attention
    except ImportError as e:
        raise RuntimeError(f"vt.torch.paged_attention on CUDA needs Triton (it ships with CUDA "
                           f"builds of PyTorch): {e}") from e
    return triton_attention


def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
