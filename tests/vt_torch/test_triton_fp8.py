"""vt.torch.triton_fp8: the FP8-weight GEMV against vt.torch.fp8.reference_linear (the CPU's
FP8 linear) and float64 of the dequantized weights: per-channel and 128 x 128 block scales,
1 to 256 rows (every row tile, partial tiles too), widths that fill no block evenly. On a GPU
at the 8B shape's widths in bf16; under Triton's CPU interpreter (TRITON_INTERPRET=1) in fp16,
whose rounding the interpreter shares with torch. The W8A8 linear (16 rows and more) against
reference_scaled_linear, in the interpreter and on a GPU. The CUDA prompt-step linears
(dequantize, scaled_mm) and a captured FP8 decode step are GPU tests; their sim twins are
tests/vt_torch/test_fp8_load.py's."""
import os

import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")
pytestmark = pytest.mark.torch_allocator

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the Triton kernel on the CPU only under "
                                        "TRITON_INTERPRET=1")


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _weight(N, K, per_block, device):
    from vt.torch import fp8
    w = torch.randn(N, K, device=device) * K ** -0.5
    return fp8.quantize_block(w) if per_block else fp8.quantize_per_channel(w)


def check(x, per_block, N, tol):
    from vt.torch import cpu_ops, fp8, triton_fp8
    K = x.shape[1]
    w = _weight(N, K, per_block, x.device)
    got = triton_fp8.linear(x, w.data, w.scale)
    exact = x.double() @ fp8.dequantize(w).double().T
    assert got.dtype == x.dtype and rel_err(got, exact) < tol
    assert rel_err(got, fp8.reference_linear(x, w)) < tol
    if x.shape[0] == 1:
        gu = _weight(2 * 256, K, per_block, x.device)
        want = cpu_ops.silu_mul(fp8.reference_linear(x, gu))
        assert rel_err(triton_fp8.linear_silu_mul(x, gu.data, gu.scale), want) < tol


@interpreted
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
@pytest.mark.parametrize("per_block", [False, True], ids=["channel", "block"])
@pytest.mark.parametrize("S", [1, 3, 20, 70])
def test_fp8_gemv_in_the_interpreter(S, per_block, wide, monkeypatch):
    """fp16, N = 200 and K = 1000 (partial tiles and blocks): within 1e-3 of float64; `wide`
    runs the tiles of wide projections (WIDE_N lowered to 200)."""
    pytest.importorskip("triton", reason="the kernel needs Triton")
    from vt.torch import triton_fp8
    if wide:
        monkeypatch.setattr(triton_fp8, "WIDE_N", 200)
    torch.manual_seed(S)
    check(torch.randn(S, 1000, dtype=torch.float16), per_block, 200, tol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("per_block", [False, True], ids=["channel", "block"])
@pytest.mark.parametrize("S", [1, 3, 8, 16, 32, 48, 128, 256])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 14336), (28672, 4096), (77, 1000)])
def test_fp8_gemv_matches_the_reference(S, N, K, per_block):
    """bf16 rows (rounded once: ulp 2**-8) within 1e-2 of float64 and of the reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    check(torch.randn(S, K, device="cuda", dtype=torch.bfloat16), per_block, N, tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("prompt_linear", ["dequantize", "scaled_mm"])
def test_prompt_step_linears_match_the_reference(prompt_linear):
    """More rows than the GEMV holds: dequantize-then-cuBLAS within 1e-2 of the reference;
    scaled_mm (activations quantized per token to e4m3 too) within 6e-2."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from vt.torch import fp8
    torch.manual_seed(0)
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    w = _weight(1024, 4096, False, "cuda")
    got = fp8.linear(x, w, prompt_linear=prompt_linear)
    tol = 6e-2 if prompt_linear == "scaled_mm" else 1e-2
    assert rel_err(got, fp8.reference_linear(x, w)) < tol


