"""vt.torch.paged_attention: decode attention over each row's live KV tokens, checked against
a float64 reference and the dense masked reference on fresh random inputs. Tolerances
(relative Frobenius error): float32 1e-5; bf16 storage 1e-2 (bf16 operands, float32 sums);
fp16 under Triton's CPU interpreter 2e-3."""
import math
import os

import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")
pytestmark = pytest.mark.torch_allocator   # PyTorch's caching allocator keeps its blocks

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
    q, k, v, tables = q.cpu(), k.cpu(), v.cpu(), tables.cpu()
    for n in range(S):
        slots = pa.live_slots(tables[n], int(lens[n]), block_size)
        for h in range(heads if len(slots) else 0):
            keys = k[slots, h // group].double()
            vals = v[slots, h // group].double()
            p = torch.softmax(keys @ q[n, h].double() / math.sqrt(head_dim), 0)
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
    # 32 rows: the split kernels' long key tiles (triton_attention.split_block_n)
    (32, 32, 8, 128, 16, 40, [n * 97 % 601 for n in range(32)], None),
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


def test_split_kernels_take_long_key_tiles_from_32_rows_of_narrow_cache_rows():
    """128-key tiles from LONG_TILE_MIN_ROWS rows when a cache row (head_dim elements) fits
    LONG_TILE_MAX_ROW_BYTES; 32-key tiles below, and for wide rows (float32, head_dim 128)."""
    ta = _triton_attention()
    cache = lambda dtype, head_dim: torch.zeros(16, 8, head_dim, dtype=dtype)
    assert ta.split_block_n(32, cache(torch.bfloat16, 128)) == ta.LONG_BLOCK_N == 128
    assert ta.split_block_n(128, cache(torch.float8_e4m3fn, 128)) == 128
    assert ta.split_block_n(31, cache(torch.bfloat16, 128)) == ta.BLOCK_N == 32
    assert ta.split_block_n(32, cache(torch.float32, 128)) == 32
    assert ta.split_block_n(32, cache(torch.float32, 64)) == 128


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton kernel on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", KERNEL_CASES[1:])
def test_triton_kernel_in_the_interpreter(case):
    """The same kernel under Triton's CPU interpreter, fp16 (its bf16 dot is not emulated)."""
    *args, splits = case
    _check_kernel(args, splits, torch.float16, "cpu", 2e-3, seed=11)


def _check_span_counters(device, dtype, monkeypatch):
    """One counts buffer kept across calls of other row counts and split counts (as
    LlamaDecoder keeps one for every step and layer): each call's output bit for bit that of a
    call with a fresh buffer, and the buffer zero after each. A step of more rows than the
    buffer counts (a verify step's) merges in the _merge kernel: its bits, the buffer
    untouched. A buffer not int32 is refused in one line."""
    ta = _triton_attention()
    kv_heads = 8
    assert ta.merges_in_split(ta.FOLD_MIN_ROWS, kv_heads)
    assert not ta.merges_in_split(ta.FOLD_MIN_ROWS - 1, kv_heads)
    counters = torch.zeros(5 * kv_heads, dtype=torch.int32, device=device)
    assert ta.merges_in_split(6, kv_heads) and not ta.merges_in_split(6, kv_heads, counters)
    for seed, (S, lens, splits) in enumerate(((5, [17, 320, 0, 64, 250], 7), (2, [100, 31], 3),
                                              (5, [1, 2, 3, 4, 5], 1))):
        case = random_case(S, 32, kv_heads, 128, 16, 20, lens, dtype, device, seed)
        fresh = ta.paged_decode(*case, block_size=16, splits=splits)
        kept = ta.paged_decode(*case, block_size=16, splits=splits, span_counters=counters)
        assert torch.equal(kept, fresh) and not counters.any()
    wide = random_case(6, 32, kv_heads, 128, 16, 20, [90, 17, 320, 0, 64, 250], dtype, device, 3)
    past = ta.paged_decode(*wide, block_size=16, splits=4, span_counters=counters)
    monkeypatch.setattr(ta, "FOLD_MIN_ROWS", 10 ** 6)
    merged = ta.paged_decode(*wide, block_size=16, splits=4)
    assert torch.equal(past, merged) and not counters.any()
    with pytest.raises(ValueError, match="span_counters: int32"):
        ta.paged_decode(*case, block_size=16, splits=2,
                        span_counters=torch.zeros(5 * kv_heads, dtype=torch.int64, device=device))


@pytest.mark.gpu
def test_one_span_counts_buffer_serves_every_call_on_cuda(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    monkeypatch.setattr(_triton_attention(), "FOLD_MIN_ROWS", 2)
    _check_span_counters("cuda", torch.bfloat16, monkeypatch)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton kernel on the CPU only under TRITON_INTERPRET=1")
def test_one_span_counts_buffer_serves_every_call_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(_triton_attention(), "FOLD_MIN_ROWS", 2)
    _check_span_counters("cpu", torch.float16, monkeypatch)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton kernel on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", KERNEL_CASES[1:4])
def test_the_fold_at_fewer_rows_in_the_interpreter(case, monkeypatch):
    """The split kernels' own merge (from FOLD_MIN_ROWS rows; here from one) at the cases
    below it, both decode kernels: within the same tolerance of float64."""
    ta = _triton_attention()
    monkeypatch.setattr(ta, "FOLD_MIN_ROWS", 1)
    *args, splits = case
    _check_kernel(args, splits, torch.float16, "cpu", 2e-3, seed=12)
    _check_rope_kernel(args, splits, torch.float16, "cpu", 2e-3, seed=12,
                       run=lambda *a, splits, **kw: ta.rope_paged_decode(
                           *a, splits=splits or 4, **kw))


# rope_cache_decode_attention: the decode attention from the fused q/k/v projection, its RoPE
# and KV write in the same kernel.

def random_rope_case(S, heads, kv_heads, head_dim, block_size, max_blocks, lens, dtype,
                     device="cpu", seed=0):
    """(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens): a
    decode step whose row n writes position lens[n] - 1 (a row without tokens, a pad row:
    position 0 and a slot of a block no table holds)."""
    _, k, v, tables, lens_t = random_case(S, heads, kv_heads, head_dim, block_size, max_blocks,
                                          lens, dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(S, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    ang = torch.rand(max_blocks * block_size, head_dim // 2, generator=g) * 6.28
    cos, sin = torch.cat((ang, ang), -1).cos().to(device), torch.cat((ang, ang), -1).sin().to(device)
    free = sorted(set(range(k.shape[0] // block_size)) - set(tables.flatten().tolist()))
    table = tables.cpu().long()
    slots = [int(table[n, (L - 1) // block_size]) * block_size + (L - 1) % block_size if L
             else free[0] * block_size for n, L in enumerate(lens)]
    pos = torch.tensor([max(L - 1, 0) for L in lens]).to(device)
    return (qkv, pos, cos, sin, k, v, torch.tensor(slots).to(device), tables, lens_t)


def rope_reference(case, heads, kv_heads, head_dim, block_size):
    """(attention in float64, the caches after the step): fused.rope_and_cache's plain-torch
    path on copies of the caches, then float64_reference over them."""
    from vt.torch import fused
    qkv, pos, cos, sin, k, v, slots, tables, lens = (t.cpu() for t in case)
    k, v = k.clone(), v.clone()
    q = fused.rope_and_cache(qkv, pos, cos, sin, k, v, slots, heads=heads, kv_heads=kv_heads,
                             head_dim=head_dim)
    return float64_reference(q, k, v, tables, lens, block_size), k, v


def _check_rope_kernel(case_args, splits, dtype, device, tol, seed, run):
    S, heads, kv_heads, head_dim, bs, max_blocks, lens = case_args
    case = random_rope_case(S, heads, kv_heads, head_dim, bs, max_blocks, lens, dtype, device,
                            seed)
    want, k_after, v_after = rope_reference(case, heads, kv_heads, head_dim, bs)
    out = run(*case, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=bs,
              splits=splits)
    assert out.dtype == dtype and out.shape == (S, heads, head_dim)
    assert not torch.isnan(out).any()
    assert rel_err(out, want) < tol
    assert rel_err(case[4], k_after) < tol and rel_err(case[5], v_after) < tol
    for n, length in enumerate(lens):
        if length == 0:
            assert torch.all(out[n] == 0)


@pytest.mark.parametrize("case", KERNEL_CASES[1:])
def test_rope_cache_decode_attention_torch_path(case):
    """On the CPU, float32: RoPE, the KV write and the attention over live slots, within 1e-5
    of float64 (the new key read back from the cache)."""
    *args, splits = case
    _check_rope_kernel(args, splits, torch.float32, "cpu", 1e-5, seed=3,
                       run=pa.rope_cache_decode_attention)


def test_rope_cache_decode_attention_refuses_a_bad_projection():
    case = random_rope_case(2, 8, 2, 32, 16, 4, [5, 9], torch.float32)
    with pytest.raises(ValueError, match=r"rope_and_cache: qkv \[S, 384\]"):
        pa.rope_cache_decode_attention(case[0][:, :-1], *case[1:], heads=8, kv_heads=2,
                                       head_dim=32, block_size=16)
    with pytest.raises(ValueError, match="rope_cache_decode_attention: block_tables"):
        pa.rope_cache_decode_attention(*case[:7], case[7][:1], case[8], heads=8, kv_heads=2,
                                       head_dim=32, block_size=16)


@pytest.mark.gpu
@pytest.mark.parametrize("case", KERNEL_CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)],
                         ids=["bf16", "fp32"])
def test_rope_cache_decode_kernel_matches_float64_on_cuda(case, dtype, tol):
    """The fused kernel on the GPU, fresh random inputs: attention within tol of float64 over
    the reference's RoPE, the caches written as rope_and_cache writes them."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    *args, splits = case
    _check_rope_kernel(args, splits, dtype, "cuda", tol, seed=int(torch.seed()) % 2**31,
                       run=pa.rope_cache_decode_attention)


@pytest.mark.gpu
def test_rope_cache_decode_kernel_captures_in_a_cuda_graph():
    """Captured once, replayed with new projections, positions, slots, seq_lens and cache
    contents: each replay computes and writes what the new inputs ask (nothing is read on the
    host)."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    shape = dict(heads=32, kv_heads=8, head_dim=128)
    static = random_rope_case(2, 32, 8, 128, 16, 64, [100, 900], torch.bfloat16, "cuda")
    pa.rope_cache_decode_attention(*static, block_size=16, **shape)   # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pa.rope_cache_decode_attention(*static, block_size=16, **shape)
    for seed, lens in ((1, [1, 1024]), (2, [513, 17])):
        fresh = random_rope_case(2, 32, 8, 128, 16, 64, lens, torch.bfloat16, "cuda", seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        want, k_after, v_after = rope_reference(static, block_size=16, **shape)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, want) < 1e-2
        assert rel_err(static[4], k_after) < 1e-2 and rel_err(static[5], v_after) < 1e-2


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton kernel on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", KERNEL_CASES[1:])
def test_rope_cache_decode_kernel_in_the_interpreter(case):
    """The fused kernel under Triton's CPU interpreter, fp16 (its bf16 dot is not emulated)."""
    *args, splits = case
    _check_rope_kernel(args, splits, torch.float16, "cpu", 2e-3, seed=5,
                       run=lambda *a, splits, **kw: _triton_attention().rope_paged_decode(
                           *a, splits=splits or 4, **kw))


# paged_varlen_attention: an eager step's tokens, n new ones per sequence in a context of L.

def random_varlen_case(news, lens, heads, kv_heads, head_dim, block_size, dtype, device="cpu",
                       seed=0):
    """q [sum(news), heads, hd], caches (every slot random), block tables, query_start_loc,
    seq_lens, and the step's longest query."""
    max_blocks = -(-max(lens) // block_size) + 1
    q, k, v, tables, lens_t = random_case(len(lens), heads, kv_heads, head_dim, block_size,
                                          max_blocks, lens, dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(news), heads, head_dim, generator=g).to(dtype).to(device)
    qsl = torch.tensor([0] + list(torch.tensor(news).cumsum(0)), dtype=torch.int32).to(device)
    return q, k, v, qsl, lens_t, tables, max(news)


def varlen_float64_reference(q, k, v, qsl, lens, tables, block_size):
    """Token by token, in float64 on q's device: token j of n in a context of L sees the
    live slots of positions 0 .. L - n + j (each head its KV head's, h // group)."""
    heads, head_dim = q.shape[1:]
    group = heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    starts = qsl.tolist()
    for i, L in enumerate(lens.tolist()):
        n = starts[i + 1] - starts[i]
        slots = pa.live_slots(tables[i], L, block_size)
        keys = k[slots].double().repeat_interleave(group, dim=1)     # [L, heads, hd]
        vals = v[slots].double().repeat_interleave(group, dim=1)
        for j in range(n):
            seen = L - n + j + 1
            row = q[starts[i] + j].double()                            # [heads, hd]
            p = torch.softmax(torch.einsum("hd,lhd->hl", row, keys[:seen]) / math.sqrt(head_dim), 1)
            out[starts[i] + j] = torch.einsum("hl,lhd->hd", p, vals[:seen])
    return out


# news, lens, heads, kv_heads, head_dim, block_size: decode rows (n = 1), a prompt's first
# chunk (n = L), a later chunk over a cached prefix (n < L), and a sequence without new tokens.
VARLEN_CPU_CASES = [
    ([1, 1, 9, 5], [7, 30, 9, 21], 8, 2, 16, 4),
    ([3, 0, 17], [3, 12, 40], 4, 4, 32, 16),
    ([1], [1], 32, 8, 32, 16),
]


@pytest.mark.parametrize("case", VARLEN_CPU_CASES)
def test_varlen_torch_path_matches_float64(case):
    """The CPU path equals the token-by-token float64 reference (float32, 1e-5)."""
    news, lens, heads, kv_heads, hd, bs = case
    args = random_varlen_case(news, lens, heads, kv_heads, hd, bs, torch.float32, seed=len(news))
    *tensors, longest = args
    out = pa.paged_varlen_attention(*tensors, block_size=bs, max_query_len=longest)
    assert out.shape == args[0].shape and out.dtype == torch.float32
    assert rel_err(out, varlen_float64_reference(*tensors, bs)) < 1e-5


def test_varlen_with_one_token_per_sequence_is_decode_attention():
    """A step of decode rows only: paged_varlen_attention equals paged_decode_attention."""
    q, k, v, qsl, lens, tables, _ = random_varlen_case([1] * 4, [5, 40, 1, 17], 8, 2, 16, 4,
                                                       torch.float32, seed=4)
    varlen = pa.paged_varlen_attention(q, k, v, qsl, lens, tables, block_size=4, max_query_len=1)
    decode = pa.paged_decode_attention(q, k, v, tables, lens, block_size=4)
    assert rel_err(varlen, decode) < 1e-6


def test_varlen_torch_path_reads_only_live_slots():
    """NaN in every slot outside the sequences' live positions leaves the output unchanged."""
    news, lens, bs = [1, 6, 3], [9, 6, 14], 4
    q, k, v, qsl, lens_t, tables, longest = random_varlen_case(news, lens, 8, 2, 16, bs,
                                                               torch.float32, seed=9)
    clean = pa.paged_varlen_attention(q, k, v, qsl, lens_t, tables, block_size=bs,
                                      max_query_len=longest)
    live = torch.cat([pa.live_slots(tables[i], lens[i], bs) for i in range(3)])
    dead = torch.ones(k.shape[0], dtype=torch.bool)
    dead[live] = False
    k[dead], v[dead] = float("nan"), float("nan")
    assert torch.equal(pa.paged_varlen_attention(q, k, v, qsl, lens_t, tables, block_size=bs,
                                                 max_query_len=longest), clean)


def test_varlen_bad_arguments_are_refused():
    """query_start_loc must have one entry more than seq_lens; the shared checks name the
    varlen function; on the CPU a max_query_len below the longest query is refused."""
    q, k = torch.zeros(5, 8, 16), torch.zeros(40, 2, 16)
    tables, lens = torch.zeros(2, 5, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"query_start_loc \[B \+ 1\]"):
        pa.paged_varlen_attention(q, k, k, torch.zeros(2, dtype=torch.int32), lens, tables,
                                  block_size=4, max_query_len=1)
    with pytest.raises(ValueError, match="paged_varlen_attention: .* must divide"):
        pa.paged_varlen_attention(q, k, k, torch.zeros(3, dtype=torch.int32), lens, tables,
                                  block_size=3, max_query_len=1)
    with pytest.raises(ValueError, match="max_query_len=2 is below the step's longest query, 3"):
        pa.paged_varlen_attention(q, k, k, torch.tensor([0, 2, 5], dtype=torch.int32),
                                  torch.tensor([4, 3], dtype=torch.int32), tables, block_size=4,
                                  max_query_len=2)


VARLEN_KERNEL_CASES = [  # news, lens, heads, kv_heads, head_dim, block_size
    ([4096], [4096], 32, 8, 128, 16),                        # one long prompt
    ([512] * 8, [512] * 8, 32, 8, 128, 16),                  # prompts arriving together
    ([1] * 16 + [300], [200 + 37 * i for i in range(16)] + [1000], 32, 8, 128, 16),  # mixed
    ([1, 70, 0, 33], [90, 70, 5, 160], 8, 8, 64, 16),        # no grouping; an idle sequence
    ([5, 1], [5, 64], 28, 4, 128, 16),                       # a group of 7 (Qwen2-7B)
]


def _check_varlen_kernel(case, dtype, device, tol, seed, run):
    news, lens, heads, kv_heads, hd, bs = case
    *tensors, longest = random_varlen_case(news, lens, heads, kv_heads, hd, bs, dtype, device,
                                           seed)
    out = run(*tensors, block_size=bs, max_query_len=longest)
    assert out.dtype == dtype and out.shape == tensors[0].shape
    assert not torch.isnan(out).any()
    assert rel_err(out, varlen_float64_reference(*tensors, bs)) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("case", VARLEN_KERNEL_CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)],
                         ids=["bf16", "float32"])
def test_varlen_triton_kernel_matches_float64_on_cuda(case, dtype, tol):
    """Fresh random inputs on the GPU: bf16 within 1e-2 of float64, float32 within 1e-5."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    _check_varlen_kernel(case, dtype, "cuda", tol, int(torch.seed()) % 2**31,
                         pa.paged_varlen_attention)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton kernel on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", [c for c in VARLEN_CPU_CASES] + VARLEN_KERNEL_CASES[3:])
def test_varlen_triton_kernel_in_the_interpreter(case):
    """The varlen kernel under Triton's CPU interpreter, fp16 (its bf16 dot is not emulated)."""
    ta = _triton_attention()
    _check_varlen_kernel(case, torch.float16, "cpu", 2e-3, 13, ta.paged_varlen)
