"""Fused layer ops for vt.torch models: each is one kernel on CUDA (Triton, in
vt.torch.triton_fused) where the plain-torch form is several, and that plain-torch form on
the CPU. Both compute the same function as the unfused code of a Hugging Face Llama, with
the same roundings to the storage dtype (where torch rounds an intermediate to bf16, the
kernel rounds it there too), so a fused step stays within float32 rounding of the unfused.

    rms_norm(x, weight, eps)              weight * (x / rms(x) in float32).to(x.dtype)
    add_rms_norm(x, delta, weight, eps)   h = x + delta; (h, rms_norm(h, weight, eps))
    rope_and_cache(qkv, ...)              q rotated; k rotated and v written to their slots
    silu_mul(gate_up)                     silu(gate) * up of the fused [gate | up] rows
    linear(x, weight, bias)               F.linear; on CUDA at <= 16 rows of bf16/fp16, one
                                          vt.torch.triton_gemv kernel (the bias added after)
    invariant_linear(x, weight, bias)     F.linear whose rows' bits do not depend on the
                                          other rows or their number (batch_invariant)
    linear_silu_mul(x, weight, bias)      silu_mul(linear(x, weight, bias)); on CUDA at one
                                          row without bias, one kernel

Every shape is fixed by the inputs' shapes and nothing is read on the host, so each call
captures in a CUDA graph as it is. Triton is imported only when a CUDA tensor arrives.

invariant=True (rms_norm, add_rms_norm, silu_mul; LlamaDecoder's batch_invariant mode): a
row's bits depend on that row alone. The CUDA kernels are one program per row, or per element,
either way; on the CPU the ops then run one row at a time (vt.torch.cpu_ops says why).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vt.torch import cpu_ops, kv_fp8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             invariant: bool = False) -> torch.Tensor:
    """x [S, hidden] -> [S, hidden] in x's dtype; weight [hidden]."""
    _check_norm(x, x, weight)
    if x.is_cuda:
        return _triton().rms_norm(x, None, weight, eps)[1]
    return (cpu_ops.rms_norm_rows if invariant else cpu_ops.rms_norm)(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm in one pass: h = x + delta (in x's dtype), and
    rms_norm(h). x, delta [S, hidden]; returns (h, normed), both new [S, hidden] tensors."""
    _check_norm(x, delta, weight)
    if x.is_cuda:
        return _triton().rms_norm(x, delta, weight, eps)
    h = x + delta
    return h, (cpu_ops.rms_norm_rows if invariant else cpu_ops.rms_norm)(h, weight, eps)


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, heads: int, kv_heads: int,
                   head_dim: int, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary embedding of q and k (Hugging Face's layout: the two halves of head_dim rotate
    together) and the paged KV write, in one pass over the fused projection.

    qkv [S, (heads + 2 * kv_heads) * head_dim] (q, then k, then v); positions [S] int;
    cos, sin [max_context, head_dim] float32 tables (rows picked by positions here);
    k_cache, v_cache [slots, kv_heads, head_dim]; slot_mapping [S] int: row r's rotated key
    and its value go to slot slot_mapping[r]. Returns the rotated q [S, heads, head_dim].
    An FP8 cache (float8_e4m3fn) takes k_scale and v_scale (float32, one element each): the
    rotated key and the value, in qkv's dtype, are written as vt.torch.kv_fp8.quantize's codes.
    """
    check_rope(qkv, k_cache, v_cache, positions, slot_mapping, heads, kv_heads, head_dim)
    kv_fp8.check_scales("rope_and_cache", k_cache, k_scale, v_scale)
    if qkv.is_cuda:
        return _triton().rope_and_cache(qkv, positions, cos, sin, k_cache, v_cache,
                                        slot_mapping, heads=heads, kv_heads=kv_heads,
                                        head_dim=head_dim, k_scale=k_scale, v_scale=v_scale)
    S, rotated = qkv.shape[0], heads + kv_heads
    pos, slots = positions.long(), slot_mapping.long()
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)   # [S, 1, hd]
    # q and k lead the projection side by side: one rotation of both (a captured step on the
    # sim replays each op of it, so fewer ops are a faster step)
    qk = rope_torch(qkv[:, :rotated * head_dim].reshape(S, rotated, head_dim), c, s)
    kv_fp8.write(k_cache, slots, qk[:, heads:], k_scale)
    kv_fp8.write(v_cache, slots, qkv[:, rotated * head_dim:].reshape(S, kv_heads, head_dim),
                 v_scale)
    return qk[:, :heads].contiguous()


def silu_mul(gate_up: torch.Tensor, *, invariant: bool = False) -> torch.Tensor:
    """gate_up [S, 2 * intermediate] ([gate | up]) -> silu(gate) * up [S, intermediate]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up [S, 2 * intermediate] expected, got "
                         f"{tuple(gate_up.shape)}")
    if gate_up.is_cuda:
        return _triton().silu_mul(gate_up)
    return (cpu_ops.silu_mul_rows if invariant else cpu_ops.silu_mul)(gate_up)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in float32, back to x's dtype; cos, sin broadcast against x."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear(x, weight, bias). On CUDA, x [S, K] of at most triton_gemv.MAX_ROWS rows in
    weight's dtype (bf16 or fp16) runs vt.torch.triton_gemv.linear, its bias (if any) added
    after: the candidate against cuBLAS at a decode step's few rows (docs/torch.md says how
    it is measured). Anything else: F.linear."""
    if _gemv_fits(x, weight):
        y = _gemv().linear(x, weight)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) whose row bits depend on that row alone, not on how many rows
    x has or what they hold: vt.torch.triton_invariant.linear on CUDA (one block shape, K
    summed in one order), vt.torch.cpu_ops.linear_rows on the CPU (one product per row)."""
    if x.is_cuda:
        from vt.torch import triton_invariant
        return triton_invariant.linear(x, weight, bias)
    return cpu_ops.linear_rows(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu_mul(linear(x, weight, bias)): the MLP's gate_up projection ([gate | up] rows) and
    its activation, [S, intermediate]. On CUDA one row in weight's dtype (bf16 or fp16)
    without bias is one kernel (triton_gemv.linear_silu_mul: the activation in the
    projection's epilogue, bit for bit the two ops); anything else is the two ops."""
    if _gemv_fits(x, weight) and x.shape[0] == 1 and bias is None:
        return _gemv().linear_silu_mul(x, weight)
    return silu_mul(linear(x, weight, bias))


