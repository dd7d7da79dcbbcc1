"""Attention over vt's paged KV cache for a flattened step (vt.torch.TorchInputs): the per-step
context every layer shares, and the kernels it picks between. The place a paged or flash
attention kernel plugs in: replace `decode_attention` (one query per sequence, captured) or
`prefill_attention` (a prompt chunk, eager).

With `fused` set (a step on vt's kernels: LlamaDecoder's `kernels` for a decode step,
`prompt_kernels` for a step with prompt tokens), a decode step goes through
vt.torch.paged_attention.paged_decode_attention instead, which reads each row's live tokens
only (on CUDA: Triton, capturable), and the layers use vt.torch.fused's RoPE-and-cache: this
step's K and V are then read back from the cache; a step with prompt tokens is one
paged_varlen_attention call per layer, its decode rows and prompt chunks together, in place
of a call per chunk.

A step's tokens are decode rows (one token per sequence, leading the batch) and prompt chunks:
- a decode step (inputs.is_decode: captured, shapes fixed by B) is all decode rows; each row
  attends over the first max_context slots of its block table, those at or past its seq_len
  masked. A decode row of an eager (mixed) step reads only as many slots as its longest row;
- a prompt chunk of n new tokens in a context of L (its cached prefix, then the chunk) attends
  causally, bottom-right aligned: new token j sees positions 0 .. L - n + j. A chunk that is
  its whole context (the prompt's first) uses this step's K and V as they are; a later chunk
  gathers its context from the cache, which this step's write has already filled.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vt.step import context_slots
from vt.torch.paged_attention import paged_decode_attention, paged_varlen_attention


@dataclass(frozen=True)
class Chunk:
    """One sequence's prompt chunk: tokens [start, stop) of the step, in a context of
    `context` positions; `slots` [context] its context's cache slots, or None when the chunk
    is its whole context."""
    start: int
    stop: int
    context: int
    slots: torch.Tensor | None


@dataclass
class AttentionContext:
    """What attention needs of one step, built once (build_context) and passed to every layer."""
    slot_mapping: torch.Tensor        # [T] long: where each token's K and V are written
    cos: torch.Tensor                 # [T, 1, head_dim] f32
    sin: torch.Tensor
    decode_rows: int                  # the step's first decode_rows tokens are decode rows
    decode_slots: torch.Tensor | None   # [R, C] long: the cache slot of each row's first C positions
    decode_mask: torch.Tensor | None    # [R, 1, 1, C] bool: the positions each row sees
    chunks: tuple[Chunk, ...] = ()
    fused: "FusedStep | None" = None   # set: the step runs on vt's kernels


@dataclass(frozen=True)
class FusedStep:
    """What vt's kernels read of a step (int32 views of its fields): the paged attention, the
    sequences' block tables and seq_lens (and, in a step with prompt tokens, query_start_loc
    and the longest query, for paged_varlen_attention); the fused RoPE kernel
    (vt.torch.fused.rope_and_cache), every token's position and the whole cos, sin tables;
    and whether the step runs the batch-invariant forms of the kernels."""
    block_tables: torch.Tensor   # [B, max_blocks]
    seq_lens: torch.Tensor       # [B]
    positions: torch.Tensor      # [T]
    cos_table: torch.Tensor      # [max_context, head_dim] f32
    sin_table: torch.Tensor
    block_size: int
    query_start_loc: torch.Tensor | None = None   # [B + 1]; None: a decode step
    max_query_len: int = 1
    invariant: bool = False   # batch_invariant: every token's bits depend on it alone
    # [>= B * kv_heads] int32 zeros the decode kernels count spans in (and leave zero); None:
    # each call takes a fresh one (vt.torch.paged_attention.paged_decode_attention)
    span_counters: torch.Tensor | None = None


def build_context(inputs, cos_table, sin_table, block_size: int, context: torch.Tensor,
                  fused: bool = False, invariant: bool = False,
                  span_counters: torch.Tensor | None = None) -> AttentionContext:
    """The step's AttentionContext; `context`: arange(max_blocks * block_size) on the device.
    fused: the step runs on vt's kernels (paged attention: no dense slots, mask or chunks);
    invariant: their batch-invariant forms (LlamaDecoder's batch_invariant); span_counters:
    FusedStep's, for a decode step on them."""
    pos = inputs.positions.long()
    cos, sin = cos_table[pos].unsqueeze(1), sin_table[pos].unsqueeze(1)
    if inputs.is_decode and fused:
        step = FusedStep(inputs.block_tables, inputs.seq_lens, inputs.positions, cos_table,
                         sin_table, block_size, invariant=invariant,
                         span_counters=span_counters)
        return AttentionContext(inputs.slot_mapping.long(), cos, sin, inputs.batch, None, None,
                                fused=step)
    tables = inputs.block_tables.long()

    def row_slots(rows: slice, t):
        slots = context_slots(tables[rows], t, block_size)
        mask = (t < inputs.seq_lens[rows].unsqueeze(1))[:, None, None, :]
        return slots, mask
    if inputs.is_decode:
        slots, mask = row_slots(slice(None), context)
        return AttentionContext(inputs.slot_mapping.long(), cos, sin, inputs.batch, slots, mask)
    qsl, lens = inputs.query_start_loc_cpu, inputs.seq_lens_cpu
    if fused:   # one paged_varlen_attention call: no per-chunk work here
        longest = max(qsl[i + 1] - qsl[i] for i in range(len(lens)))
        step = FusedStep(inputs.block_tables, inputs.seq_lens, inputs.positions, cos_table,
                         sin_table, block_size, inputs.query_start_loc, longest, invariant)
        return AttentionContext(inputs.slot_mapping.long(), cos, sin, 0, None, None, fused=step)
    rows = 0
    while rows < len(lens) and qsl[rows + 1] - qsl[rows] == 1:
        rows += 1
    slots = mask = None
    if rows:
        longest = -(-max(lens[:rows]) // block_size) * block_size
        slots, mask = row_slots(slice(0, rows), context[:longest])
    chunks = []
    for i in range(rows, len(lens)):
        n, L = qsl[i + 1] - qsl[i], lens[i]
        t = context[:L]
        chunks.append(Chunk(qsl[i], qsl[i + 1], L, None if n == L else
                            context_slots(tables[i:i + 1], t, block_size)[0]))
    return AttentionContext(inputs.slot_mapping.long(), cos, sin, rows, slots, mask, tuple(chunks))


def attend(q, k, v, k_cache, v_cache, ctx: AttentionContext, k_scale=None,
           v_scale=None) -> torch.Tensor:
    """[T, heads, head_dim]: every token's attention, this step's K and V already written to
    the cache (k, v [T, kv_heads, head_dim] are those same values; None on vt's kernels,
    which read them from the cache). k_scale, v_scale: an FP8 cache's (vt's kernels only)."""
    f = ctx.fused
    if f is not None and f.query_start_loc is not None:   # vt's kernels, prompt tokens too
        return paged_varlen_attention(q, k_cache, v_cache, f.query_start_loc, f.seq_lens,
                                      f.block_tables, block_size=f.block_size,
                                      max_query_len=f.max_query_len, invariant=f.invariant,
                                      k_scale=k_scale, v_scale=v_scale)
    if not ctx.chunks:
        return _decode_rows(q, k_cache, v_cache, ctx, k_scale, v_scale)
    out = torch.empty_like(q)
    R = ctx.decode_rows
    if R:
        out[:R] = _decode_rows(q[:R], k_cache, v_cache, ctx, k_scale, v_scale)
    for c in ctx.chunks:
        if c.slots is not None:
            keys, vals = k_cache[c.slots], v_cache[c.slots]
        else:
            keys, vals = k[c.start:c.stop], v[c.start:c.stop]
        out[c.start:c.stop] = prefill_attention(q[c.start:c.stop], keys, vals)
    return out


def _decode_rows(q, k_cache, v_cache, ctx: AttentionContext, k_scale=None,
                 v_scale=None) -> torch.Tensor:
    """The step's decode rows (q [R, heads, hd]): paged on vt's kernels (a decode step), else
    dense."""
    f = ctx.fused
    if f is not None:
        return paged_decode_attention(q, k_cache, v_cache, f.block_tables, f.seq_lens,
                                      block_size=f.block_size, invariant=f.invariant,
                                      k_scale=k_scale, v_scale=v_scale,
                                      span_counters=f.span_counters)
    return decode_attention(q, k_cache, v_cache, ctx.decode_slots, ctx.decode_mask)


def decode_attention(q, k_cache, v_cache, slots, mask) -> torch.Tensor:
    """One query per row over its gathered context: q [R, heads, hd], slots [R, C], mask
    [R, 1, 1, C] -> [R, heads, hd]. Grouped-query attention without copying K and V per head:
    head h uses KV head h // group, so a group's heads are that KV head's `group` queries."""
    R, heads, hd = q.shape
    kv_heads = k_cache.shape[1]
    keys = k_cache[slots].transpose(1, 2)     # [R, kv_heads, C, hd]
    vals = v_cache[slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.view(R, kv_heads, heads // kv_heads, hd), keys, vals,
                                         attn_mask=mask)   # [R, kv_heads, group, hd]
    return out.reshape(R, heads, hd)


def prefill_attention(q, keys, vals) -> torch.Tensor:
    """A chunk's n queries over its context of L: q [n, heads, hd], keys and values
    [L, kv_heads, hd] -> [n, heads, hd], causal with the diagonal at the bottom right. On
    tensor cores through torch's SDPA (flash for the whole-context case, is_causal); K and V
    expanded per head (head h: KV head h // group) so that every SDPA backend accepts them."""
    n, heads, _ = q.shape
    L, kv_heads, _ = keys.shape
    group = heads // kv_heads
    qh = q.transpose(0, 1).unsqueeze(0)                                   # [1, heads, n, hd]
    kh = keys.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)   # [1, heads, L, hd]
    vh = vals.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
    if n == L:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    else:
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return out[0].transpose(0, 1)
