"""The FP8 (e4m3) KV cache of vt.torch's Llama decoder (LlamaDecoder(kv_cache_dtype="fp8")):
K and V stored as float8_e4m3fn codes, one byte an element where bf16 takes two, with a
static float32 scale per tensor: one for K and one for V of each layer.

    write:  code = e4m3(clamp(x_f32 / scale, -448, 448))   round to nearest, ties to even
    read:   attention over the codes as they are (every e4m3 value is a bf16 and an fp16
            value), the scores times K's scale, the output times V's, in float32

x is the key or value as the model computes it (RoPE'd and rounded to the model's dtype, as a
bf16 cache would store it); x_f32 / scale is a correctly rounded float32 division on the CPU
(torch) and in the Triton kernels (tl.math.div_rn), so both store the same codes. The read is
what FP8 attention kernels commonly do (the scales folded into the softmax scale and the
output rather than multiplied into every element): the Triton kernels feed the codes to their
dots in the model's dtype, the CPU custom ops (vt.torch.cpu_ops) widen them to float32. Where
a scale is a power of two (vt's 1.0 included), this equals, bit for bit, attention over a
cache in the model's dtype holding dequantize's values.

The scale: 1.0 for every layer's K and V, vLLM's default for a checkpoint without calibrated
KV scales: e4m3 holds magnitudes up to 448 with 3 mantissa bits (a relative rounding error of
at most 2^-4), and below 2^-6 loses precision (subnormals to 2^-9). With scale 1.0 (or any
power of two) the read is exact in bf16 (e4m3's values are bf16 values), so an FP8-KV decoder
is bit for bit a bf16-KV decoder whose cache holds the dequantized codes. Checkpoint KV scales
(compressed-tensors' kv_cache_scheme) are not read: vt.torch.hf.load refuses such a checkpoint
with kv_cache_dtype="fp8" rather than run it with scales it did not mean.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
KV_CACHE_DTYPES = ("auto", "fp8")
DEFAULT_SCALE = 1.0


def check_kv_cache_dtype(kv_cache_dtype) -> str:
    """"auto" (the model's dtype; None means it too) or "fp8"; ValueError naming anything
    else."""
    if kv_cache_dtype is None:
        return "auto"
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")
    return kv_cache_dtype


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) -> float8_e4m3fn codes of x / scale (module docstring)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn codes -> codes * scale in float32, rounded once to dtype: the values the
    codes stand for (attention over the codes equals attention over these where the scale is
    a power of two)."""
    return (codes.float() * scale).to(dtype)


def write(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
          scale: torch.Tensor | None) -> None:
    """cache[slots] = x: quantized with `scale` where the cache is FP8 (the CPU has no
    index_copy_ of float8, so the codes go in as their bytes), else as it is."""
    if is_fp8(cache):
        cache.view(torch.uint8).index_copy_(0, slots, quantize(x, scale).view(torch.uint8))
    else:
        cache.index_copy_(0, slots, x)


def check_scales(name: str, k_cache: torch.Tensor, k_scale, v_scale) -> None:
    """ValueError, naming the call, unless an FP8 cache comes with both scales (float32
    tensors of one element) and another cache with none."""
    if not is_fp8(k_cache):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{name}: k_scale and v_scale are for an FP8 cache; the cache is "
                             f"{k_cache.dtype}")
        return
    for label, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or s.numel() != 1 or s.dtype != torch.float32:
            got = None if s is None else f"{s.dtype} {tuple(s.shape)}"
            raise ValueError(f"{name}: an FP8 cache needs {label} a float32 tensor of one "
                             f"element, got {got}")