def _check_norm(x, delta, weight):
    if x.dim() != 2 or delta.shape != x.shape or tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"rms_norm: x and delta [S, hidden], weight [hidden] expected, got "
                         f"{tuple(x.shape)}, {tuple(delta.shape)}, {tuple(weight.shape)}")
    if delta.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: x, delta and weight must share a dtype, got {x.dtype}, "
                         f"{delta.dtype}, {weight.dtype}")


def check_rope(qkv, k_cache, v_cache, positions, slot_mapping, heads, kv_heads, head_dim):
    """ValueError, naming the shapes, for arguments rope_and_cache (and vt.torch.
    paged_attention.rope_cache_decode_attention, which starts with it) cannot take."""
    width = (heads + 2 * kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or head_dim % 2:
        raise ValueError(f"rope_and_cache: qkv [S, {width}] (heads={heads}, kv_heads="
                         f"{kv_heads}, head_dim={head_dim} even) expected, got "
                         f"{tuple(qkv.shape)}")
    if k_cache.shape != v_cache.shape or tuple(k_cache.shape[1:]) != (kv_heads, head_dim):
        raise ValueError(f"rope_and_cache: caches [slots, {kv_heads}, {head_dim}] expected, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    S = qkv.shape[0]
    if tuple(positions.shape) != (S,) or tuple(slot_mapping.shape) != (S,):
        raise ValueError(f"rope_and_cache: positions and slot_mapping [S={S}] expected, got "
                         f"{tuple(positions.shape)} and {tuple(slot_mapping.shape)}")
    if k_cache.dtype != qkv.dtype and not kv_fp8.is_fp8(k_cache):
        raise ValueError(f"rope_and_cache: qkv is {qkv.dtype}, the cache {k_cache.dtype} (the "
                         f"cache holds qkv's dtype or float8_e4m3fn)")


def _gemv_fits(x, weight) -> bool:
    # is_cuda first: triton_gemv (and Triton) is imported only for a CUDA tensor
    return (x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= _gemv().MAX_ROWS)


def _gemv():
    from vt.torch import triton_gemv
    return triton_gemv


def _triton():
    try:
        from vt.torch import triton_fused
    except ImportError as e:
        raise RuntimeError(f"vt.torch.fused on CUDA needs Triton (it ships with CUDA builds "
                           f"of PyTorch): {e}") from e
    return triton_fused
