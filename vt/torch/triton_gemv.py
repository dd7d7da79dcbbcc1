"""A Triton linear layer for decode steps of few rows: y = x @ w.T for x [S, K] with S <= 16
and w [N, K] row-major, reading each weight once.

At a few rows a decode step's projections are pure weight reads (S x K x N multiply-adds over
N x K weights), so what matters is how close the kernel's weight reads come to the HBM
bandwidth. Each program owns BLOCK_N output columns over the whole K, so no partial sums go
through memory: its [BLOCK_N, BLOCK_K] weight tiles stream through a software pipeline
(num_stages deep) and meet the [16, BLOCK_K] row tile (rows past S masked to zero) in a
tensor-core dot. One row runs kernels of its own, a float32 reduction on the CUDA cores
with a fixed shape (ONE_ROW, below, says why); block shapes for more rows are autotuned per
(N, K) on the first call, which must come before any capture (a warm-up does it).
Accumulation is float32; the output is rounded once to w's dtype, as torch's bf16 GEMM does.

Three variants take the op next to a projection into its kernel, so that it costs no
launch of its own: linear_silu_mul (gate_up, then the MLP's activation in the epilogue; one
row), silu_mul_linear (the activation, then down) and add_rms_norm_linear (the residual add
and RMSNorm, then qkv or gate_up).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vt.torch import triton_pdl as pdl
from vt.torch.triton_fused import silu_times

MAX_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [S, K] @ weight[N, K].T -> [S, N] in weight's dtype (S <= MAX_ROWS)."""
    return _launch(x, weight, x.shape[1], silu_mul=False)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x [1, K] @ weight[2 * I, K].T ([gate | up] rows, as the MLP's fused
    gate_up holds them), with vt.torch.fused.silu_mul's roundings: [1, I]. One row only: the
    MLP's gate_up projection with the activation in its epilogue. Each program takes
    ONE_ROW's BLOCK_N / 2 gate rows and the same up rows, interleaved as its tile's rows,
    so every product is summed as linear() sums it, and the down projection after it is a
    plain linear() (cheaper than silu_mul_linear, whose every program recomputes the
    activation of the whole row)."""
    S, K = x.shape
    rows = weight.shape[0]
    if S != 1 or rows % 2 or weight.shape[1] != K:
        raise ValueError(f"triton_gemv.linear_silu_mul: x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)}; needs one row, an even weight row count "
                         f"and matching K")
    _need_contiguous_last_dim("x and weight", x, weight)
    y = torch.empty(1, rows // 2, dtype=weight.dtype, device=weight.device)
    _launch_one_row(x, weight, y, K, silu_mul=False, glu_out=True)
    return y


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [S, 2K] ([gate | up], as vt.torch.fused.silu_mul takes it,
    with its roundings to the storage dtype), @ weight[N, K].T: the MLP's down projection
    with the activation computed as the rows are read, one kernel instead of two."""
    return _launch(gate_up, weight, gate_up.shape[1] // 2, silu_mul=True)


def add_rms_norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                        eps: float, weight: torch.Tensor):
    """(h, rms_norm(h, norm_weight, eps) @ weight.T) with h = x + delta (None: h is x, and
    None is returned for it): vt.torch.fused.add_rms_norm (or rms_norm) and the projection
    after it in one kernel, with the fused ops' roundings to the storage dtype. Every
    program computes the rows' norms itself (the rows are read from L2, twice); program 0
    also writes h, the residual stream the next add reads."""
    S, K = x.shape
    N = weight.shape[0]
    if (S > MAX_ROWS or weight.shape[1] != K or norm_weight.shape != (K,)
            or (delta is not None and delta.shape != x.shape)):
        raise ValueError(f"triton_gemv: x {tuple(x.shape)}, norm_weight "
                         f"{tuple(norm_weight.shape)} and weight {tuple(weight.shape)}; needs "
                         f"S <= {MAX_ROWS}, delta shaped as x, and matching K")
    _need_contiguous_last_dim("x, delta, norm_weight and weight", x, weight, norm_weight,
                              *((delta,) if delta is not None else ()))
    h = torch.empty_like(x) if delta is not None else None
    y = torch.empty(S, N, dtype=weight.dtype, device=weight.device)
    d = delta if delta is not None else x
    if S == 1:
        _norm_gemv_one_row[(triton.cdiv(N, ONE_ROW_NORM["BLOCK_N"]),)](
            x, d, norm_weight, h if h is not None else x, weight, y, N, K, weight.stride(0),
            eps, HAS_DELTA=delta is not None, **ONE_ROW_NORM)
    elif S:
        _norm_gemv[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
            x, d, norm_weight, h if h is not None else x, weight, y, S, N, K, x.stride(0),
            d.stride(0), h.stride(0) if h is not None else 0, weight.stride(0), y.stride(0), eps,
            ROWS=MAX_ROWS, HAS_DELTA=delta is not None)
    return h, y


