"""The Triton kernels behind vt.torch.fused on CUDA (imported only there: this module needs
Triton). Arguments are checked by vt.torch.fused; each kernel keeps torch's intermediate
roundings to the storage dtype so that it computes what the plain-torch form computes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vt.torch import triton_pdl as pdl

SILU_BLOCK = 1024


def rms_norm(x, delta, weight, eps: float):
    """(x + delta, rms_norm(x + delta)) when delta is given, else (None, rms_norm(x))."""
    S, hidden = x.shape
    out = torch.empty_like(x)
    h = torch.empty_like(x) if delta is not None else None
    check_norm_layout("rms_norm", x, delta, weight)
    if S:
        _rms_norm[(S,)](x, x if delta is None else delta, weight, out if h is None else h, out,
                        x.stride(0), 0 if delta is None else delta.stride(0),
                        0 if h is None else h.stride(0), out.stride(0), hidden, eps,
                        HAS_DELTA=delta is not None, **norm_launch(hidden),
                        **pdl.launch_options(x.device, S))
    return h, out


def norm_launch(hidden: int) -> dict:
    """The row block and warps of a kernel built on add_norm_row: the whole row, one program."""
    block = triton.next_power_of_2(hidden)
    return dict(BLOCK=block, num_warps=max(1, min(16, block // 256)))


def check_norm_layout(name: str, x, delta, weight) -> None:
    """ValueError, naming the kernel's caller, unless x, delta and weight have a contiguous
    last dim (the row kernels built on add_norm_row need one)."""
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or (delta is not None and delta.stride(-1) != 1):
        raise ValueError(f"{name}: x, delta and weight need a contiguous last dim")


def rope_and_cache(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, *, heads: int,
                   kv_heads: int, head_dim: int, k_scale=None, v_scale=None):
    half = head_dim // 2
    if half & (half - 1) or qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"rope_and_cache: the Triton kernel needs head_dim / 2 a power of two "
                         f"(got {head_dim}) and a contiguous last dim")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        raise ValueError("rope_and_cache: caches need a contiguous last dim; cos and sin one "
                         "row stride")
    S = qkv.shape[0]
    q = torch.empty(S, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if S:
        _rope_and_cache[(S, heads + kv_heads)](
            qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, q,
            *kv_scale_args(k_cache, k_scale, v_scale),
            qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), q.stride(0), q.stride(1),
            HEADS=heads, KV_HEADS=kv_heads, HALF=half, FP8_KV=k_scale is not None, num_warps=1,
            **pdl.launch_options(qkv.device, S))
    return q


def silu_mul(gate_up):
    S, width = gate_up.shape
    inter = width // 2
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_mul: gate_up needs a contiguous last dim")
    out = torch.empty(S, inter, dtype=gate_up.dtype, device=gate_up.device)
    if S:
        _silu_mul[(S, triton.cdiv(inter, SILU_BLOCK))](gate_up, out, gate_up.stride(0),
                                                       out.stride(0), inter, BLOCK=SILU_BLOCK,
                                                       num_warps=4,
                                                       **pdl.launch_options(gate_up.device, S))
    return out


@triton.jit
def _rms_norm(X, DELTA, W, H, OUT, stride_x, stride_d, stride_h, stride_o, N, eps,
              HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_next(PDL)
    r, c, mask, y = add_norm_row(X, DELTA, W, H, stride_x, stride_d, stride_h, N, eps,
                                 HAS_DELTA, BLOCK, PDL)
    tl.store(OUT + r * stride_o + c, y, mask=mask)


@triton.jit
def add_norm_row(X, DELTA, W, H, stride_x, stride_d, stride_h, N, eps,
                 HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program r's row of rms_norm: x (plus delta where HAS_DELTA, rounded to the storage
    dtype and stored to H), normed in float32, rounded, times the weight, rounded to X's dtype:
    (r, the columns c, their mask, the row [BLOCK], 0 past N). The whole row is one program's,
    so a kernel launched as rms_norm launches (BLOCK, warps) reduces in its order, bit for
    bit (vt.torch.triton_fp8's norm_quantize_rows)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < N
    w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)   # a weight: before the wait
    pdl.wait(PDL)
    x = tl.load(X + r * stride_x + c, mask=mask, other=0.0)
    if HAS_DELTA:
        # torch adds in the storage dtype: round the sum before the norm reads it
        x = (x.to(tl.float32) + tl.load(DELTA + r * stride_d + c, mask=mask, other=0.0)
             .to(tl.float32)).to(X.dtype.element_ty)
        tl.store(H + r * stride_h + c, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * inv).to(X.dtype.element_ty).to(tl.float32)
    return r, c, mask, (w * normed).to(X.dtype.element_ty)


def kv_scale_args(k_cache, k_scale, v_scale):
    """The K_SCALE, V_SCALE pointers of a kernel that writes or reads the cache: an FP8
    cache's scales, or (any other cache: FP8_KV False, never read) the cache itself."""
    if k_scale is None:
        return k_cache, k_cache
    return k_scale, v_scale