@pytest.mark.gpu
def test_fp8_decoder_on_cuda_matches_the_cpu_reference():
    """A tiny FP8 decoder in bf16: CUDA's greedy tokens (captured decode on vt's kernels) equal
    the CPU reference's, and its one-row logits are within 2e-2 of them."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from vt.torch.llama import LlamaConfig, LlamaDecoder, quantize_weights_
    from vt.step import KVGeometry
    from test_fp8_load import position_logits
    cfg = LlamaConfig(vocab=128, hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2,
                      head_dim=32)
    geo = KVGeometry(max_seqs=2, num_kv_blocks=8, block_size=4, max_context=16)
    torch.manual_seed(0)
    dense = {k: (torch.randn_like(v) * v.shape[-1] ** -0.5 if v.dim() == 2 else v)
             for k, v in LlamaDecoder(cfg, geo, dtype=torch.float32, device="cpu")
             .state_dict().items()}
    models = []
    for device in ("cpu", "cuda"):
        m = LlamaDecoder(cfg, geo, dtype=torch.bfloat16, device=device, quantization="fp8")
        quantize_weights_(m, dense)
        models.append(m)
    tokens = [1, 5, 9, 17, 33, 65]
    cpu = position_logits(models[0], tokens)
    cuda = position_logits(models[1], tokens).cpu()
    assert rel_err(cuda, cpu) < 2e-2


def _activations(M, K, device, dtype):
    x = torch.randn(M, K, device=device, dtype=dtype) * 3
    x[1] = 0          # an all-zero row: scale 1, codes 0
    x[2, 0] = 1e4     # one outlier: the row's other values go subnormal or to zero
    return x


def check_quantize_rows(x, codes_too=True):
    from vt.torch import fp8, triton_fp8
    codes, scale = triton_fp8.quantize_rows(x)
    want_codes, want_scale = fp8.quantize_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (x.shape[0], 1)
    assert torch.equal(scale, want_scale)
    if codes_too:
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


@interpreted
@pytest.mark.parametrize("K", [1000, 20000])
def test_quantize_rows_in_the_interpreter(K):
    """The scales bit for bit fp8.quantize_rows' (the eager version), a row read once into
    registers (K = 1000) and one read twice in K tiles (K = 20000, a partial last tile). Not
    the codes: the interpreter's float32 -> e4m3 cast rounds a value that carries
    into the next binade down to half of it (127.3 -> 64), which the GPU's cast does not; the
    GPU test compares the codes."""
    pytest.importorskip("triton", reason="the kernel needs Triton")
    torch.manual_seed(0)
    check_quantize_rows(_activations(5, K, "cpu", torch.float16), codes_too=False)


def test_the_kernels_limits_are_the_callers():
    pytest.importorskip("triton", reason="the kernel needs Triton")
    from vt.torch import fp8, triton_fp8
    assert (triton_fp8.MAX_ROWS, triton_fp8.FP8_MAX) == (fp8.GEMV_MAX_ROWS, fp8.FP8_MAX)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [4096, 14336, 1000, 20000])
def test_quantize_rows_matches_the_eager_quantization(K):
    """bf16 prompt activations at the 8B shape's widths (rows read once) and past
    QUANT_ONE_PASS_K (read twice): codes and scales bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(K)
    check_quantize_rows(_activations(300, K, "cuda", torch.bfloat16))


def test_the_cpu_quantizes_activations_where_cuda_does():
    """A per-channel weight's linear quantizes the activations too (reference_scaled_linear)
    from W8A8_MIN_ROWS rows on the CPU, as on CUDA: up to GEMV_MAX_ROWS whatever the prompt
    linear, past it with "scaled_mm" only; fewer rows and a block-scaled weight keep the
    weight-only reference. The two differ by no more than e4m3's rounding of x allows."""
    from vt.torch import fp8
    torch.manual_seed(0)
    w = _weight(64, 256, False, "cpu")
    many = torch.randn(fp8.GEMV_MAX_ROWS + 1, 256)
    most, least = fp8.GEMV_MAX_ROWS, fp8.W8A8_MIN_ROWS
    for rows, prompt_linear, quantized in (
            (most + 1, "scaled_mm", True), (most + 1, "dequantize", False),
            (most, "dequantize", True), (least, "scaled_mm", True),
            (least - 1, "scaled_mm", False), (1, "scaled_mm", False)):
        x = many[:rows]
        got = fp8.linear(x, w, prompt_linear=prompt_linear)
        want = (fp8.reference_scaled_linear if quantized else fp8.reference_linear)(x, w)
        assert torch.equal(got, want), (rows, prompt_linear)
    scaled, plain = fp8.reference_scaled_linear(many, w), fp8.reference_linear(many, w)
    assert not torch.equal(scaled, plain) and rel_err(scaled, plain) < 6e-2
    blocked = _weight(256, 256, True, "cpu")
    assert torch.equal(fp8.linear(many[:32], blocked), fp8.reference_linear(many[:32], blocked))
    with pytest.raises(ValueError, match="prompt_linear='fast'"):
        fp8.linear(many, w, prompt_linear="fast")


def check_w8a8(x, N, tol, quantize):
    """w8a8_linear (or, on the interpreter, its kernel on the eager quantization's codes)
    against reference_scaled_linear, which differs only in the summation order."""
    from vt.torch import fp8, triton_fp8
    w = _weight(N, x.shape[1], False, x.device)
    if quantize:
        got = triton_fp8.w8a8_linear(x, w.data, w.scale)
    else:
        xq, x_scale = fp8.quantize_rows(x)
        got = triton_fp8.scaled_rows_linear(xq, x_scale, w.data, w.scale, x.dtype)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], N)
    assert rel_err(got, fp8.reference_scaled_linear(x, w)) < tol


@interpreted
@pytest.mark.parametrize("S", [2, 16, 20, 70])
def test_w8a8_kernel_in_the_interpreter(S):
    """fp16, N = 200 and K = 1000 (partial tiles, more than one row tile at 70): within 1e-3
    of the reference (fp16's ulp is 2**-11)."""
    pytest.importorskip("triton", reason="the kernel needs Triton")
    torch.manual_seed(S)
    check_w8a8(torch.randn(S, 1000, dtype=torch.float16), 200, tol=1e-3, quantize=False)


