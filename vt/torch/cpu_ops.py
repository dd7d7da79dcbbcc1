"""vt.torch's CPU kernels: paged attention as torch custom ops, and the row-invariant ops of
LlamaDecoder's batch_invariant mode.

Paged attention reads each row's seq_lens to know how many cache tokens it attends over. On
CUDA a kernel reads them on the device; on the CPU plain torch has to read them on the host,
which a sim capture (vt/torch/simcapture.py: it records the aten ops a forward dispatches over
fake tensors, then replays them) refuses, as CUDA refuses a host read under capture. Each
attention is therefore one custom op of the library "vt" (torch.library): the capture records
it as one op, its fake implementation gives the output's shape, and its CPU implementation
runs at every replay, reading seq_lens then, as the CUDA kernel does. So a captured decode
step on the sim attends over its live tokens, as on CUDA, and costs what they cost. (Defined
with torch.library.Library rather than torch.library.custom_op, whose wrapper imported
torch._dynamo at the first call, about a second, and cost 12 against 4 us a call.)

    vt::paged_decode_attention   one query token per row (a decode step)
    vt::paged_varlen_attention   a flattened step's prompt chunks and decode rows

Both take an FP8 cache (float8_e4m3fn, with its k_scale and v_scale; vt.torch.kv_fp8) and read
it as the Triton kernels do: the codes as they are (widened exactly), K's scale on the scores,
V's on the output, in float32. Both compute a query token with attend_token: its heads against
exactly its visible keys, the first `position + 1` of its sequence, in float32. A decode row is
one call of it; a prompt chunk is one batched product per sequence by default (fast), and with
invariant=True one call per token, so a token's bits are those of the same token as a decode
row, alone or in any batch, whatever chunk it sits in (chunk bounds follow the other requests).

Batch invariance (LlamaDecoder(batch_invariant=True) on the CPU): F.linear of one row runs a
matrix-vector product and of several rows a matrix product, which sum in different orders
(their bits differ in every row), so linear_rows computes each row as its own one-row product.
rms_norm_rows and silu_mul_rows are per row too: torch's element-wise and reduction kernels
cut a tensor into pieces by its size (threads, vector tails), and a row's bits must not
depend on where such a cut falls. Timed on one CPU thread over the 121 projections of
tools/sim_decode_vs_transformers.py's 135M shape, one product per row costs what F.linear
costs at one row (53 against 50 ms) and 1.6x F.linear at 8 rows (259 against 158 ms); fixed
blocks of 8 rows, which gave the same bits on this BLAS, cost 146 ms at one row (2.8x).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vt.torch import kv_fp8


def attend_token(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                 k_scale=None, v_scale=None) -> torch.Tensor:
    """One query token over its visible keys, in float32: q [kv_heads, group, head_dim],
    keys and vals [L, kv_heads, head_dim] -> [kv_heads, group, head_dim] (head h of the token
    is [h // group, h % group]: grouped-query attention without copying K and V per head).
    k_scale, v_scale: an FP8 cache's, whose codes keys and vals are (kv_fp8's read)."""
    scores = torch.matmul(q, keys.permute(1, 2, 0)) / math.sqrt(q.shape[-1])   # [kvh, g, L]
    return value_scaled(torch.matmul(key_scaled(scores, k_scale).softmax(-1),
                                     vals.transpose(0, 1)), v_scale)


def key_scaled(scores: torch.Tensor, k_scale) -> torch.Tensor:
    """Scores over an FP8 cache's key codes times K's scale (None: a cache in the dtype)."""
    return scores if k_scale is None else scores * k_scale.float()


def value_scaled(out: torch.Tensor, v_scale) -> torch.Tensor:
    """Attention over an FP8 cache's value codes times V's scale (None: a cache in the dtype)."""
    return out if v_scale is None else out * v_scale.float()


def context(cache: torch.Tensor, table_row: torch.Tensor, length: int,
            block_size: int) -> torch.Tensor:
    """[length, kv_heads, head_dim] float32: the cache rows of positions 0..length-1 through one
    block table row (its first ceil(length / block_size) blocks gathered whole, then cut); an
    FP8 cache's codes widen exactly."""
    blocks = -(-length // block_size)
    paged = cache.view(-1, block_size, *cache.shape[1:])
    return paged[table_row[:blocks].long()].flatten(0, 1)[:length].float()


_LIBRARY = torch.library.Library("vt", "DEF")
_LIBRARY.define("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, "
                "Tensor block_tables, Tensor seq_lens, int block_size, Tensor? k_scale, "
                "Tensor? v_scale) -> Tensor")
_LIBRARY.define("paged_varlen_attention(Tensor q, Tensor k_cache, Tensor v_cache, "
                "Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, int block_size, "
                "bool invariant, Tensor? k_scale, Tensor? v_scale) -> Tensor")


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 block_size: int, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """vt.torch.paged_attention.paged_decode_attention on the CPU: each row's query over its
    first seq_lens cache tokens (zeros where seq_lens is 0); one attend_token per row. One
    op, vt::paged_decode_attention. k_scale, v_scale: an FP8 cache's (context)."""
    return torch.ops.vt.paged_decode_attention.default(q, k_cache, v_cache, block_tables,
                                                       seq_lens, block_size, k_scale, v_scale)


def paged_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 block_tables: torch.Tensor, block_size: int, invariant: bool,
                 k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """vt.torch.paged_attention.paged_varlen_attention on the CPU: sequence i's new tokens
    (rows query_start_loc[i]..query_start_loc[i + 1] - 1, the last n of its seq_lens[i]
    positions) attend causally, bottom-right aligned, over its cached context. One
    attend_token per token where invariant (or n is 1), else one product per sequence. One
    op, vt::paged_varlen_attention."""
    return torch.ops.vt.paged_varlen_attention.default(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, block_size, invariant,
        k_scale, v_scale)


def _paged_decode(q, k_cache, v_cache, block_tables, seq_lens, block_size, k_scale, v_scale):
    S, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    out = torch.zeros_like(q)
    for n, length in enumerate(seq_lens.tolist()):
        if length <= 0:
            continue
        keys = context(k_cache, block_tables[n], length, block_size)
        vals = context(v_cache, block_tables[n], length, block_size)
        qn = q[n].float().reshape(kv_heads, heads // kv_heads, head_dim)
        out[n] = attend_token(qn, keys, vals, k_scale, v_scale).view(heads, head_dim)
    return out


def _paged_varlen(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, block_size,
                  invariant, k_scale, v_scale):
    T, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for i, length in enumerate(seq_lens.tolist()):
        a, b = starts[i], starts[i + 1]
        n = b - a
        if n == 0:
            continue
        keys = context(k_cache, block_tables[i], length, block_size)
        vals = context(v_cache, block_tables[i], length, block_size)
        qs = q[a:b].float().reshape(n, kv_heads, group, head_dim)
        if invariant or n == 1:
            for j in range(n):
                seen = length - n + j + 1
                out[a + j] = attend_token(qs[j], keys[:seen], vals[:seen], k_scale,
                                          v_scale).view(heads, head_dim)
            continue
        # [kv_heads, n * group, head_dim]: the chunk's queries of each KV head, token-major
        qk = qs.permute(1, 0, 2, 3).reshape(kv_heads, n * group, head_dim)
        scores = key_scaled(torch.matmul(qk, keys.permute(1, 2, 0)) / math.sqrt(head_dim),
                            k_scale)
        seen = torch.ones(n, length, dtype=torch.bool).tril(length - n)
        scores = scores.masked_fill(~seen.repeat_interleave(group, dim=0), float("-inf"))
        chunk = value_scaled(torch.matmul(scores.softmax(-1), vals.transpose(0, 1)), v_scale)
        out[a:b] = chunk.view(kv_heads, n, group, head_dim).permute(1, 0, 2, 3).reshape(
            n, heads, head_dim)
    return out


def _like_q(q, *args):
    return torch.empty_like(q)


_LIBRARY.impl("paged_decode_attention", _paged_decode, "CPU")
_LIBRARY.impl("paged_varlen_attention", _paged_varlen, "CPU")
for _name in ("paged_decode_attention", "paged_varlen_attention"):   # shapes, for a capture
    torch.library.register_fake(f"vt::{_name}", _like_q, lib=_LIBRARY)


def linear_rows(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with each row of x [M, K] its own one-row product: a row's
    bits do not depend on M or on the other rows."""
    if x.shape[0] <= 1:
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(x[i:i + 1], weight, bias) for i in range(x.shape[0])])


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vt.torch.fused.rms_norm's CPU form, one row at a time."""
    if x.shape[0] <= 1:
        return rms_norm(x, weight, eps)
    return torch.cat([rms_norm(x[i:i + 1], weight, eps) for i in range(x.shape[0])])


def silu_mul_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """vt.torch.fused.silu_mul's CPU form, one row at a time."""
    if gate_up.shape[0] <= 1:
        return silu_mul(gate_up)
    return torch.cat([silu_mul(gate_up[i:i + 1]) for i in range(gate_up.shape[0])])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In float32, as Hugging Face's Llama does, then back to the storage dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
