"""vt.torch.fused: each fused op against an independent float64 formula (CPU path, float32:
1e-5 relative) and, on CUDA or under Triton's CPU interpreter, the kernel against the
plain-torch path on fresh random inputs (bf16 on CUDA: at most one bf16 ulp apart, i.e.
relative 1e-2 elementwise, and 1e-3 relative overall; fp16/fp32 in the interpreter: 2e-3)."""
import os

import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")
pytestmark = pytest.mark.torch_allocator   # PyTorch's caching allocator keeps its blocks

from vt.torch import fused  # noqa: E402

H, KVH, D = 8, 2, 32


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tables(max_context, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(max_context, head_dim // 2, generator=g) * 6.28
    angle = torch.cat((angle, angle), dim=-1)
    return angle.cos(), angle.sin()


def test_add_rms_norm_matches_float64():
    """h = x + delta, and weight * h / rms(h)."""
    x, delta, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    h, out = fused.add_rms_norm(x, delta, w, 1e-6)
    hd = x.double() + delta.double()
    ref = w.double() * hd / (hd.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    assert rel_err(h, hd) < 1e-6 and rel_err(out, ref) < 1e-5
    assert rel_err(fused.rms_norm(x, w, 1e-6),
                   w.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()) < 1e-5


def test_rope_and_cache_rotates_and_writes_only_the_given_slots():
    """q and k rotated pairwise (element i with i + head_dim/2); k and v land in their slots;
    every other cache slot keeps its poison."""
    S, slots = 4, 20
    qkv = torch.randn(S, (H + 2 * KVH) * D)
    cos, sin = tables(16, D, 1)
    pos, slot = torch.tensor([0, 3, 15, 7]), torch.tensor([5, 0, 19, 11])
    kc, vc = torch.full((slots, KVH, D), 123.0), torch.full((slots, KVH, D), 123.0)
    q = fused.rope_and_cache(qkv, pos, cos, sin, kc, vc, slot, heads=H, kv_heads=KVH, head_dim=D)

    def rotate(x):   # [S, n, D] float64, the pairwise rotation written out
        c, s, half = cos[pos].double()[:, None], sin[pos].double()[:, None], D // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c[..., :half] - x2 * s[..., :half],
                          x2 * c[..., half:] + x1 * s[..., half:]), dim=-1)

    qd, kd, vd = qkv.double().split([H * D, KVH * D, KVH * D], dim=-1)
    assert rel_err(q, rotate(qd.view(S, H, D))) < 1e-6
    assert rel_err(kc[slot], rotate(kd.view(S, KVH, D))) < 1e-6
    assert torch.equal(vc[slot], qkv[:, (H + KVH) * D:].view(S, KVH, D))
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot] = False
    assert torch.all(kc[untouched] == 123.0) and torch.all(vc[untouched] == 123.0)


def test_silu_mul_matches_float64():
    gu = torch.randn(3, 2 * 300)
    g, u = gu.double().chunk(2, dim=-1)
    assert rel_err(fused.silu_mul(gu), g * torch.sigmoid(g) * u) < 1e-6


def test_linear_and_linear_silu_mul_match_float64():
    """The CPU forms (F.linear; F.linear then silu_mul), the bias added."""
    x = torch.randn(3, 40)
    w, b = torch.randn(24, 40), torch.randn(24)
    assert rel_err(fused.linear(x, w, b), x.double() @ w.double().T + b.double()) < 1e-6
    w2, b2 = torch.randn(2 * 24, 40), torch.randn(2 * 24)
    g, u = (x.double() @ w2.double().T + b2.double()).chunk(2, dim=-1)
    assert rel_err(fused.linear_silu_mul(x, w2, b2), g * torch.sigmoid(g) * u) < 1e-5


@pytest.mark.parametrize("call,match", [
    (lambda: fused.add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 4), torch.zeros(8), 1e-6), "hidden"),
    (lambda: fused.rms_norm(torch.zeros(2, 8), torch.zeros(8, dtype=torch.float64), 1e-6), "dtype"),
    (lambda: fused.silu_mul(torch.zeros(2, 7)), "2 \\* intermediate"),
    (lambda: fused.rope_and_cache(torch.zeros(2, 10), torch.zeros(2), torch.zeros(4, 2),
                                  torch.zeros(4, 2), torch.zeros(4, 1, 2), torch.zeros(4, 1, 2),
                                  torch.zeros(2), heads=2, kv_heads=1, head_dim=2), "qkv"),
])
def test_bad_arguments_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _kernel_vs_torch(device, dtype, tol):
    """The kernels (device path) against the plain-torch path run on the same inputs."""
    from vt.torch import cpu_ops, triton_fused as tf
    S, hidden, inter = 3, 4096 if device == "cuda" else 96, 14336 if device == "cuda" else 1500
    heads, kvh, hd = (32, 8, 128) if device == "cuda" else (H, KVH, D)

    def randn(*shape):
        return torch.randn(*shape).to(dtype).to(device)

    x, delta, w = randn(S, hidden), randn(S, hidden), randn(hidden)
    h, out = tf.rms_norm(x, delta, w, 1e-5)
    h_ref = x + delta
    assert torch.equal(h, h_ref)
    assert rel_err(out, cpu_ops.rms_norm(h_ref, w, 1e-5)) < tol
    assert rel_err(tf.rms_norm(x, None, w, 1e-5)[1], cpu_ops.rms_norm(x, w, 1e-5)) < tol
    gu = randn(S, 2 * inter)
    gate, up = gu.chunk(2, dim=-1)
    assert rel_err(tf.silu_mul(gu), torch.nn.functional.silu(gate) * up) < tol
    qkv = randn(S, (heads + 2 * kvh) * hd)
    cos, sin = (t.to(device) for t in tables(64, hd, 2))
    pos = torch.tensor([0, 63, 17], device=device)
    slot = torch.tensor([9, 2, 40], device=device)
    kc, vc = randn(48, kvh, hd), randn(48, kvh, hd)
    kc_ref, vc_ref = kc.cpu().clone(), vc.cpu().clone()
    q = tf.rope_and_cache(qkv, pos, cos, sin, kc, vc, slot, heads=heads, kv_heads=kvh, head_dim=hd)
    q_ref = fused.rope_and_cache(qkv.cpu(), pos.cpu(), cos.cpu(), sin.cpu(), kc_ref, vc_ref,
                                 slot.cpu(), heads=heads, kv_heads=kvh, head_dim=hd)
    assert rel_err(q, q_ref) < tol
    assert rel_err(kc, kc_ref) < tol and torch.equal(vc.cpu(), vc_ref)
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[slot.cpu()] = False
    assert torch.equal(kc.cpu()[untouched], kc_ref[untouched])


@pytest.mark.gpu
def test_triton_kernels_match_torch_on_cuda():
    """bf16, the 8B shape's widths."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    _kernel_vs_torch("cuda", torch.bfloat16, 1e-3)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton kernels on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_triton_kernels_in_the_interpreter(dtype):
    pytest.importorskip("triton", reason="the kernels need Triton")
    _kernel_vs_torch("cpu", getattr(torch, dtype), 2e-3)
