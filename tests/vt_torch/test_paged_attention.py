"""vt.torch.paged_attention: decode attention over each row's live KV tokens, checked against
a float64 reference and the dense masked reference on fresh random inputs. Tolerances
(relative Frobenius error): float32 1e-5; bf16 storage 1e-2 (bf16 operands, float32 sums);
fp16 under Triton's CPU interpreter 2e-3."""
import math
import os

import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt[torch])")

from vt.torch import paged_attention as pa  # noqa: E402


def random_case(S, heads, kv_heads, head_dim, block_size, max_blocks, lens, dtype, device="cpu",
                seed=0):
    """q, caches (every slot random), per-row block tables of distinct random blocks, lens."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = S * max_blocks + 3
    slots = num_blocks * block_size

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    q = randn(S, heads, head_dim)
    k, v = randn(slots, kv_heads, head_dim), randn(slots, kv_heads, head_dim)
    tables = torch.randperm(num_blocks, generator=g)[:S * max_blocks].view(S, max_blocks)
    return (q, k, v, tables.int().to(device), torch.tensor(lens, dtype=torch.int32).to(device))


def float64_reference(q, k, v, tables, lens, block_size):
    """Head by head, in float64, over the live slots only."""
    S, heads, head_dim = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for n in range(S):
        slots = pa.live_slots(tables[n].cpu(), int(lens[n]), block_size)
        for h in range(heads if len(slots) else 0):
            keys = k.cpu()[slots, h // group].double()
            vals = v.cpu()[slots, h // group].double()
            p = torch.softmax(keys @ q[n, h].cpu().double() / math.sqrt(head_dim), 0)
            out[n, h] = p @ vals
    return out


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("heads,kv_heads,block_size", [(4, 4, 4), (8, 2, 16), (32, 8, 16)])
def test_torch_path_matches_float64_and_dense(heads, kv_heads, block_size):
    """The CPU path equals the float64 reference and the dense masked reference (float32)."""
    lens = [1, 37, 0, 5 * block_size, 3]
    case = random_case(5, heads, kv_heads, 32, block_size, 10, lens, torch.float32, seed=heads)
    out = pa.paged_decode_attention(*case, block_size=block_size)
    assert out.shape == case[0].shape and out.dtype == torch.float32
    assert rel_err(out, float64_reference(*case, block_size)) < 1e-5
    assert rel_err(out, pa.dense_decode_attention(*case, block_size=block_size)) < 1e-5
    assert torch.all(out[2] == 0), "a row without tokens gets zeros"


def test_torch_path_reads_only_live_slots():
    """NaN in every slot that no row's live tokens use leaves the output unchanged."""
    bs, lens = 4, [6, 1, 13]
    q, k, v, tables, lens_t = random_case(3, 8, 2, 16, bs, 5, lens, torch.float32, seed=3)
    clean = pa.paged_decode_attention(q, k, v, tables, lens_t, block_size=bs)
    live = torch.cat([pa.live_slots(tables[n], lens[n], bs) for n in range(3)])
    dead = torch.ones(k.shape[0], dtype=torch.bool)
    dead[live] = False
    k[dead], v[dead] = float("nan"), float("nan")
    poisoned = pa.paged_decode_attention(q, k, v, tables, lens_t, block_size=bs)
    assert torch.equal(poisoned, clean)
    assert torch.isnan(pa.dense_decode_attention(q, k, v, tables, lens_t, block_size=bs)).any(), \
        "the dense reference reads the dead slots (else the poison proves nothing)"


def test_torch_path_bf16_within_tolerance():
    """bf16 storage: within 1e-2 of float64."""
    case = random_case(4, 32, 8, 128, 16, 8, [17, 128, 1, 100], torch.bfloat16, seed=7)
    out = pa.paged_decode_attention(*case, block_size=16)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, float64_reference(*case, 16)) < 1e-2