def _need_contiguous_last_dim(names: str, *tensors):
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError(f"triton_gemv: {names} need a contiguous last dim")


def _launch(x, weight, K: int, silu_mul: bool):
    S = x.shape[0]
    N = weight.shape[0]
    if S > MAX_ROWS or weight.shape[1] != K or x.shape[1] != (2 * K if silu_mul else K):
        raise ValueError(f"triton_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)}; "
                         f"needs S <= {MAX_ROWS} and matching K")
    _need_contiguous_last_dim("x and weight", x, weight)
    y = torch.empty(S, N, dtype=weight.dtype, device=weight.device)
    if S == 1:
        _launch_one_row(x, weight, y, K, silu_mul=silu_mul, glu_out=False)
    elif S:
        _gemv[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
            x, weight, y, S, N, K, x.stride(0), weight.stride(0), y.stride(0), ROWS=MAX_ROWS,
            SILU_MUL=silu_mul)
    return y


def _launch_one_row(x, weight, y, K: int, silu_mul: bool, glu_out: bool):
    """_gemv_one_row over x's one row into y's columns, ONE_ROW["BLOCK_N"] weight rows a
    program (half of them gate rows, half up rows, with glu_out)."""
    N = y.shape[1]
    per_program = ONE_ROW["BLOCK_N"] // 2 if glu_out else ONE_ROW["BLOCK_N"]
    _gemv_one_row[(triton.cdiv(N, per_program),)](
        x, weight, y, N, K, weight.stride(0), SILU_MUL=silu_mul, GLU_OUT=glu_out, **ONE_ROW,
        **pdl.launch_options(x.device, 1))


_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn in (16, 32, 64) for bk in (128, 256) for w in (4,) for s in (3, 5)]

# One row runs its own kernel on the CUDA cores with a fixed shape, not an autotuned one: the
# autotuner times each candidate on one weight, which the 50 MB L2 then holds, and so picks
# shapes that are fast from L2 rather than from HBM (they read the 8B shape's weights at
# 46-87 % of the copy rate on an H100). tools/gemv_row_sweep.py times shapes over rotating
# weight copies instead: on an H100 its fastest, all of 8 columns and 512-wide K tiles, read
# qkv, o, gate_up and down at 89, 83, 104 and 95 % (cuBLAS: 83, 69, 97, 93 %); this one is
# among them for o and down, and in tools/decode_floor.py the step's linears take 1.05x the
# weight floor with it against 1.10x with cuBLAS.
ONE_ROW = dict(BLOCK_N=8, BLOCK_K=512, num_warps=8, num_stages=4)
# add_rms_norm_linear's one-row kernel, whose programs also read the row (and delta) twice
# from L2, once for the norm and once against their weights: the fastest of the 24 shapes
# tools/norm_gemv_sweep.py timed on an H100 for qkv and gate_up alike. Even so it is slower
# than add_rms_norm and then the one-row linear (docs/benchmarks.md), so vt.torch.llama does
# not use it.
ONE_ROW_NORM = dict(BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=3)