@pytest.mark.gpu
@pytest.mark.parametrize("S", [16, 17, 32, 64, 65, 128, 256])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 14336), (28672, 4096), (77, 1000)])
def test_w8a8_linear_matches_the_scaled_reference(S, N, K):
    """bf16 rows quantized on the GPU (quantize_rows' codes equal the eager ones, tested
    above): within 1e-2 of reference_scaled_linear (bf16's ulp is 2**-8)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(S)
    check_w8a8(torch.randn(S, K, device="cuda", dtype=torch.bfloat16), N, tol=1e-2,
               quantize=True)


def check_norm_quantize_rows(S, hidden, device, dtype):
    """norm_quantize_rows against rms_norm then quantize_rows (the two kernels it fuses), bit
    for bit: the residual sum, the codes and the scales; with and without delta."""
    from vt.torch import triton_fp8, triton_fused
    g = torch.Generator().manual_seed(S)
    x, delta = (torch.randn(S, hidden, generator=g).to(device, dtype) for _ in range(2))
    weight = (1 + torch.randn(hidden, generator=g) / 4).to(device, dtype)
    for d in (delta, None):
        h, codes, scale = triton_fp8.norm_quantize_rows(x, d, weight, 1e-5)
        want_h, normed = triton_fused.rms_norm(x, d, weight, 1e-5)
        want_codes, want_scale = triton_fp8.quantize_rows(normed)
        assert (h is None) == (d is None) and (h is None or torch.equal(h, want_h))
        assert torch.equal(scale, want_scale)
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


def check_silu_mul_quantize_rows(S, inter, device, dtype):
    """silu_mul_quantize_rows against silu_mul then quantize_rows, bit for bit."""
    from vt.torch import triton_fp8, triton_fused
    g = torch.Generator().manual_seed(S)
    gate_up = (torch.randn(S, 2 * inter, generator=g) * 3).to(device, dtype)
    codes, scale = triton_fp8.silu_mul_quantize_rows(gate_up)
    want_codes, want_scale = triton_fp8.quantize_rows(triton_fused.silu_mul(gate_up))
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


@interpreted
def test_fused_quantizations_in_the_interpreter():
    pytest.importorskip("triton", reason="the kernels need Triton")
    check_norm_quantize_rows(5, 1000, "cpu", torch.float16)
    check_silu_mul_quantize_rows(3, 1000, "cpu", torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("S", [16, 32, 300])
def test_fused_quantizations_are_the_two_kernels_bit_for_bit(S):
    """At the 8B shape's widths: the norm (hidden 4,096) and the SiLU product (14,336)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    check_norm_quantize_rows(S, 4096, "cuda", torch.bfloat16)
    check_silu_mul_quantize_rows(S, 14336, "cuda", torch.bfloat16)


def test_quantized_rows_give_the_linear_its_own_quantization():
    """A projection handed its rows already quantized (add_norm_quantized's Fp8Rows, and
    linear_silu_mul's product after such rows) computes what it computes from the rows, bit
    for bit, where it quantizes them itself (from W8A8_MIN_ROWS rows); below that the rows go
    over as they are. A block-scaled weight refuses quantized rows in one line. On the CPU
    (the sim's path)."""
    from functools import partial

    from vt.torch import fp8
    from vt.torch.llama import RMSNorm, fused_add_norm
    torch.manual_seed(0)
    w, w_down = _weight(64, 256, False, "cpu"), _weight(256, 32, False, "cpu")
    norm = RMSNorm(256, 1e-5).bfloat16()
    add_norm = partial(fused_add_norm, invariant=False)
    for rows in (fp8.W8A8_MIN_ROWS - 1, fp8.W8A8_MIN_ROWS, 40):
        x, delta = torch.randn(rows, 256).bfloat16(), torch.randn(rows, 256).bfloat16()
        want_x, normed = add_norm(x, delta, norm)
        got_x, rows_in = fp8.add_norm_quantized(x, delta, norm, add_norm=add_norm,
                                                vt_kernels=True)
        assert torch.equal(got_x, want_x)
        assert isinstance(rows_in, fp8.Fp8Rows) == (rows >= fp8.W8A8_MIN_ROWS)
        assert torch.equal(fp8.linear(rows_in, w), fp8.linear(normed, w))
        # gate_up's SiLU product, handed to down quantized where its rows came so
        act_in = fp8.linear_silu_mul(rows_in, w, dense_silu=None)
        act = fp8.linear_silu_mul(normed, w, dense_silu=None)
        assert isinstance(act_in, fp8.Fp8Rows) == (rows >= fp8.W8A8_MIN_ROWS)
        assert torch.equal(fp8.linear(act_in, w_down), fp8.linear(act, w_down))
    with pytest.raises(ValueError, match="need a per-channel FP8 weight"):
        fp8.linear(rows_in, _weight(256, 256, True, "cpu"))