@triton.jit
def kv_code(x, scale):
    """An FP8 cache's code of x (vt.torch.kv_fp8.quantize): x / scale in float32, correctly
    rounded (div_rn, as torch divides), clamped to e4m3's +-448, rounded to nearest e4m3 (ties
    to even). The rounding is done here, in float32, so that the cast to e4m3 is exact: the
    magnitude plus 2^23 of its e4m3 spacing (2^(exponent - 3), 2^-9 below e4m3's normals),
    minus it again, is that magnitude rounded to the spacing by float32's own round to nearest
    even, carry into the next binade included. Triton's interpreter casts float32 to e4m3
    rounding half up and drops that carry; the GPU's cvt would round the same as this."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    exponent = (bits >> 23) & 0xFF
    magic = ((tl.maximum(exponent, 121) + 20) << 23).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    # y's sign bit put back as a bit (Triton negates as 0 - r, which makes -0.0 +0.0)
    signed = r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)
    return signed.to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def _rope_and_cache(QKV, POS, COS, SIN, KC, VC, SLOT, QOUT, K_SCALE, V_SCALE, stride_qkv,
                    stride_cos, stride_kt, stride_kh, stride_vt, stride_vh, stride_qs,
                    stride_qh, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                    FP8_KV: tl.constexpr, PDL: tl.constexpr):
    # Program (r, h): q head h of row r for h < HEADS, else KV head h - HEADS (key and value).
    pdl.launch_next(PDL)
    pdl.wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)
    pos = tl.load(POS + r).to(tl.int64)
    c1 = tl.load(COS + pos * stride_cos + d)
    c2 = tl.load(COS + pos * stride_cos + HALF + d)
    s1 = tl.load(SIN + pos * stride_cos + d)
    s2 = tl.load(SIN + pos * stride_cos + HALF + d)
    src = QKV + r * stride_qkv + h * (2 * HALF)    # q heads, then k heads, then v heads
    x1 = tl.load(src + d).to(tl.float32)
    x2 = tl.load(src + HALF + d).to(tl.float32)
    o1 = (x1 * c1 - x2 * s1).to(QKV.dtype.element_ty)
    o2 = (x2 * c2 + x1 * s2).to(QKV.dtype.element_ty)
    if h < HEADS:
        dst = QOUT + r * stride_qs + h * stride_qh
        tl.store(dst + d, o1)
        tl.store(dst + HALF + d, o2)
    else:
        kvh = h - HEADS
        slot = tl.load(SLOT + r).to(tl.int64)
        kdst = KC + slot * stride_kt + kvh * stride_kh
        vsrc = QKV + r * stride_qkv + (HEADS + KV_HEADS + kvh) * (2 * HALF)
        vdst = VC + slot * stride_vt + kvh * stride_vh
        v1 = tl.load(vsrc + d)
        v2 = tl.load(vsrc + HALF + d)
        if FP8_KV:
            ks = tl.load(K_SCALE)
            vs = tl.load(V_SCALE)
            tl.store(kdst + d, kv_code(o1, ks))
            tl.store(kdst + HALF + d, kv_code(o2, ks))
            tl.store(vdst + d, kv_code(v1, vs))
            tl.store(vdst + HALF + d, kv_code(v2, vs))
        else:
            tl.store(kdst + d, o1)
            tl.store(kdst + HALF + d, o2)
            tl.store(vdst + d, v1)
            tl.store(vdst + HALF + d, v2)


@triton.jit
def _silu_mul(GU, OUT, stride_g, stride_o, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_next(PDL)
    pdl.wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < I
    gate = tl.load(GU + r * stride_g + c, mask=mask, other=0.0)
    up = tl.load(GU + r * stride_g + I + c, mask=mask, other=0.0)
    tl.store(OUT + r * stride_o + c, silu_times(gate, up), mask=mask)


@triton.jit
def silu_times(gate, up):
    """silu(gate) * up in up's dtype, rounded where torch rounds: silu returns the storage
    dtype, so its result is rounded before the product (vt.torch.fused.silu_mul's plain-torch
    form). Also the SiLU product vt.torch.triton_gemv.linear_silu_mul takes into gate_up's
    epilogue."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(up.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(up.dtype)