def test_decode_splits_fill_one_wave_and_respect_the_context():
    """One row of 8 KV heads on 132 SMs gets 64 spans of 4096 tokens; 32 rows get 3; a short
    max_context caps the spans at 64 tokens each; there is always at least one."""
    assert pa.decode_splits(1, 8, 4096, 132) == 64
    assert pa.decode_splits(32, 8, 4096, 132) == 3
    assert pa.decode_splits(1, 8, 192, 132) == 3
    assert pa.decode_splits(64, 8, 4096, 132) == 2
    assert pa.decode_splits(512, 8, 32, 132) == 1


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.zeros(2, 7, 16)), "multiple of kv_heads"),
    (dict(k=torch.zeros(40, 2, 8)), "head_dim equal"),
    (dict(lens=torch.zeros(3, dtype=torch.int32)), r"seq_lens \[S\]"),
    (dict(block_size=3), "must divide"),
    (dict(q=torch.zeros(2, 8, 16, dtype=torch.float64)), "share a dtype"),
])
def test_bad_arguments_are_refused(bad, match):
    """Shapes, dtypes and the block size are checked with a message naming what is wrong."""
    args = dict(q=torch.zeros(2, 8, 16), k=torch.zeros(40, 2, 16), v=torch.zeros(40, 2, 16),
                tables=torch.zeros(2, 5, dtype=torch.int32),
                lens=torch.zeros(2, dtype=torch.int32), block_size=4)
    args.update(bad)
    if "k" in bad:
        args["v"] = args["k"]
    with pytest.raises(ValueError, match=match):
        pa.paged_decode_attention(args["q"], args["k"], args["v"], args["tables"], args["lens"],
                                  block_size=args["block_size"])


KERNEL_CASES = [  # S, heads, kv_heads, head_dim, block_size, max_blocks, lens, splits
    (1, 32, 8, 128, 16, 256, [4096], None),
    (3, 32, 8, 128, 16, 12, [192, 1, 0], None),
    (5, 32, 8, 128, 16, 20, [17, 320, 33, 64, 250], 7),
    (2, 8, 8, 64, 16, 8, [100, 31], 1),
]


def _check_kernel(case_args, splits, dtype, device, tol, seed):
    S, heads, kv_heads, head_dim, bs, max_blocks, lens = case_args
    case = random_case(S, heads, kv_heads, head_dim, bs, max_blocks, lens, dtype, device, seed)
    out = pa.paged_decode_attention(*case, block_size=bs, splits=splits) if device == "cuda" \
        else _triton_attention().paged_decode(*case, block_size=bs, splits=splits or 4)
    assert out.dtype == dtype and out.shape == case[0].shape
    assert not torch.isnan(out).any()
    assert rel_err(out, float64_reference(*case, bs)) < tol
    for n, length in enumerate(lens):
        if length == 0:
            assert torch.all(out[n] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernel_matches_float64_on_cuda(case):
    """bf16 on the GPU, fresh random inputs: within 1e-2 of float64; rows without tokens 0."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    *args, splits = case
    _check_kernel(args, splits, torch.bfloat16, "cuda", 1e-2, seed=int(torch.seed()) % 2**31)


@pytest.mark.gpu
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_kernel_in_float32_matches_float64_on_cuda(case):
    """float32 on the GPU, fresh random inputs: within 1e-5 of float64 (tl.dot's default
    rounds float32 operands to TF32, ~1e-3 off, which flips greedy tokens of a float32 model)."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    *args, splits = case
    _check_kernel(args, splits, torch.float32, "cuda", 1e-5, seed=int(torch.seed()) % 2**31)


@pytest.mark.gpu
def test_triton_kernel_captures_in_a_cuda_graph():
    """Captured once, replayed with new seq_lens and new cache contents: the replay computes
    the new inputs' attention (the split bounds are read on the device)."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    q, k, v, tables, lens = random_case(2, 32, 8, 128, 16, 64, [100, 900], torch.bfloat16, "cuda")
    pa.paged_decode_attention(q, k, v, tables, lens, block_size=16)   # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pa.paged_decode_attention(q, k, v, tables, lens, block_size=16)
    for seed, new_lens in ((1, [1, 1024]), (2, [513, 0])):
        fresh = random_case(2, 32, 8, 128, 16, 64, new_lens, torch.bfloat16, "cuda", seed)
        for dst, src in zip((q, k, v, tables, lens), fresh):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, float64_reference(q, k, v, tables, lens, 16)) < 1e-2


def _triton_attention():
    pytest.importorskip("triton", reason="the Triton kernel needs Triton")
    from vt.torch import triton_attention
    return triton_attention


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton kernel on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", KERNEL_CASES[1:])
def test_triton_kernel_in_the_interpreter(case):
    """The same kernel under Triton's CPU interpreter, fp16 (its bf16 dot is not emulated)."""
    *args, splits = case
    _check_kernel(args, splits, torch.float16, "cpu", 2e-3, seed=11)
