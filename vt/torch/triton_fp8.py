"""A Triton linear over FP8 (e4m3) weights for decode steps: y = x @ (q * scale).T
for x [S, K] bf16/fp16 with S <= MAX_ROWS, q float8_e4m3fn [N, K] row-major, its float32 scale per
output channel ([N]) or per 128 x 128 block ([ceil(N / 128), ceil(K / 128)]), reading each
weight byte once: half the bytes of the bf16 GEMV (vt.torch.triton_gemv), whose structure
this follows.

The arithmetic is vt.torch.fp8.reference_linear's: e4m3 codes and the activations widen to
float32 exactly (every e4m3 value is also exact in bf16, so the tensor-core path's bf16
operand is exact too), products sum in float32, the scale multiplies in float32 (per channel
once, in the epilogue; per block, each 128-wide K slice's partial sum), and the output is
rounded once to x's dtype. Only the summation order differs from the reference.

One row runs on the CUDA cores (as triton_gemv's one-row kernel: a fixed shape, PDL), with
linear_silu_mul taking the MLP's activation into the gate_up projection's epilogue (gate and
up rows interleaved in a tile, each scaled, rounded to the storage dtype, then silu_times).
More rows run tiles of 16 to 128 rows (ROW_TILES) through tl.dot with the weight tile widened
to x's dtype; the row tiles are the grid's fastest axis, so the programs that share a weight
tile run together and HBM serves it about once (L2 the rest). w8a8_linear (vt.torch.fp8's
choice from W8A8_MIN_ROWS rows with a per-channel scale) quantizes the rows first
(quantize_rows) and takes FP8 x FP8 tensor-core dots (_w8a8), the arithmetic of
vt.torch.fp8.reference_scaled_linear. Beyond MAX_ROWS (prompt steps) the caller's prompt
linear (cuBLAS) is the better kernel. Shapes are fixed per row count (no
autotuning): nothing runs on the host at a call but the launch, so it captures.

quantize_rows is the prompt linear's activation quantization for torch._scaled_mm (vt.torch.fp8
.scaled_mm_linear): one program a row reads it twice (its amax, then the codes, the second pass
from L2) where the eager version makes five passes over a float32 copy; the same values as
vt.torch.fp8.quantize_rows (its float32 product and correctly rounded division, e4m3 rounded
to nearest).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vt.torch import triton_pdl as pdl
from vt.torch.triton_gemv import k_tiles, row_cols, weight_tile
from vt.torch.triton_fused import add_norm_row, check_norm_layout, norm_launch, silu_times

MAX_ROWS = 256    # vt.torch.fp8.GEMV_MAX_ROWS (which this module's callers read without Triton)
FP8_MAX = 448.0   # e4m3fn's largest finite magnitude (vt.torch.fp8.FP8_MAX)
# the kernels' copies (a jit function reads constexpr globals only); 1 / 448 in float32
_FP8_MAX = tl.constexpr(FP8_MAX)
_INV_FP8_MAX = tl.constexpr(1.0 / FP8_MAX)
BLOCK = 128   # the block scales' K and N extent (vt.torch.fp8.BLOCK)
# One row: triton_gemv's shape with four times its K tile, 64 weight bytes a thread in flight:
# measured on an H100 at the 8B shape's projections, K tiles of 2048 beat 1024 by 2-20 %.
ONE_ROW = dict(BLOCK_N=8, BLOCK_K=2048, num_warps=8, num_stages=4)
# quantize_rows: a row of up to QUANT_ONE_PASS_K elements (the 8B shape's 14,336 included) is
# read once into registers; a longer one twice, in K tiles of QUANT_BLOCK_K.
QUANT_ONE_PASS_K = 16384
QUANT_BLOCK_K = 2048
# silu_mul_quantize_rows: columns a program. A row a program (the 8B shape's 14,336 in 16 warps)
# was bound by the one SM's arithmetic: 6.3 us at 32 rows on an H100, split in chunks of 512
# over two kernels 4.5 us.
SILU_CHUNK = 512
# (most rows, tile for N < WIDE_N, tile for N >= WIDE_N): the first whose row count covers S.
# Measured on an H100 at the 8B shape's projections (N 4096 to 28672): a wide projection
# (gate_up) runs fastest with wide column tiles that convert each weight tile once for all the
# rows; a narrow one (o, down: 4096 columns) needs narrow tiles, and up to 32 rows two 16-row
# tiles, to keep about two programs an SM.
WIDE_N = 16384
_TILE = dict(num_warps=4, num_stages=4)
ROW_TILES = ((16, dict(ROWS=16, BLOCK_N=32, BLOCK_K=256, **_TILE),
              dict(ROWS=16, BLOCK_N=32, BLOCK_K=256, **_TILE)),
             (32, dict(ROWS=16, BLOCK_N=32, BLOCK_K=256, **_TILE),
              dict(ROWS=32, BLOCK_N=64, BLOCK_K=128, **_TILE)),
             (64, dict(ROWS=64, BLOCK_N=32, BLOCK_K=128, **_TILE),
              dict(ROWS=64, BLOCK_N=64, BLOCK_K=128, **_TILE)),
             (MAX_ROWS, dict(ROWS=64, BLOCK_N=32, BLOCK_K=128, **_TILE),
              dict(ROWS=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4)))
# W8A8 (w8a8_linear): measured on an H100 at 16, 32 and 64 rows of the 8B shape's four
# projections, 64 weight rows by 256 K a tile beat 128-row tiles, 128- and 512-wide K tiles and
# 8 warps (within 2 % of each shape's best), and beat the widened tiles above by 10-50 %.
# A long reduction (K >= W8A8_LONG_K: down's 14,336) keeps one more tile in flight: 1.2-1.8 us
# (5-7 %) faster at 16 to 64 rows; at shorter K a fifth stage gained nothing.
W8A8_TILE = dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4)
W8A8_LONG_K_TILE = dict(W8A8_TILE, num_stages=5)
W8A8_LONG_K = 8192
W8A8_MAX_BLOCK_M = 64   # activation rows a program; more rows, more programs along M


def fits(x: torch.Tensor, weight) -> bool:
    """Whether linear takes x and the Fp8Weight: CUDA, 2-D x of at most MAX_ROWS rows in
    bf16/fp16, the codes' last dim contiguous."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and weight.data.stride(-1) == 1)


def linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [S, K] @ (codes * scale)[N, K].T -> [S, N] in x's dtype (S <= MAX_ROWS)."""
    S, K = x.shape
    N = codes.shape[0]
    _check(x, codes, scale, S <= MAX_ROWS, f"S <= {MAX_ROWS}")
    y = torch.empty(S, N, dtype=x.dtype, device=x.device)
    per_block = scale.dim() == 2
    if S == 1:
        _launch_one_row(x, codes, scale, y, K, glu_out=False)
    elif S:
        cfg = row_tile(S, N)
        if per_block:
            cfg = dict(cfg, BLOCK_K=BLOCK)
        _fp8_gemv[(triton.cdiv(S, cfg["ROWS"]), triton.cdiv(N, cfg["BLOCK_N"]))](
            x, codes, scale, y, S, N, K, x.stride(0), codes.stride(0), y.stride(0),
            _scale_cols(scale), PER_BLOCK=per_block, **cfg)
    return y


def w8a8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [S, K] @ (codes * scale)[N, K].T -> [S, N] with x quantized too (W8A8, S <= MAX_ROWS,
    a per-channel scale): quantize_rows, then FP8 x FP8 tensor-core dots (_w8a8). The
    arithmetic is vt.torch.fp8.reference_scaled_linear's but for the summation order."""
    S, K = x.shape
    _check(x, codes, scale, S <= MAX_ROWS and scale.dim() == 1, f"S <= {MAX_ROWS} and a "
           f"per-channel scale")
    xq, x_scale = quantize_rows(x)
    return scaled_rows_linear(xq, x_scale, codes, scale, x.dtype)


