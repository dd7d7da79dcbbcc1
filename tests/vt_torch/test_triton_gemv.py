"""vt.torch.triton_gemv: the Triton linear for few rows against a float64 reference on fresh
random bf16 inputs: 1e-2 relative overall (the output is rounded once to bf16, whose ulp is
2**-8 ~ 4e-3), at the 8B shape's widths and at widths that fill no block evenly. The one-row
kernel (no autotuning, so it runs there) also under Triton's CPU interpreter, in fp16: 2e-3."""
import os

import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")
pytestmark = pytest.mark.torch_allocator   # PyTorch's caching allocator keeps its blocks


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1, 3, 8, 16])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 14336), (77, 1000)])
def test_triton_linear_matches_float64(S, N, K):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    from vt.torch import triton_gemv
    x = torch.randn(S, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    y = triton_gemv.linear(x, w)
    assert y.shape == (S, N) and y.dtype == torch.bfloat16
    assert rel_err(y, x.double() @ w.double().T) < 1e-2


def check_linear_silu_mul(x, w, tol):
    """triton_gemv.linear_silu_mul(x, w): bit for bit silu_mul of the one-row linear (the
    same tile sums, the same roundings), and within tol of float64 of fused.silu_mul's
    roundings."""
    from vt.torch import fused, triton_gemv
    y = triton_gemv.linear_silu_mul(x, w)
    gate_up = triton_gemv.linear(x, w)
    assert y.shape == (1, w.shape[0] // 2) and y.dtype == w.dtype
    assert torch.equal(y, fused.silu_mul(gate_up))
    g, u = (x.double() @ w.double().T).chunk(2, dim=-1)
    assert rel_err(y, g * torch.sigmoid(g) * u) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("I,K", [(14336, 4096), (77, 1000)])
def test_linear_silu_mul_is_silu_mul_of_the_linear(I, K):
    """The 8B shape's gate_up, and an intermediate and K that fill no block evenly."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * I, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    check_linear_silu_mul(x, w, tol=1e-2)


@pytest.mark.gpu
def test_triton_linear_refuses_more_rows_than_it_holds():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    from vt.torch import triton_gemv
    x = torch.zeros(triton_gemv.MAX_ROWS + 1, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="S <= 16"):
        triton_gemv.linear(x, torch.zeros(32, 64, device="cuda", dtype=torch.bfloat16))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton kernel on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("N,K", [(77, 1000), (40, 1536)])
def test_one_row_kernel_in_the_interpreter(N, K):
    """linear and linear_silu_mul at one row, fp16 (the interpreter's bf16 rounding is not
    torch's), against float64 of the same inputs: K = 1000 leaves the last K tile partial."""
    pytest.importorskip("triton", reason="the kernel needs Triton")
    from vt.torch import triton_gemv
    x = torch.randn(1, K, dtype=torch.float16)
    w = (torch.randn(N, K) * K ** -0.5).to(torch.float16)
    assert rel_err(triton_gemv.linear(x, w), x.double() @ w.double().T) < 2e-3
    check_linear_silu_mul(x, (torch.randn(2 * N, K) * K ** -0.5).to(torch.float16), tol=2e-3)