@triton.jit
def _gemv_kernel(X, W, Y, S, N, K, stride_x, stride_w, stride_y, ROWS: tl.constexpr,
                 SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, ROWS)
    rk = tl.arange(0, BLOCK_K)
    w_ptr = W + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    x_ptr = X + rs[:, None] * stride_x + rk[None, :]
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x_mask = rs[:, None] < S
            w = tl.load(w_ptr, mask=rn[:, None] < N, other=0.0)
        else:
            kk = k0 + rk
            x_mask = (rs[:, None] < S) & (kk[None, :] < K)
            w = tl.load(w_ptr, mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        x = tl.load(x_ptr, mask=x_mask, other=0.0)
        if SILU_MUL:   # x is the gate; up sits K columns on
            x = silu_times(x, tl.load(x_ptr + K, mask=x_mask, other=0.0))
        acc += tl.dot(x.to(w.dtype), tl.trans(w))
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    tl.store(Y + rs[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=(rs[:, None] < S) & (rn[None, :] < N))


_even_k = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
# Keyed on the weight's shape, not on S: every S of 2..16 runs the same 16-row tile (rows past
# S masked), so one tuning serves them all, and a server capturing several batch sizes tunes
# each linear once.
_gemv = triton.autotune(configs=_CONFIGS, key=["N", "K", "SILU_MUL"])(_even_k(_gemv_kernel))


@triton.jit
def _weight_tile(wrow, nmask, kk, K, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile at columns kk of the weight rows wrow (rows past N masked
    by nmask, columns past K by kk unless EVEN_K)."""
    if EVEN_K:
        return tl.load(wrow + kk[None, :], mask=nmask, other=0.0)
    return tl.load(wrow + kk[None, :], mask=nmask & (kk[None, :] < K), other=0.0)


@triton.jit
def _row_cols(X, kk, K, EVEN_K: tl.constexpr):
    """Columns kk of the row at X (those past K 0 unless EVEN_K)."""
    if EVEN_K:
        return tl.load(X + kk)
    return tl.load(X + kk, mask=kk < K, other=0.0)


@triton.jit
def _row_input(X, kk, K, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr):
    """The row's [BLOCK_K] at columns kk: X's, or silu_mul's of the gate_up row at X."""
    x = _row_cols(X, kk, K, EVEN_K)
    if SILU_MUL:   # x is the gate; up sits K columns on
        x = silu_times(x, tl.load(X + K + kk, mask=kk < K, other=0.0))
    return x


@_even_k
@triton.jit
def _gemv_one_row(X, W, Y, N, K, stride_w, SILU_MUL: tl.constexpr, GLU_OUT: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  PDL: tl.constexpr):
    """One row: each program's BLOCK_N weight rows against the row on the CUDA cores.
    GLU_OUT: W holds [gate | up] rows, N of each; tile row 2j is gate row c_j and row 2j + 1
    up row c_j, for the program's BLOCK_N / 2 output columns c, which get silu(gate) * up."""
    pdl.launch_next(PDL)
    if GLU_OUT:
        i = tl.arange(0, BLOCK_N)
        col = tl.program_id(0) * (BLOCK_N // 2) + i // 2
        nmask = col[:, None] < N
        rn = col + (i % 2) * N
    else:
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn[:, None] < N
    wrow = W + rn[:, None].to(tl.int64) * stride_w
    rk = tl.arange(0, BLOCK_K)
    # The first tile outside the loop, as tools/gemv_row_sweep.py timed the kernel (PRE_K =
    # BLOCK_K there); the form with every tile in the loop has not been timed on its own.
    # No kernel writes the weights, so with PDL their first tile loads before the wait.
    w = _weight_tile(wrow, nmask, rk, K, EVEN_K)
    pdl.wait(PDL)
    x = _row_input(X, rk, K, SILU_MUL, EVEN_K)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = _weight_tile(wrow, nmask, k0 + rk, K, EVEN_K)
        x = _row_input(X, k0 + rk, K, SILU_MUL, EVEN_K)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if GLU_OUT:
        # Rounded to the storage dtype first, as the projection's output is before silu_mul.
        gate, up = tl.split(tl.reshape(acc.to(Y.dtype.element_ty), [BLOCK_N // 2, 2]))
        out = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(Y + out, silu_times(gate, up), mask=out < N)
    else:
        tl.store(Y + rn, acc.to(Y.dtype.element_ty), mask=rn < N)


@triton.jit
def _residual(X, DELTA, rs, kk, stride_x, stride_d, mask, HAS_DELTA: tl.constexpr):
    """Rows rs, columns kk of x + delta, rounded to x's dtype as torch's add is."""
    x = tl.load(X + rs[:, None] * stride_x + kk[None, :], mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(DELTA + rs[:, None] * stride_d + kk[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(X.dtype.element_ty)
    return x


@triton.autotune(configs=_CONFIGS, key=["N", "K", "HAS_DELTA"])   # as _gemv: not on S
@triton.jit
def _norm_gemv(X, DELTA, NW, H, W, Y, S, N, K, stride_x, stride_d, stride_h, stride_w,
               stride_y, eps, ROWS: tl.constexpr, HAS_DELTA: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, ROWS)
    rk = tl.arange(0, BLOCK_K)
    rows = rs[:, None] < S
    # Pass 1: each row's sum of squares of h = x + delta (program 0 stores h).
    sumsq = tl.zeros((ROWS,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mask = rows & (kk[None, :] < K)
        h = _residual(X, DELTA, rs, kk, stride_x, stride_d, mask, HAS_DELTA)
        if HAS_DELTA:
            if pid == 0:
                tl.store(H + rs[:, None] * stride_h + kk[None, :], h, mask=mask)
        hf = h.to(tl.float32)
        sumsq += tl.sum(hf * hf, axis=1)
    inv = tl.rsqrt(sumsq / K + eps)
    # Pass 2: the normed rows (rounded as fused.rms_norm rounds them) against the weight.
    w_ptr = W + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mask = rows & (kk[None, :] < K)
        h = _residual(X, DELTA, rs, kk, stride_x, stride_d, mask, HAS_DELTA)
        normed = (h.to(tl.float32) * inv[:, None]).to(h.dtype).to(tl.float32)
        nw = tl.load(NW + kk, mask=kk < K, other=0.0).to(tl.float32)
        x = (nw[None, :] * normed).to(h.dtype)
        w = tl.load(w_ptr, mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += tl.dot(x.to(w.dtype), tl.trans(w))
        w_ptr += BLOCK_K
    tl.store(Y + rs[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=(rs[:, None] < S) & (rn[None, :] < N))


@triton.jit
def _row_residual(X, DELTA, kk, K, HAS_DELTA: tl.constexpr, EVEN_K: tl.constexpr):
    """Columns kk of the row's x + delta, rounded to x's dtype as torch's add is."""
    x = _row_cols(X, kk, K, EVEN_K)
    if HAS_DELTA:
        d = _row_cols(DELTA, kk, K, EVEN_K)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(X.dtype.element_ty)
    return x


@_even_k
@triton.jit
def _norm_gemv_one_row(X, DELTA, NW, H, W, Y, N, K, stride_w, eps, HAS_DELTA: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """One row of _norm_gemv on the CUDA cores, shaped as _gemv_one_row: the norm's pass over
    the row, then the normed row against each program's BLOCK_N weight rows."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn[:, None] < N
    wrow = W + rn[:, None].to(tl.int64) * stride_w
    rk = tl.arange(0, BLOCK_K)
    # The first weight tile is requested before the norm's pass, which its latency then hides.
    w0 = _weight_tile(wrow, nmask, rk, K, EVEN_K)
    sumsq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        h = _row_residual(X, DELTA, kk, K, HAS_DELTA, EVEN_K)
        if HAS_DELTA:
            if pid == 0:   # the residual stream the next add reads
                tl.store(H + kk, h, mask=kk < K)
        hf = h.to(tl.float32)
        sumsq += hf * hf
    inv = tl.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
    acc = tl.sum(w0.to(tl.float32)
                 * _normed(X, DELTA, NW, rk, K, inv, HAS_DELTA, EVEN_K)[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + rk
        w = _weight_tile(wrow, nmask, kk, K, EVEN_K)
        acc += tl.sum(w.to(tl.float32)
                      * _normed(X, DELTA, NW, kk, K, inv, HAS_DELTA, EVEN_K)[None, :], axis=1)
    tl.store(Y + rn, acc.to(Y.dtype.element_ty), mask=rn < N)


@triton.jit
def _normed(X, DELTA, NW, kk, K, inv, HAS_DELTA: tl.constexpr, EVEN_K: tl.constexpr):
    """Columns kk of rms_norm(x + delta) in float32, rounded as vt.torch.fused.rms_norm
    rounds them: the normed row to the storage dtype, then its product with the weight."""
    h = _row_residual(X, DELTA, kk, K, HAS_DELTA, EVEN_K)
    normed = (h.to(tl.float32) * inv).to(h.dtype).to(tl.float32)
    nw = tl.load(NW + kk, mask=kk < K, other=0.0).to(tl.float32)
    return (nw * normed).to(h.dtype).to(tl.float32)