def scaled_rows_linear(xq: torch.Tensor, x_scale: torch.Tensor, codes: torch.Tensor,
                       scale: torch.Tensor, dtype) -> torch.Tensor:
    """w8a8_linear after its quantization: e4m3 rows xq [S, K] with their float32 scales
    [S, 1] (quantize_rows' outputs) against the codes; out in dtype."""
    S, K = xq.shape
    N = codes.shape[0]
    y = torch.empty(S, N, dtype=dtype, device=xq.device)
    if S:
        block_m = min(W8A8_MAX_BLOCK_M, max(16, triton.next_power_of_2(S)))
        tile = W8A8_LONG_K_TILE if K >= W8A8_LONG_K else W8A8_TILE
        _w8a8[(triton.cdiv(S, block_m), triton.cdiv(N, tile["BLOCK_N"]))](
            xq, x_scale, codes, scale, y, S, N, K, xq.stride(0), codes.stride(0), y.stride(0),
            BLOCK_M=block_m, **tile, **pdl.launch_options(xq.device, S, any_rows=True))
    return y


def row_tile(S: int, N: int) -> dict:
    """The tile and launch shape of the tl.dot kernel for S rows (2 <= S <= MAX_ROWS) of an
    N-column output."""
    narrow, wide = next((narrow, wide) for most, narrow, wide in ROW_TILES if S <= most)
    return wide if N >= WIDE_N else narrow


