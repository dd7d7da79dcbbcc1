"""The Triton kernels over an FP8 KV cache against the CPU reference (vt.torch.cpu_ops and
fused.rope_and_cache's torch form, which test_kv_fp8.py ties to attention over the dequantized
values): the RoPE-and-cache write's codes, the split decode attention, the one-kernel RoPE +
write + decode attention, and the varlen attention. Under Triton's CPU interpreter
(TRITON_INTERPRET=1) in fp16, whose rounding the interpreter shares with torch (the codes must
then be the reference's exactly); on a GPU in bf16 (codes may differ by one e4m3 step where
the kernel's float32 RoPE rounds otherwise than torch's, so a bound on how many)."""
import os

import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")
pytestmark = pytest.mark.torch_allocator

from vt.torch import fused, kv_fp8  # noqa: E402
from vt.torch import paged_attention as pa  # noqa: E402

FP8 = torch.float8_e4m3fn
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the Triton kernels on the CPU only under "
                                        "TRITON_INTERPRET=1")
HEADS, KV_HEADS, HEAD_DIM, BS = 8, 2, 64, 16


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def case(dtype, device, lens, seed=0, scales=(0.5, 0.25)):
    """A decode step over FP8 caches of random codes: (qkv, q, positions, cos, sin, k_cache,
    v_cache, slot_mapping, block_tables, seq_lens, k_scale, v_scale); row n writes position
    lens[n] - 1."""
    g = torch.Generator().manual_seed(seed)
    S, max_blocks = len(lens), 8
    blocks = S * max_blocks + 2
    ks, vs = (torch.tensor(s, device=device) for s in scales)
    k = kv_fp8.quantize(torch.randn(blocks * BS, KV_HEADS, HEAD_DIM, generator=g), ks.cpu())
    v = kv_fp8.quantize(torch.randn(blocks * BS, KV_HEADS, HEAD_DIM, generator=g), vs.cpu())
    tables = torch.randperm(blocks, generator=g)[:S * max_blocks].view(S, max_blocks).int()
    qkv = torch.randn(S, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(dtype)
    q = torch.randn(S, HEADS, HEAD_DIM, generator=g).to(dtype)
    ang = torch.rand(max_blocks * BS, HEAD_DIM // 2, generator=g) * 6.28
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    slots = torch.tensor([int(tables[n, (L - 1) // BS]) * BS + (L - 1) % BS
                          for n, L in enumerate(lens)])
    pos = torch.tensor([L - 1 for L in lens])
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (qkv, q, pos, cos, sin, k, v, slots, tables, lens_t,
                                        ks, vs))


def codes_differing(a, b) -> float:
    return (a.cpu().view(torch.uint8) != b.cpu().view(torch.uint8)).float().mean().item()


def check_kernels(dtype, device, tol, exact_codes):
    from vt.torch import triton_attention, triton_fused
    lens = [1, 17, 100, 128]
    qkv, q, pos, cos, sin, k, v, slots, tables, lens_t, ks, vs = case(dtype, device, lens)
    cpu = [t.cpu() for t in (qkv, q, pos, cos, sin, k, v, slots, tables, lens_t, ks, vs)]
    args = dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    scales = dict(k_scale=ks, v_scale=vs)
    cpu_scales = dict(k_scale=cpu[10], v_scale=cpu[11])

    # the write: rope_and_cache's codes
    kr, vr = cpu[5].clone(), cpu[6].clone()
    q_ref = fused.rope_and_cache(cpu[0], cpu[2], cpu[3], cpu[4], kr, vr, cpu[7], **args,
                                 **cpu_scales)
    kt, vt = k.clone(), v.clone()
    q_got = triton_fused.rope_and_cache(qkv, pos, cos, sin, kt, vt, slots, **args, **scales)
    assert rel_err(q_got, q_ref) < tol
    differ = codes_differing(kt, kr) + codes_differing(vt, vr)
    assert differ == 0 if exact_codes else differ < 1e-3

    # split decode attention over the codes
    want = pa.paged_decode_attention(cpu[1], kr, vr, cpu[8], cpu[9], block_size=BS,
                                     **cpu_scales)
    for splits in (1, 3):
        got = triton_attention.paged_decode(q, kt, vt, tables, lens_t, block_size=BS,
                                            splits=splits, **scales)
        assert got.dtype == dtype and rel_err(got, want) < tol

    # the one kernel: RoPE, the write and decode attention
    k1, v1 = k.clone(), v.clone()
    got = triton_attention.rope_paged_decode(qkv, pos, cos, sin, k1, v1, slots, tables, lens_t,
                                             **args, block_size=BS, splits=2, **scales)
    want = pa.paged_decode_attention(q_ref, kr, vr, cpu[8], cpu[9], block_size=BS, **cpu_scales)
    assert rel_err(got, want) < tol
    differ = codes_differing(k1, kr) + codes_differing(v1, vr)
    assert differ == 0 if exact_codes else differ < 1e-3

    # varlen attention: chunks of 1, 17, 30 and 2 new tokens
    qsl = torch.tensor([0, 1, 18, 48, 50], dtype=torch.int32)
    qv = torch.randn(50, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = pa.paged_varlen_attention(qv, kr, vr, qsl, cpu[9], cpu[8], block_size=BS,
                                     max_query_len=30, **cpu_scales)
    got = triton_attention.paged_varlen(qv.to(device), kt, vt, qsl.to(device), lens_t, tables,
                                        block_size=BS, max_query_len=30, **scales)
    assert rel_err(got, want) < tol


def check_write_rounding(device):
    """The kernel's codes of values at e4m3's edges are torch's: ties to even (1.0625, 3 *
    2^-10 between subnormals, 2^-10 half the smallest subnormal), a round up into the next
    binade (1.9443 -> 2), the clamp (500, -1000), -0.0, subnormals, and random values."""
    from vt.torch import triton_fused
    edges = [1.0625, 1.1875, 3 * 2 ** -10, 2 ** -10, 1.9443, 500.0, -1000.0, -0.0, 0.0,
             2 ** -8, -7 * 2 ** -9, 0.01, 240.0, 247.9, 248.0, 449.0]
    heads, kvh, hd = 1, 1, 32
    values = torch.randn(4 * hd, generator=torch.Generator().manual_seed(1)) * 4
    values[:len(edges)] = torch.tensor(edges)
    S = values.numel() // hd
    qkv = torch.zeros(S, (heads + 2 * kvh) * hd, dtype=torch.float16)
    qkv[:, 2 * hd:] = values.view(S, hd).half()
    pos = torch.zeros(S, dtype=torch.int32)
    cos, sin = torch.ones(4, hd), torch.zeros(4, hd)
    slots = torch.arange(S, dtype=torch.int32)
    one = torch.tensor(1.0)
    kc, vc = (torch.zeros(S, kvh, hd, dtype=FP8, device=device) for _ in range(2))
    to = dict(device=device)
    triton_fused.rope_and_cache(qkv.to(**to), pos.to(**to), cos.to(**to), sin.to(**to), kc, vc,
                                slots.to(**to), heads=heads, kv_heads=kvh, head_dim=hd,
                                k_scale=one.to(**to), v_scale=one.to(**to))
    want = kv_fp8.quantize(qkv[:, 2 * hd:].reshape(S, kvh, hd), one)
    assert torch.equal(vc.cpu().view(torch.uint8), want.view(torch.uint8))


@interpreted
def test_the_kernel_write_rounds_as_torch_in_the_interpreter():
    pytest.importorskip("triton", reason="the kernels need Triton")
    check_write_rounding("cpu")


@pytest.mark.gpu
def test_the_kernel_write_rounds_as_torch_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    check_write_rounding("cuda")


def _compile_sm90(fn, pointers: dict, constexprs: dict, aligned: bool = False) -> str:
    """fn compiled for sm_90 (no GPU needed: Triton's bundled ptxas), its PTX: the pointers
    as typed, strides int32, `scale` float32, every other argument a constexpr. aligned: the
    pointers 16-byte aligned and the strides multiples of 16, as Triton's launcher finds them
    at the 8B shape and specializes the kernel (its loads then vectorize)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {n: pointers.get(n, "fp32" if n == "scale" else "i32" if n.startswith("stride")
                           else "constexpr") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if aligned and (n in pointers or n.startswith("stride"))}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="under TRITON_INTERPRET=1 Triton interprets the kernels and compiles "
                           "none; run without it")
def test_the_fp8_cache_kernels_compile_for_sm_90():
    """Every kernel that writes or reads an FP8 cache compiles for an H100 at the 8B shape
    (bf16, 32 heads, 8 KV heads of 128), the write's division correctly rounded (div.rn) and
    its e4m3 cast the hardware's round-to-nearest one. Needs Triton (not a GPU)."""
    pytest.importorskip("triton", reason="compiling the kernels needs Triton")
    from vt.torch import triton_attention as ta
    from vt.torch import triton_fused as tf
    cache = dict(K="*fp8e4nv", V="*fp8e4nv", KC="*fp8e4nv", VC="*fp8e4nv", K_SCALE="*fp32",
                 V_SCALE="*fp32", BT="*i32", LENS="*i32", ACC="*fp32", STATS="*fp32",
                 QKV="*bf16", Q="*bf16", QOUT="*bf16", OUT="*bf16", POS="*i32", COS="*fp32",
                 SIN="*fp32", SLOT="*i64", QSL="*i32", COUNT="*i32")
    split = dict(BLOCK_N=32, BLOCK_SIZE=16, PRECISION="tf32", FP8_KV=True)
    ptx = _compile_sm90(tf._rope_and_cache, cache, dict(HEADS=32, KV_HEADS=8, HALF=64,
                                                        FP8_KV=True, PDL=False))
    assert "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    for fold in (True, False):
        ptx = _compile_sm90(ta._split, cache, dict(split, GROUP=4, BLOCK_H=16, HEAD_DIM=128,
                                                   SPLITS=8, BLOCK_P=8, FOLD=fold, PDL=not fold,
                                                   PIN_V=True, BY_BITS=True))
        assert ("atom" in ptx) == fold
        ptx = _compile_sm90(ta._rope_split, cache, dict(split, HEADS=32, KV_HEADS=8, GROUP=4,
                                                        BLOCK_H=16, HALF=64, SPLITS=8,
                                                        BLOCK_P=8, FOLD=fold, PDL=not fold,
                                                        BY_BITS=True))
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
        assert ("atom" in ptx) == fold
    shapes = dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, HEADS=32, KV_HEADS=8, HALF=64, PIN_V=True,
                  BY_BITS=True)
    for fn in (ta._split, ta._rope_split):   # FOLD: the merge's order in memory
        _assert_ordered_merge(_compile_sm90(fn, cache, dict(
            split, SPLITS=3, BLOCK_P=4, FOLD=True, PDL=False,
            **{k: v for k, v in shapes.items() if k in fn.arg_names})))
    _compile_sm90(ta._varlen, cache, dict(split, GROUP=4, BLOCK_G=4, BLOCK_M=16, HEAD_DIM=128))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="under TRITON_INTERPRET=1 Triton interprets the kernels and compiles "
                           "none; run without it")
@pytest.mark.parametrize("cache_dtype", ["*bf16", "*fp8e4nv"])
def test_one_row_attention_loads_its_first_cache_tile_before_the_pdl_wait(cache_dtype):
    """_rope_split with PDL (a one-row step's): the span's first tile of K and V, with the
    step's inputs, loads before griddepcontrol.wait, behind the kernel before (the qkv
    projection), and nothing is stored before it. The inputs and tables alone take fewer than
    16 loads a thread; the tile's halves take 32 more. After the wait it loads the qkv
    projection's output, and not an FP8 cache's scales again (each an L2 round trip on the
    step's critical path)."""
    from vt.torch import triton_attention as ta
    fp8 = cache_dtype != "*bf16"
    ptx = _one_row_ptx("*bf16", cache_dtype, by_bits=fp8, aligned=False)
    before, after = ptx.split("griddepcontrol.wait", 1)
    assert "st.global" not in before
    assert sum("ld.global" in line for line in before.splitlines()) > 48
    assert "ld.global" in after   # the qkv projection's output
    for name in ("K_SCALE", "V_SCALE") if fp8 else ():
        param = f"[_rope_split_param_{ta._rope_split.arg_names.index(name)}]"
        (reg,) = [line.split()[1].rstrip(",") for line in before.splitlines() if param in line]
        assert f"[ {reg} + 0 ]" not in after, name


def _one_row_ptx(dtype: str, cache_dtype: str, *, by_bits: bool, aligned: bool) -> str:
    """_rope_split's PTX as a one-row step of the 8B shape launches it (64 spans, PDL), for a
    model of `dtype` ("*bf16", "*fp16") over a cache of `cache_dtype` ("*fp8e4nv": FP8),
    BY_BITS as given; aligned: as _compile_sm90's."""
    pytest.importorskip("triton", reason="compiling the kernels needs Triton")
    from vt.torch import triton_attention as ta
    pointers = dict(K=cache_dtype, V=cache_dtype, K_SCALE="*fp32", V_SCALE="*fp32", BT="*i32",
                    LENS="*i32", ACC="*fp32", STATS="*fp32", QKV=dtype, OUT=dtype, POS="*i32",
                    COS="*fp32", SIN="*fp32", SLOT="*i64", COUNT="*i32")
    return _compile_sm90(ta._rope_split, pointers, dict(
        BLOCK_N=ta.BLOCK_N, BLOCK_SIZE=16, PRECISION="tf32", FP8_KV=cache_dtype == "*fp8e4nv",
        HEADS=32, KV_HEADS=8, GROUP=4, BLOCK_H=16, HALF=64, SPLITS=64, BLOCK_P=64, FOLD=False,
        PDL=True, BY_BITS=by_bits), aligned=aligned)


def _long_tile_split_ptx(dtype: str, **switches) -> str:
    """_split's PTX over an FP8 cache at the 32-row tile (128 keys) of the 8B shape's group,
    for a model of `dtype` ("*bf16", "*fp16"), compiled as the launcher specializes it
    (aligned), with `switches` (PIN_V, BY_BITS) set."""
    pytest.importorskip("triton", reason="compiling the kernels needs Triton")
    from vt.torch import triton_attention as ta
    pointers = dict(K="*fp8e4nv", V="*fp8e4nv", K_SCALE="*fp32", V_SCALE="*fp32", BT="*i32",
                    LENS="*i32", ACC="*fp32", STATS="*fp32", Q=dtype, OUT=dtype, COUNT="*i32")
    shape = dict(BLOCK_N=ta.LONG_BLOCK_N, BLOCK_SIZE=16, PRECISION="tf32", FP8_KV=True,
                 GROUP=4, BLOCK_H=16, HEAD_DIM=128, SPLITS=3, BLOCK_P=4, FOLD=True, PDL=True)
    return _compile_sm90(ta._split, pointers, dict(shape, **switches), aligned=True)


def test_split_attention_reads_an_fp8_v_tile_with_16_byte_loads():
    """_split over an FP8 cache at the 32-row tile (128 keys), as launched on CUDA (PIN_V):
    V's tile converts as loaded and reaches the P @ V dot through ldmatrix.trans, with no
    one-byte shared-memory load; without the pin Triton reads the codes one byte at a time
    (this test's detector)."""
    pinned, unpinned = (_long_tile_split_ptx("*bf16", PIN_V=pin, BY_BITS=True)
                        for pin in (True, False))
    assert "ld.shared.b8" in unpinned
    assert "ld.shared.b8" not in pinned and "ldmatrix.sync.aligned.m8n8.x4.trans" in pinned


@pytest.mark.gpu
def test_the_pinned_fp8_v_tile_matches_the_unpinned_on_cuda(monkeypatch):
    """paged_decode over an FP8 cache at 32 rows, V's tile pinned (as shipped) and not: the
    same products, summed in another order by the dot, so the outputs agree within two bf16
    rounding steps (rtol 2^-7), not bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    from test_paged_attention import random_case
    from vt.torch import triton_attention as ta
    q, k, v, tables, lens = random_case(32, 32, 8, 128, 16, 40, [1 + 19 * i for i in range(32)],
                                        torch.bfloat16, "cuda", 5)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    one = torch.ones(1, device="cuda")
    outs = []
    for pin in (True, False):
        monkeypatch.setattr(ta, "PIN_FP8_V", pin)
        outs.append(ta.paged_decode(q, k8, v8, tables, lens, block_size=16, splits=3,
                                    k_scale=one, v_scale=one * 0.5))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2 ** -7, atol=1e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="under TRITON_INTERPRET=1 Triton interprets the kernels and compiles "
                           "none; run without it")
@pytest.mark.parametrize("dtype,multiply", [("*bf16", "mul.rn.bf16x2"), ("*fp16", "mul.rn.f16x2")])
@pytest.mark.parametrize("kernel", ["split", "one-row"])
def test_attention_converts_fp8_codes_with_integer_instructions(dtype, multiply, kernel):
    """_split (32 rows) and _rope_split (one row) over an FP8 cache, as launched on CUDA for
    a bf16 or fp16 model (BY_BITS): no conversion from e4m3, the codes' bits permuted and one
    multiply a pair; without BY_BITS Triton's cvt from e4m3 pairs (this test's detector).
    _rope_split still converts to e4m3 (cvt.rn.satfinite.e4m3x2.f32): the key and value it
    writes."""
    ptx = ((lambda b: _long_tile_split_ptx(dtype, PIN_V=True, BY_BITS=b)) if kernel == "split"
           else (lambda b: _one_row_ptx(dtype, "*fp8e4nv", by_bits=b, aligned=True)))
    by_bits, by_cvt = ptx(True), ptx(False)
    assert "cvt.rn.f16x2.e4m3x2" in by_cvt
    assert "cvt.rn.f16x2.e4m3x2" not in by_bits and "prmt.b32" in by_bits and multiply in by_bits


def _run_ptx(asm: str, operands: dict) -> dict:
    """The few PTX instructions of vt.torch.triton_attention's e4m3 conversion, run on 32-bit
    Python ints (operands: $N -> value); returns the registers."""
    regs = dict(operands)

    def val(tok):
        tok = tok.strip()
        return int(tok, 0) if tok[0].isdigit() else regs[tok]

    def mul16(a, b, dtype):   # lane by lane in the dtype, correctly rounded (torch)
        lanes = [torch.tensor([(x >> s) & 0xFFFF for x in (a, b)], dtype=torch.int32)
                 .to(torch.int16).view(dtype) for s in (0, 16)]
        return sum(((lo * hi).view(torch.int16).item() & 0xFFFF) << s
                   for (lo, hi), s in zip(lanes, (0, 16)))

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        x = [val(a) for a in src]
        if op == "prmt.b32":
            pool = [(x[0] >> 8 * i) & 0xFF for i in range(4)] + [(x[1] >> 8 * i) & 0xFF
                                                               for i in range(4)]
            regs[dst] = sum(pool[(x[2] >> 4 * i) & 7] << 8 * i for i in range(4))
        elif op == "and.b32":
            regs[dst] = x[0] & x[1]
        elif op == "shr.b32":
            regs[dst] = x[0] >> x[1]
        elif op == "mov.b32":
            regs[dst] = x[0]
        elif op == "lop3.b32":
            regs[dst] = sum(((x[3] >> ((((x[0] >> i) & 1) << 2) | (((x[1] >> i) & 1) << 1)
                                       | ((x[2] >> i) & 1))) & 1) << i for i in range(32))
        elif op in ("mul.rn.bf16x2", "mul.rn.f16x2"):
            regs[dst] = mul16(x[0], x[1], torch.bfloat16 if "bf16" in op else torch.float16)
        else:
            raise AssertionError(f"unknown instruction {op}")
    return regs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_bit_conversion_gives_every_finite_codes_value(dtype):
    """The inline PTX that converts e4m3 codes to bf16 / fp16 (four codes a register, two
    outputs of two), run instruction by instruction on the CPU over all 256 codes: each
    finite code's value exactly, as torch converts it (the GPU test checks the kernel)."""
    pytest.importorskip("triton", reason="the kernels need Triton")
    from vt.torch import triton_attention as ta
    asm = (ta._E4M3_AS_BF16 if dtype == torch.bfloat16 else ta._E4M3_AS_F16).value
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    expected = codes.view(torch.float8_e4m3fn).to(dtype).view(torch.int16)
    for first in range(0, 256, 4):
        word = sum(int(codes[first + i]) << 8 * i for i in range(4))
        regs = _run_ptx(asm, {"$2": word})
        got = [(regs[out] >> s) & 0xFFFF for out in ("$0", "$1") for s in (0, 16)]
        for i, bits in enumerate(got):
            code = first + i
            if code & 0x7F != 0x7F:   # NaN codes read as +-480 (the kernel's docstring)
                assert bits == int(expected[code]) & 0xFFFF, hex(code)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_codes_by_bits_give_the_same_bits_on_cuda(monkeypatch, dtype):
    """paged_decode over an FP8 cache holding every finite e4m3 code (both zeros and the
    subnormals included) in K and V, the codes converted by bits (as shipped) and by Triton's
    conversion: the same output bit for bit, at 32 rows (the 128-key tile) and at 2."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    from test_paged_attention import random_case
    from vt.torch import triton_attention as ta
    finite = torch.arange(256, dtype=torch.int32)
    finite = finite[(finite & 0x7F) != 0x7F].to(torch.uint8)          # 254 codes: no NaN
    for rows in (32, 2):
        q, k, v, tables, lens = random_case(rows, 32, 8, 128, 16, 40,
                                            [1 + 19 * i for i in range(rows)], dtype, "cuda", 7)
        g = torch.Generator(device="cpu").manual_seed(rows)
        codes = finite[torch.randint(0, len(finite), (2,) + k.shape, generator=g)]
        k8, v8 = (c.view(torch.float8_e4m3fn).cuda() for c in codes)
        one = torch.ones(1, device="cuda")
        outs = []
        for by_bits in (True, False):
            monkeypatch.setattr(ta, "FP8_CODES_BY_BITS", by_bits)
            outs.append(ta.paged_decode(q, k8, v8, tables, lens, block_size=16, splits=3,
                                        k_scale=one * 0.25, v_scale=one * 0.5))
        assert outs[0].isfinite().all()
        assert torch.equal(outs[0], outs[1]), rows


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_fp8_codes_by_bits_give_the_same_bits_on_cuda(monkeypatch, dtype):
    """rope_paged_decode (the one-row kernel) over an FP8 cache holding every finite e4m3
    code in K and V, the codes converted by bits (as shipped) and by Triton's conversion: the
    same output and the same cache, bit for bit, at a row's first position and at its 100th
    (four spans)."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    from vt.torch import triton_attention as ta
    finite = torch.arange(256, dtype=torch.int32)
    finite = finite[(finite & 0x7F) != 0x7F].to(torch.uint8)          # 254 codes: no NaN
    for live in (1, 100):
        qkv, _, pos, cos, sin, k, v, slots, tables, lens, ks, vs = case(dtype, "cuda", [live])
        g = torch.Generator(device="cpu").manual_seed(live)
        codes = finite[torch.randint(0, len(finite), (2,) + k.shape, generator=g)]
        k8, v8 = (c.view(FP8).cuda() for c in codes)
        outs = []
        for by_bits in (True, False):
            monkeypatch.setattr(ta, "FP8_CODES_BY_BITS", by_bits)
            kc, vc = k8.clone(), v8.clone()
            out = ta.rope_paged_decode(qkv, pos, cos, sin, kc, vc, slots, tables, lens,
                                       heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                       block_size=BS, splits=4, k_scale=ks, v_scale=vs)
            outs.append((out, kc.view(torch.uint8), vc.view(torch.uint8)))
        assert outs[0][0].isfinite().all()
        for a, b in zip(*outs):
            assert torch.equal(a, b), live


def _assert_ordered_merge(ptx: str) -> None:
    """The split kernels' merge (vt.torch.triton_attention._merge_group): a CTA barrier, then
    the span count's add with acquire-release order at GPU scope, and the other spans'
    workspace read through L2 (ld.global.cg), not a stale L1 line."""
    assert "bar.sync" in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx or "atom.acq_rel.gpu.global.add" in ptx, \
        [line for line in ptx.splitlines() if "atom" in line]
    assert "ld.global.cg" in ptx


@interpreted
def test_fp8_cache_kernels_in_the_interpreter():
    pytest.importorskip("triton", reason="the kernels need Triton")
    check_kernels(torch.float16, "cpu", 2e-3, exact_codes=True)


@pytest.mark.gpu
def test_fp8_cache_kernels_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    check_kernels(torch.bfloat16, "cuda", 2e-2, exact_codes=False)


@pytest.mark.gpu
def test_an_fp8_kv_decoder_on_cuda_matches_the_cpu_reference():
    """A tiny bf16 decoder with an FP8 KV cache (head_dim 32: the one-row kernel too): its
    position-by-position logits on CUDA within 3e-2 of the CPU reference's, and on CUDA the
    captured ring steps (flat prompt steps, vt's kernels) give the greedy tokens of the same
    module called eagerly."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    import dataclasses

    from vt.backend import get_backend
    from vt.torch.llama import LlamaDecoder

    from _torch_util import GEO, TINY, eager_greedy, generate, prompts, step_model
    from test_kv_fp8 import position_logits
    cfg = dataclasses.replace(TINY, qk_norm=False, head_dim=32)
    torch.manual_seed(0)
    models = [LlamaDecoder(cfg, GEO, dtype=torch.bfloat16, device=d, kv_cache_dtype="fp8")
              for d in ("cpu", "cuda")]
    with torch.no_grad():
        for p in models[0].parameters():
            if p.ndim == 2:
                p.normal_(0.0, 2.0 / p.shape[1] ** 0.5)
    models[1].load_state_dict(models[0].state_dict())
    tokens = [1, 5, 9, 17, 33, 65, 2, 3]
    cpu, cuda = (position_logits(m, tokens).cpu() for m in models)
    assert rel_err(cuda, cpu) < 3e-2
    ps = prompts(3, seed=2, max_len=8)
    expect = [eager_greedy(models[1], p, 5) for p in ps]
    be = get_backend("cuda")
    try:
        assert generate(be, step_model(be, models[1]), "ring", ps, 5) == expect
    finally:
        be.close()
