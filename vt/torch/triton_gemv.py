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

linear_silu_mul takes the MLP's activation into the gate_up projection's epilogue at one row,
so that it costs no launch of its own.
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
    S, K = x.shape
    N = weight.shape[0]
    if S > MAX_ROWS or weight.shape[1] != K:
        raise ValueError(f"triton_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)}; "
                         f"needs S <= {MAX_ROWS} and matching K")
    _need_contiguous_last_dim("x and weight", x, weight)
    y = torch.empty(S, N, dtype=weight.dtype, device=weight.device)
    if S == 1:
        _launch_one_row(x, weight, y, K, glu_out=False)
    elif S:
        _gemv[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
            x, weight, y, S, N, K, x.stride(0), weight.stride(0), y.stride(0), ROWS=MAX_ROWS)
    return y


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x [1, K] @ weight[2 * I, K].T ([gate | up] rows, as the MLP's fused
    gate_up holds them), with vt.torch.fused.silu_mul's roundings: [1, I]. One row only: the
    MLP's gate_up projection with the activation in its epilogue. Each program takes
    ONE_ROW's BLOCK_N / 2 gate rows and the same up rows, interleaved as its tile's rows,
    so every product is summed as linear() sums it, and the down projection after it is a
    plain linear()."""
    S, K = x.shape
    rows = weight.shape[0]
    if S != 1 or rows % 2 or weight.shape[1] != K:
        raise ValueError(f"triton_gemv.linear_silu_mul: x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)}; needs one row, an even weight row count "
                         f"and matching K")
    _need_contiguous_last_dim("x and weight", x, weight)
    y = torch.empty(1, rows // 2, dtype=weight.dtype, device=weight.device)
    _launch_one_row(x, weight, y, K, glu_out=True)
    return y


def _need_contiguous_last_dim(names: str, *tensors):
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError(f"triton_gemv: {names} need a contiguous last dim")


def _launch_one_row(x, weight, y, K: int, glu_out: bool):
    """_gemv_one_row over x's one row into y's columns, ONE_ROW["BLOCK_N"] weight rows a
    program (half of them gate rows, half up rows, with glu_out)."""
    N = y.shape[1]
    per_program = ONE_ROW["BLOCK_N"] // 2 if glu_out else ONE_ROW["BLOCK_N"]
    _gemv_one_row[(triton.cdiv(N, per_program),)](
        x, weight, y, N, K, weight.stride(0), GLU_OUT=glu_out, **ONE_ROW,
        **pdl.launch_options(x.device, 1))


_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn in (16, 32, 64) for bk in (128, 256) for w in (4,) for s in (3, 5)]

# One row runs its own kernel on the CUDA cores with a fixed shape, not an autotuned one: the
# autotuner times each candidate on one weight, which the 50 MB L2 then holds, and so picks
# shapes that are fast from L2 rather than from HBM (they read the 8B shape's weights at
# 46-87 % of the copy rate on an H100). Timed over rotating weight copies instead (the
# one-off sweep: git show e595b50:tools/gemv_row_sweep.py), the fastest shapes on an H100,
# all of 8 columns and 512-wide K tiles, read qkv, o, gate_up and down at 89, 83, 104 and
# 95 % (cuBLAS: 83, 69, 97, 93 %); this one is among them for o and down.
ONE_ROW = dict(BLOCK_N=8, BLOCK_K=512, num_warps=8, num_stages=4)


@triton.jit
def k_tiles(w_ptr, x_ptr, rn, rs, kk, N, S, K, EVEN_K: tl.constexpr):
    """One K tile of a tiled linear: the weight rows rn [BLOCK_N, BLOCK_K] at w_ptr and the
    activation rows rs [ROWS, BLOCK_K] at x_ptr, columns kk; rows past N or S, and columns
    past K unless EVEN_K, read as 0. Also vt.torch.triton_fp8's tiled kernels'."""
    if EVEN_K:
        w = tl.load(w_ptr, mask=rn[:, None] < N, other=0.0)
        x = tl.load(x_ptr, mask=rs[:, None] < S, other=0.0)
    else:
        w = tl.load(w_ptr, mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        x = tl.load(x_ptr, mask=(rs[:, None] < S) & (kk[None, :] < K), other=0.0)
    return w, x


@triton.jit
def _gemv_kernel(X, W, Y, S, N, K, stride_x, stride_w, stride_y, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, ROWS)
    rk = tl.arange(0, BLOCK_K)
    w_ptr = W + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    x_ptr = X + rs[:, None] * stride_x + rk[None, :]
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, x = k_tiles(w_ptr, x_ptr, rn, rs, k0 + rk, N, S, K, EVEN_K)
        acc += tl.dot(x.to(w.dtype), tl.trans(w))
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    tl.store(Y + rs[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=(rs[:, None] < S) & (rn[None, :] < N))


_even_k = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
# Keyed on the weight's shape, not on S: every S of 2..16 runs the same 16-row tile (rows past
# S masked), so one tuning serves them all, and a server capturing several batch sizes tunes
# each linear once.
_gemv = triton.autotune(configs=_CONFIGS, key=["N", "K"])(_even_k(_gemv_kernel))


@triton.jit
def weight_tile(wrow, nmask, kk, K, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile at columns kk of the weight rows wrow (rows past N masked
    by nmask, columns past K by kk unless EVEN_K)."""
    if EVEN_K:
        return tl.load(wrow + kk[None, :], mask=nmask, other=0.0)
    return tl.load(wrow + kk[None, :], mask=nmask & (kk[None, :] < K), other=0.0)


@triton.jit
def row_cols(X, kk, K, EVEN_K: tl.constexpr):
    """Columns kk of the row at X (those past K 0 unless EVEN_K)."""
    if EVEN_K:
        return tl.load(X + kk)
    return tl.load(X + kk, mask=kk < K, other=0.0)


@_even_k
@triton.jit
def _gemv_one_row(X, W, Y, N, K, stride_w, GLU_OUT: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
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
    # The first tile outside the loop, as ONE_ROW's shape was timed; the form with every
    # tile in the loop has not been timed on its own. No kernel writes the weights, so with
    # PDL their first tile loads before the wait.
    w = weight_tile(wrow, nmask, rk, K, EVEN_K)
    pdl.wait(PDL)
    x = row_cols(X, rk, K, EVEN_K)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = weight_tile(wrow, nmask, k0 + rk, K, EVEN_K)
        x = row_cols(X, k0 + rk, K, EVEN_K)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if GLU_OUT:
        # Rounded to the storage dtype first, as the projection's output is before silu_mul.
        gate, up = tl.split(tl.reshape(acc.to(Y.dtype.element_ty), [BLOCK_N // 2, 2]))
        out = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(Y + out, silu_times(gate, up), mask=out < N)
    else:
        tl.store(Y + rn, acc.to(Y.dtype.element_ty), mask=rn < N)
