"""A Triton linear layer for decode steps of few rows: y = x @ w.T for x [S, K] with S <= 16
and w [N, K] row-major, reading each weight once.

At a few rows a decode step's projections are pure weight reads (S x K x N multiply-adds over
N x K weights), so what matters is how close the kernel's weight reads come to the HBM
bandwidth. Each program owns BLOCK_N output columns over the whole K, so no partial sums go
through memory: its [BLOCK_N, BLOCK_K] weight tiles stream through a software pipeline
(num_stages deep) and meet the [16, BLOCK_K] row tile (rows past S masked to zero) in a
tensor-core dot (one row: a float32 reduction instead). Block shapes are autotuned per (S, N, K) on the first call, which must come
before any capture (a warm-up does it). Accumulation is float32; the output is rounded once
to w's dtype, as torch's bf16 GEMM does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [S, K] @ weight[N, K].T -> [S, N] in weight's dtype (S <= MAX_ROWS)."""
    return _launch(x, weight, x.shape[1], silu_mul=False)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [S, 2K] ([gate | up], as vt.torch.fused.silu_mul takes it,
    with its roundings to the storage dtype), @ weight[N, K].T: the MLP's down projection
    with the activation computed as the rows are read, one kernel instead of two."""
    return _launch(gate_up, weight, gate_up.shape[1] // 2, silu_mul=True)


def _launch(x, weight, K: int, silu_mul: bool):
    S = x.shape[0]
    N = weight.shape[0]
    if S > MAX_ROWS or weight.shape[1] != K or x.shape[1] != (2 * K if silu_mul else K):
        raise ValueError(f"triton_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)}; "
                         f"needs S <= {MAX_ROWS} and matching K")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("triton_gemv: x and weight need a contiguous last dim")
    y = torch.empty(S, N, dtype=weight.dtype, device=weight.device)
    if S:
        _gemv[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
            x, weight, y, S, N, K, x.stride(0), weight.stride(0), y.stride(0),
            ROWS=1 if S == 1 else MAX_ROWS, SILU_MUL=silu_mul)
    return y


_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn in (16, 32, 64) for bk in (128, 256) for w in (4,) for s in (3, 5)]


@triton.autotune(configs=_CONFIGS, key=["S", "N", "K", "SILU_MUL"])
@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
@triton.jit
def _gemv(X, W, Y, S, N, K, stride_x, stride_w, stride_y, ROWS: tl.constexpr,
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
        if SILU_MUL:   # x is the gate; up sits K columns on. torch rounds silu's result first
            up = tl.load(x_ptr + K, mask=x_mask, other=0.0)
            g = x.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(up.dtype).to(tl.float32)
            x = (act * up.to(tl.float32)).to(up.dtype)
        if ROWS == 1:   # one row: a reduction on the CUDA cores (a dot would pad it to 16)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        else:
            acc += tl.dot(x.to(w.dtype), tl.trans(w))
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    tl.store(Y + rs[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=(rs[:, None] < S) & (rn[None, :] < N))