def linear_silu_mul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x [1, K] @ (codes * scale)[2 * I, K].T ([gate | up] rows), with
    vt.torch.fused.silu_mul's roundings after the linear's: [1, I]. One row only."""
    S, K = x.shape
    rows = codes.shape[0]
    _check(x, codes, scale, S == 1 and rows % 2 == 0, "one row and an even row count")
    if scale.dim() == 2 and (rows // 2) % BLOCK:
        raise ValueError(f"triton_fp8.linear_silu_mul: block scales need I = {rows // 2} "
                         f"a multiple of {BLOCK}")
    y = torch.empty(1, rows // 2, dtype=x.dtype, device=x.device)
    _launch_one_row(x, codes, scale, y, K, glu_out=True)
    return y


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (CUDA, bf16/fp16/fp32, last dim contiguous) -> (codes float8_e4m3fn [M, K],
    scale float32 [M, 1]): vt.torch.fp8.quantize_rows' values, bit for bit."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in (torch.bfloat16, torch.float16,
                                                            torch.float32):
        raise ValueError(f"triton_fp8.quantize_rows: x must be 2-D bf16/fp16/fp32 with a "
                         f"contiguous last dim, got {tuple(x.shape)} {x.dtype}")
    M, K = x.shape
    codes = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        whole = triton.next_power_of_2(K)
        block_k = whole if whole <= QUANT_ONE_PASS_K else QUANT_BLOCK_K
        _quantize_rows[(M,)](x, codes, scale, K, x.stride(0), codes.stride(0), BLOCK_K=block_k,
                             num_warps=_row_warps(block_k),
                             **pdl.launch_options(x.device, M, any_rows=True))
    return codes, scale


def norm_quantize_rows(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """vt.torch.triton_fused.rms_norm's (x + delta, its norm) with the norm quantized as
    quantize_rows quantizes it, in one kernel: (x + delta, or None without delta; codes
    [S, hidden]; scales [S, 1]), bit for bit rms_norm then quantize_rows."""
    S, hidden = x.shape
    check_norm_layout("norm_quantize_rows", x, delta, weight)
    h = torch.empty_like(x) if delta is not None else None
    codes = torch.empty(S, hidden, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(S, 1, dtype=torch.float32, device=x.device)
    if S:
        _norm_quantize_rows[(S,)](
            x, x if delta is None else delta, weight, codes if h is None else h, codes, scale,
            x.stride(0), 0 if delta is None else delta.stride(0), 0 if h is None else h.stride(0),
            codes.stride(0), hidden, eps, HAS_DELTA=delta is not None, **norm_launch(hidden),
            **pdl.launch_options(x.device, S, any_rows=True))
    return h, codes, scale


@triton.jit
def _norm_quantize_rows(X, DELTA, W, H, Q, SCALE, stride_x, stride_d, stride_h, stride_q, N,
                        eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_next(PDL)
    r, c, mask, y = add_norm_row(X, DELTA, W, H, stride_x, stride_d, stride_h, N, eps,
                                 HAS_DELTA, BLOCK, PDL)
    _quantize_row(y.to(tl.float32), mask, Q + r * stride_q + c, SCALE + r)


def silu_mul_quantize_rows(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vt.torch.triton_fused.silu_mul's silu(gate) * up of gate_up [S, 2 * I] quantized as
    quantize_rows quantizes it: (codes [S, I], scales [S, 1]), bit for bit silu_mul then
    quantize_rows. Two kernels of S x cdiv(I, SILU_CHUNK) programs: the product in the storage
    dtype with each chunk's amax, then each row's scale from its chunks' and the codes."""
    S, width = gate_up.shape
    inter = width // 2
    if gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul_quantize_rows: gate_up needs a contiguous last dim, got "
                         f"strides {gate_up.stride()}")
    codes = torch.empty(S, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty(S, 1, dtype=torch.float32, device=gate_up.device)
    if S:
        chunks = triton.cdiv(inter, SILU_CHUNK)
        product = torch.empty(S, inter, dtype=gate_up.dtype, device=gate_up.device)
        peaks = torch.empty(S, chunks, dtype=torch.float32, device=gate_up.device)
        launch = dict(CHUNK=SILU_CHUNK, num_warps=4,
                      **pdl.launch_options(gate_up.device, S, any_rows=True))
        _silu_mul_peaks[(S, chunks)](gate_up, product, peaks, gate_up.stride(0), inter,
                                     **launch)
        _quantize_chunks[(S, chunks)](product, peaks, codes, scale, inter,
                                      BLOCK_P=triton.next_power_of_2(chunks), **launch)
    return codes, scale


def _row_warps(block: int) -> int:
    """Warps of a program that quantizes a block-wide slice of a row: 8 to 16."""
    return max(8, min(16, block // 1024))


@triton.jit
def _silu_mul_peaks(GU, H, PEAK, stride_g, I, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program (r, p): silu_times over row r's columns p * CHUNK .. into H [S, I] (the storage
    dtype), and their largest magnitude into PEAK [r, p]."""
    pdl.launch_next(PDL)
    pdl.wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    c = p * CHUNK + tl.arange(0, CHUNK)
    mask = c < I
    gate = tl.load(GU + r * stride_g + c, mask=mask, other=0.0)
    up = tl.load(GU + r * stride_g + I + c, mask=mask, other=0.0)
    h = silu_times(gate, up)
    tl.store(H + r * I + c, h, mask=mask)
    tl.store(PEAK + r * tl.num_programs(1) + p, tl.max(tl.abs(h.to(tl.float32)), axis=0))


@triton.jit
def _quantize_chunks(H, PEAK, Q, SCALE, I, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr,
                     PDL: tl.constexpr):
    """Program (r, p): row r's scale from its chunks' peaks (stored by p = 0), and the codes of
    its columns p * CHUNK .."""
    pdl.launch_next(PDL)
    pdl.wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    chunks = tl.num_programs(1)
    k = tl.arange(0, BLOCK_P)
    s = _row_scale(tl.load(PEAK + r * chunks + k, mask=k < chunks, other=0.0))
    if p == 0:
        tl.store(SCALE + r, s)
    c = p * CHUNK + tl.arange(0, CHUNK)
    mask = c < I
    v = tl.load(H + r * I + c, mask=mask, other=0.0).to(tl.float32)
    _store_codes(Q + r * I + c, v, s, mask)


@triton.heuristics({"ONE_PASS": lambda a: a["K"] <= a["BLOCK_K"]})
@triton.jit
def _quantize_rows(X, Q, SCALE, K, stride_x, stride_q, BLOCK_K: tl.constexpr,
                   ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_next(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    if ONE_PASS:   # the whole row in registers: one read
        v = tl.load(X + row * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
        _quantize_row(v, rk < K, Q + row * stride_q + rk, SCALE + row)
    else:   # the row in K tiles: its amax, then the codes (the second read from L2)
        peak = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            v = tl.load(X + row * stride_x + kk, mask=kk < K, other=0.0).to(tl.float32)
            peak = tl.maximum(peak, tl.abs(v))
        s = _row_scale(peak)
        tl.store(SCALE + row, s)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            v = tl.load(X + row * stride_x + kk, mask=kk < K, other=0.0).to(tl.float32)
            _store_codes(Q + row * stride_q + kk, v, s, kk < K)


@triton.jit
def _quantize_row(v, mask, q_ptrs, scale_ptr):
    """A row held whole in registers (float32 v, 0 where not mask): its scale stored at
    scale_ptr, its codes at q_ptrs."""
    s = _row_scale(tl.abs(v))
    tl.store(scale_ptr, s)
    _store_codes(q_ptrs, v, s, mask)


@triton.jit
def _row_scale(magnitudes):
    """A row's scale from its elements' magnitudes: amax * (1 / 448) in float32, 1 for 0."""
    amax = tl.max(magnitudes, axis=0)
    return tl.where(amax > 0, amax * _INV_FP8_MAX, 1.0)


@triton.jit
def _store_codes(ptr, v, s, mask):
    """v / s (float32, correctly rounded) clamped to e4m3's range, stored as e4m3 codes."""
    q = tl.clamp(tl.math.div_rn(v, s), -_FP8_MAX, _FP8_MAX)
    tl.store(ptr, q.to(tl.float8e4nv), mask=mask)


def _check(x, codes, scale, rows_ok: bool, rows_need: str):
    S, K = x.shape
    N = codes.shape[0]
    want = ((triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK)) if scale.dim() == 2 else (N,))
    if (not rows_ok or codes.shape[1] != K or codes.dtype != torch.float8_e4m3fn
            or scale.dtype != torch.float32 or tuple(scale.shape) != want):
        raise ValueError(f"triton_fp8: x {tuple(x.shape)}, codes {tuple(codes.shape)} "
                         f"{codes.dtype}, scale {tuple(scale.shape)} {scale.dtype}; needs "
                         f"{rows_need}, matching K, float8_e4m3fn codes and a float32 scale "
                         f"of shape {want}")
    if x.stride(-1) != 1 or codes.stride(-1) != 1 or not scale.is_contiguous():
        raise ValueError("triton_fp8: x, codes and scale need a contiguous last dim")


def _scale_cols(scale: torch.Tensor) -> int:
    return scale.shape[1] if scale.dim() == 2 else 1


def _launch_one_row(x, codes, scale, y, K: int, glu_out: bool):
    N = y.shape[1]
    per_program = ONE_ROW["BLOCK_N"] // 2 if glu_out else ONE_ROW["BLOCK_N"]
    _fp8_gemv_one_row[(triton.cdiv(N, per_program),)](
        x, codes, scale, y, N, K, codes.stride(0), _scale_cols(scale),
        GLU_OUT=glu_out, PER_BLOCK=scale.dim() == 2, **ONE_ROW,
        **pdl.launch_options(x.device, 1))


@triton.jit
def _block_partials(prod, scale_rows, k0, SC, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over k of prod [BLOCK_N, BLOCK_K] (K columns k0..k0 + BLOCK_K), each 128-wide
    slice's sum times its block's scale (scale_rows: the rows' scale row pointers)."""
    parts = tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // 128, 128]), axis=2)
    kb = k0 // 128 + tl.arange(0, BLOCK_K // 128)
    s = tl.load(scale_rows[:, None] + kb[None, :], mask=kb[None, :] < SC, other=0.0)
    return tl.sum(parts * s, axis=1)


@triton.jit
def _one_row_partial(w, x, scale_rows, k0, SC, PER_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """One K tile's contribution to the one-row kernel's BLOCK_N sums: the weight codes w
    [BLOCK_N, BLOCK_K] times the row's columns x [BLOCK_K] in float32 (with PER_BLOCK, each
    128-wide slice times its block's scale)."""
    prod = w.to(tl.float32) * x.to(tl.float32)[None, :]
    if PER_BLOCK:
        return _block_partials(prod, scale_rows, k0, SC, BLOCK_N, BLOCK_K)
    return tl.sum(prod, axis=1)


@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
@triton.jit
def _fp8_gemv_one_row(X, W, SCALE, Y, N, K, stride_w, SC, GLU_OUT: tl.constexpr,
                      PER_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """One row on the CUDA cores, BLOCK_N weight rows a program. GLU_OUT: W holds [gate | up]
    rows, N of each; tile row 2j is gate row c_j and 2j + 1 up row c_j."""
    pdl.launch_next(PDL)
    if GLU_OUT:
        i = tl.arange(0, BLOCK_N)
        col = tl.program_id(0) * (BLOCK_N // 2) + i // 2
        nmask1 = col < N
        rn = col + (i % 2) * N
    else:
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask1 = rn < N
    nmask = nmask1[:, None]
    wrow = W + rn[:, None].to(tl.int64) * stride_w
    scale_rows = SCALE + (rn // 128) * SC   # PER_BLOCK: each row's block-row of scales
    rk = tl.arange(0, BLOCK_K)
    # No kernel writes the weights, so with PDL the first tile loads before the wait (as in
    # triton_gemv's one-row kernel), behind the end of the kernel before.
    w = weight_tile(wrow, nmask, rk, K, EVEN_K)
    pdl.wait(PDL)
    acc = _one_row_partial(w, row_cols(X, rk, K, EVEN_K), scale_rows, 0, SC, PER_BLOCK,
                           BLOCK_N, BLOCK_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = weight_tile(wrow, nmask, k0 + rk, K, EVEN_K)
        acc += _one_row_partial(w, row_cols(X, k0 + rk, K, EVEN_K), scale_rows, k0, SC,
                                PER_BLOCK, BLOCK_N, BLOCK_K)
    if not PER_BLOCK:
        acc = acc * tl.load(SCALE + rn, mask=nmask1, other=0.0)
    if GLU_OUT:
        # Rounded to the storage dtype first, as the projection's output is before silu_mul.
        gate, up = tl.split(tl.reshape(acc.to(Y.dtype.element_ty), [BLOCK_N // 2, 2]))
        out = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(Y + out, silu_times(gate, up), mask=out < N)
    else:
        tl.store(Y + rn, acc.to(Y.dtype.element_ty), mask=nmask1)


@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
@triton.jit
def _fp8_gemv(X, W, SCALE, Y, S, N, K, stride_x, stride_w, stride_y, SC, ROWS: tl.constexpr,
              PER_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr):
    """2..MAX_ROWS rows, program (row tile, column tile): a [ROWS, BLOCK_K] x [BLOCK_K, BLOCK_N]
    tensor-core dot per K tile (rows past S masked to zero), the weight tile widened to x's
    dtype (exact). PER_BLOCK: BLOCK_K is 128, one block column a tile, whose dot is scaled
    before it is added."""
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rk = tl.arange(0, BLOCK_K)
    w_ptr = W + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    x_ptr = X + rs[:, None] * stride_x + rk[None, :]
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, x = k_tiles(w_ptr, x_ptr, rn, rs, k0 + rk, N, S, K, EVEN_K)
        part = tl.dot(x, tl.trans(w.to(x.dtype)))
        if PER_BLOCK:
            s = tl.load(SCALE + (rn // 128) * SC + k0 // 128, mask=rn < N, other=0.0)
            acc += part * s[None, :]
        else:
            acc += part
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    if not PER_BLOCK:
        acc = acc * tl.load(SCALE + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(Y + rs[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=(rs[:, None] < S) & (rn[None, :] < N))


@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
@triton.jit
def _w8a8(XQ, XS, W, WS, Y, S, N, K, stride_x, stride_w, stride_y, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
          PDL: tl.constexpr):
    """W8A8, program (row tile, column tile): the dot is taken transposed, weight rows as the
    tensor core's M side ([BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M], e4m3 both, float32
    accumulation), so a few activation rows are its narrow N side and the weight tile needs no
    padding. The epilogue applies the row's scale, then the channel's (reference_scaled_linear's
    order), rounds once and stores the tile transposed."""
    pdl.launch_next(PDL)
    pdl.wait(PDL)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    w_ptr = W + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    x_ptr = XQ + rs[:, None] * stride_x + rk[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, x = k_tiles(w_ptr, x_ptr, rn, rs, k0 + rk, N, S, K, EVEN_K)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    acc = acc * tl.load(XS + rs, mask=rs < S, other=0.0)[None, :]
    acc = acc * tl.load(WS + rn, mask=rn < N, other=0.0)[:, None]
    tl.store(Y + rs[None, :] * stride_y + rn[:, None], acc.to(Y.dtype.element_ty),
             mask=(rs[None, :] < S) & (rn[:, None] < N))
