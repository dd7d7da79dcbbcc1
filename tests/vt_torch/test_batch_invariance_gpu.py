"""Batch invariance of vt.torch on CUDA (vt.torch.triton_invariant): a row's bits depend on
that row alone.

Kernel level, on fresh random inputs: invariant linear's rows computed alone against inside
random batches of 1..64 rows and of prefill sizes, bytes equal, and within a stated tolerance
of F.linear and float64; invariant paged attention's tokens computed as a one-row decode
step, inside decode steps of random rows, as decode rows of mixed steps and inside prompt
chunks cut at random bounds beside other sequences, bytes equal, and within tolerance of
float64. The decoder's default kernels are shown to differ on the same inputs (else these
checks would prove nothing). Each kernel check also runs under Triton's CPU interpreter
(TRITON_INTERPRET=1; fp16, whose dot it emulates), at small shapes and short spans.

End to end: a small bf16 LlamaDecoder(batch_invariant=True) on CUDA served by vt's Engine
(sync and ring): a prompt alone and among 30 others gives the same greedy tokens and logits
bytes; batch_invariant=False does not (the logits bytes differ), so the check can fail.
"""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")
pytestmark = pytest.mark.torch_allocator   # PyTorch's caching allocator keeps its blocks

from vt.torch import paged_attention as pa  # noqa: E402

interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="runs the Triton kernels on the CPU only under "
                                             "TRITON_INTERPRET=1")


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")


def _invariant():
    pytest.importorskip("triton", reason="the Triton kernels need Triton")
    from vt.torch import triton_invariant
    return triton_invariant


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def rows_differing(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """The indices of the rows (first dim) of a and b whose bytes differ."""
    a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return torch.nonzero((a.reshape(len(a), -1) != b.reshape(len(b), -1)).any(1))[:, 0].tolist()


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# --- linear -----------------------------------------------------------------------------

def linear_rows_check(linear, N, K, dtype, device, batches, seed, bias=False):
    """64 random rows, each alone (M = 1), then batches of M rows drawn from them (with
    repeats, in random order): (rows compared, rows whose bytes differ from alone)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, K, generator=g).to(dtype).to(device)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype).to(device)
    b = torch.randn(N, generator=g).to(dtype).to(device) if bias else None
    args = (w,) if b is None else (w, b)
    alone = torch.cat([linear(x[r:r + 1], *args) for r in range(64)])
    compared = bad = 0
    for M in batches:
        rows = torch.randint(0, 64, (M,), generator=g).to(device)
        y = linear(x[rows], *args)
        assert y.shape == (M, N) and y.dtype == dtype
        compared += M
        bad += len(rows_differing(y, alone[rows]))
    return compared, bad


def linear_accuracy_check(linear, M, N, K, dtype, device, tol, seed, bias):
    """Fresh random inputs: within tol of float64 and of F.linear (relative Frobenius)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype).to(device)
    b = torch.randn(N, generator=g).to(dtype).to(device) if bias else None
    y = linear(x, w, b)
    assert y.shape == (M, N) and y.dtype == dtype and torch.isfinite(y).all()
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert rel_err(y, want) < tol
    assert rel_err(y, torch.nn.functional.linear(x, w, b)) < tol


LINEAR_BATCHES = [1, 2, 7, 16, 17, 31, 32, 33, 64, 300, 2048]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,dtype,bias", [
    (6144, 4096, torch.bfloat16, False), (4096, 14336, torch.bfloat16, False),
    (1000, 777, torch.float16, True), (96, 200, torch.float32, True)],
    ids=["qkv-8b", "down-8b", "odd-fp16-bias", "fp32-bias"])
def test_invariant_linear_rows_are_bit_identical_in_any_batch_on_cuda(N, K, dtype, bias):
    """Every row of every batch (1..64 rows, and 300 and 2048: prompt chunks) has the bytes it
    has alone."""
    _cuda()
    compared, bad = linear_rows_check(_invariant().linear, N, K, dtype, "cuda", LINEAR_BATCHES,
                                      seed=int(torch.seed()) % 2**31, bias=bias)
    assert (compared, bad) == (sum(LINEAR_BATCHES), 0)


@pytest.mark.gpu
def test_the_default_linear_is_not_batch_invariant_on_cuda():
    """The decoder's default linear (vt.torch.fused.linear: a one-row GEMV kernel, then
    cuBLAS past 16 rows) gives some row other bytes in a batch than alone: what the check
    above would catch."""
    _cuda()
    from vt.torch import fused
    _, bad = linear_rows_check(fused.linear, 6144, 4096, torch.bfloat16, "cuda", [64], seed=3)
    assert bad > 0


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 64, 1000])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3),
                                       (torch.float32, 1e-5)], ids=["bf16", "fp16", "float32"])
def test_invariant_linear_matches_f_linear_on_cuda(M, dtype, tol):
    """Fresh random inputs with a bias: within 1e-2 (bf16: one rounding to its 2**-8 ulp),
    2e-3 (fp16) or 1e-5 (float32: exact dots) of float64 and of F.linear."""
    _cuda()
    linear_accuracy_check(_invariant().linear, M, 4096, 4096 + 64, dtype, "cuda", tol,
                          int(torch.seed()) % 2**31, bias=True)


@pytest.mark.gpu
def test_invariant_linear_captures_in_a_cuda_graph():
    """Captured once, replayed over new inputs: the replay computes the new product, bytes
    equal to an eager call."""
    _cuda()
    ti = _invariant()
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) * 4096 ** -0.5
    ti.linear(x, w)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ti.linear(x, w)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        w.copy_(torch.randn_like(w) * 4096 ** -0.5)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert same_bytes(y, ti.linear(x, w))


@interpreter_only
@pytest.mark.parametrize("bias", [False, True])
def test_invariant_linear_in_the_interpreter(bias):
    """Under Triton's CPU interpreter, fp16, K not a multiple of BLOCK_K: rows alone and in
    batches of 1..64 and 100 rows, bytes equal; within 2e-3 of float64 and F.linear."""
    ti = _invariant()
    compared, bad = linear_rows_check(ti.linear, 40, 200, torch.float16, "cpu",
                                      [1, 3, 16, 17, 64, 100], seed=2, bias=bias)
    assert (compared, bad) == (201, 0)
    linear_accuracy_check(ti.linear, 20, 40, 200, torch.float16, "cpu", 2e-3, 5, bias)


def test_invariant_linear_refuses_bad_arguments():
    """Shapes, dtypes and the bias are checked with the offending values named (before any
    kernel: this runs without a GPU)."""
    ti = _invariant()
    x, w = torch.zeros(2, 8, dtype=torch.float16), torch.zeros(4, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\] expected, got "
                                         r"\(2, 8\) and \(4, 9\)"):
        ti.linear(x, torch.zeros(4, 9, dtype=torch.float16))
    with pytest.raises(ValueError, match="share a dtype .* got torch.float16 and torch.float64"):
        ti.linear(x, w.double())
    with pytest.raises(ValueError, match=r"bias \[4\] of torch.float16 expected, got \(3,\)"):
        ti.linear(x, w, torch.zeros(3, dtype=torch.float16))


# --- paged attention --------------------------------------------------------------------

class AttentionCase:
    """R sequences over one paged cache (every slot random, distinct blocks per sequence), a
    random query for every position of every sequence, and the steps that serve them."""

    def __init__(self, R, heads, kv_heads, head_dim, block_size, max_len, dtype, device, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.block_size, self.device = block_size, device
        self.lens = torch.randint(max_len // 3, max_len + 1, (R,), generator=self.g).tolist()
        self.lens[0] = max_len                    # one sequence as long as the tables allow
        max_blocks = -(-max_len // block_size)
        blocks = R * max_blocks + 2
        slots = blocks * block_size

        def randn(*shape):
            return torch.randn(*shape, generator=self.g).to(dtype).to(device)

        self.k, self.v = randn(slots, kv_heads, head_dim), randn(slots, kv_heads, head_dim)
        self.tables = torch.randperm(blocks, generator=self.g)[:R * max_blocks].view(
            R, max_blocks).int().to(device)
        self.queries = randn(R, max_len, heads, head_dim)   # [sequence, position]

    def decode(self, run, pairs):
        """One decode step whose rows are the tokens `pairs` ((sequence, position) each: the
        query of that position over the positions up to it)."""
        s = torch.tensor([p[0] for p in pairs], device=self.device)
        pos = torch.tensor([p[1] for p in pairs], device=self.device)
        return run(self.queries[s, pos], self.k, self.v, self.tables[s],
                   (pos + 1).int(), block_size=self.block_size)

    def step(self, run, chunks):
        """One step of prompt chunks and decode rows (chunks: (sequence, context L, n new
        tokens) each; the new tokens are positions L - n .. L - 1): the outputs [T, heads,
        head_dim] and the (sequence, position) of each row."""
        pairs = [(s, p) for s, L, n in chunks for p in range(L - n, L)]
        news = [n for _, _, n in chunks]
        qsl = torch.tensor([0] + np.cumsum(news).tolist(), dtype=torch.int32,
                           device=self.device)
        seqs = torch.tensor([c[0] for c in chunks], device=self.device)
        q = self.queries[torch.tensor([p[0] for p in pairs], device=self.device),
                         torch.tensor([p[1] for p in pairs], device=self.device)]
        lens = torch.tensor([c[1] for c in chunks], dtype=torch.int32, device=self.device)
        return run(q, self.k, self.v, qsl, lens, self.tables[seqs], block_size=self.block_size,
                   max_query_len=max(news)), pairs

    def random_steps(self, count, rng):
        """Steps of random sequences, each at a context in the upper half of its length: a
        decode row (n = 1), a whole prompt (n = L) or a later chunk of random length, so a
        position is reached by chunks with different bounds."""
        steps = []
        for _ in range(count):
            seqs = rng.permutation(len(self.lens))[:rng.integers(1, len(self.lens) + 1)]
            chunks = []
            for s in seqs:
                L = int(rng.integers(self.lens[s] // 2, self.lens[s]) + 1)
                kind = rng.random()
                n = 1 if kind < 0.4 else L if kind < 0.6 else int(rng.integers(1, L + 1))
                chunks.append((int(s), L, n))
            steps.append(chunks)
        return steps

    def float64(self, pairs):
        """Each token's attention in float64 over its live slots, head h on KV head h // group."""
        heads, head_dim = self.queries.shape[2:]
        group = heads // self.k.shape[1]
        out = torch.empty(len(pairs), heads, head_dim, dtype=torch.float64)
        for j, (s, p) in enumerate(pairs):
            slots = pa.live_slots(self.tables[s].cpu(), p + 1, self.block_size)
            keys = self.k.cpu()[slots].double().repeat_interleave(group, dim=1)
            vals = self.v.cpu()[slots].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", self.queries[s, p].cpu().double(), keys)
            out[j] = torch.einsum("hl,lhd->hd", torch.softmax(scores / head_dim ** 0.5, 1), vals)
        return out


def attention_paths_check(case, decode, varlen, steps, decode_batches, rng, tol):
    """Every token of `steps` (run by `varlen`) and of random decode steps of
    decode_batches rows (run by `decode`) has the bytes of one reference decode step over
    all those tokens; the reference is within tol of float64. Returns the rows compared."""
    served = [case.step(varlen, chunks) for chunks in steps]
    pairs = sorted({p for _, ps in served for p in ps})
    index = {p: j for j, p in enumerate(pairs)}
    ref = case.decode(decode, pairs)
    sample = pairs[::max(1, len(pairs) // 48)]   # float64 on the CPU: a sample of the tokens
    assert rel_err(ref[[index[p] for p in sample]], case.float64(sample)) < tol
    compared = 0
    for out, ps in served:
        assert torch.isfinite(out).all()
        bad = rows_differing(out, ref[[index[p] for p in ps]])
        assert not bad, f"tokens {[ps[j] for j in bad[:4]]} (of {len(bad)}) in step {ps[:3]}" \
                        f"...: varlen differs from decode"
        compared += len(ps)
    for S in decode_batches:
        rows = [pairs[i] for i in rng.choice(len(pairs), size=S)]
        bad = rows_differing(case.decode(decode, rows), ref[[index[p] for p in rows]])
        assert not bad, f"tokens {[rows[j] for j in bad[:4]]} in a decode step of {S} differ"
        compared += S
    return compared


def _public_decode(*args, **kw):
    return pa.paged_decode_attention(*args, invariant=True, **kw)


def _public_varlen(*args, **kw):
    return pa.paged_varlen_attention(*args, invariant=True, **kw)


ATTENTION_SHAPES = [(32, 8, 128), (28, 4, 128), (8, 8, 64)]   # heads, kv_heads, head_dim


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,head_dim", ATTENTION_SHAPES,
                         ids=["8b-group4", "group7", "no-group"])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)],
                         ids=["bf16", "float32"])
def test_invariant_attention_token_is_bit_identical_on_every_path_on_cuda(
        heads, kv_heads, head_dim, dtype, tol):
    """Fresh random caches and queries, contexts up to 700 (6 spans): every token served as a
    decode row of a decode or a mixed step, or inside a prompt chunk of random bounds beside
    other sequences, has the bytes of the one reference decode step; decode steps of 1..64
    random rows too."""
    _cuda()
    seed = int(torch.seed()) % 2**31
    rng = np.random.default_rng(seed)
    case = AttentionCase(10, heads, kv_heads, head_dim, 16, 700, dtype, "cuda", seed)
    compared = attention_paths_check(case, _public_decode, _public_varlen,
                                     case.random_steps(12, rng), [1, 1, 2, 8, 31, 32, 64],
                                     rng, tol)
    assert compared > 1000


@pytest.mark.gpu
def test_the_default_attention_is_not_batch_invariant_on_cuda():
    """The default decode kernel picks its split count from the rows (decode_splits), so some
    token gets other bytes in a step of 32 rows than alone: what the check above would
    catch."""
    _cuda()
    case = AttentionCase(32, 32, 8, 128, 16, 700, torch.bfloat16, "cuda", seed=1)
    pairs = [(s, case.lens[s] - 1) for s in range(32)]
    together = case.decode(pa.paged_decode_attention, pairs)
    alone = [case.decode(pa.paged_decode_attention, [p])[0] for p in pairs]
    assert sum(not same_bytes(together[j], alone[j]) for j in range(32)) > 0


@pytest.mark.gpu
def test_invariant_attention_captures_in_a_cuda_graph():
    """The invariant decode attention captured once and replayed over new lengths and cache
    contents: bytes equal to an eager call (the spans' bounds are read on the device)."""
    _cuda()
    case = AttentionCase(4, 32, 8, 128, 16, 600, torch.bfloat16, "cuda", seed=2)
    s = torch.arange(4, device="cuda")
    pos = torch.tensor([599, 0, 130, 255], device="cuda")
    q, lens = case.queries[s, pos].clone(), (pos + 1).int()

    def run():
        return _public_decode(q, case.k, case.v, case.tables, lens, block_size=16)
    run()   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for new in ([1, 600, 129, 384], [257, 2, 1, 599]):
        lens.copy_(torch.tensor(new, device="cuda", dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        case.k.copy_(torch.randn_like(case.k))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert same_bytes(out, run())


@pytest.mark.gpu
def test_rope_cache_decode_attention_invariant_is_rope_and_cache_then_invariant_decode():
    """rope_cache_decode_attention(invariant=True) on CUDA: the bytes of fused.rope_and_cache
    then paged_decode_attention(invariant=True), the cache written the same."""
    _cuda()
    from vt.torch import fused
    case = AttentionCase(3, 32, 8, 128, 16, 300, torch.bfloat16, "cuda", seed=4)
    S, heads, kv, hd = 3, 32, 8, 128
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(S, (heads + 2 * kv) * hd, generator=g).to(torch.bfloat16).cuda()
    ang = torch.rand(300, hd // 2, generator=g) * 6.28
    cos, sin = torch.cat((ang, ang), -1).cos().cuda(), torch.cat((ang, ang), -1).sin().cuda()
    lens = torch.tensor(case.lens[:S], dtype=torch.int32, device="cuda")
    pos = (lens - 1).long()
    slots = (case.tables[torch.arange(S, device="cuda"), pos // 16].long() * 16 + pos % 16)
    k0, v0 = case.k.clone(), case.v.clone()
    got = pa.rope_cache_decode_attention(qkv, pos, cos, sin, case.k, case.v, slots,
                                         case.tables[:S], lens, heads=heads, kv_heads=kv,
                                         head_dim=hd, block_size=16, invariant=True)
    q = fused.rope_and_cache(qkv, pos, cos, sin, k0, v0, slots, heads=heads, kv_heads=kv,
                             head_dim=hd)
    want = _public_decode(q, k0, v0, case.tables[:S], lens, block_size=16)
    assert same_bytes(got, want) and same_bytes(case.k, k0) and same_bytes(case.v, v0)


def test_invariant_attention_refuses_a_split_count():
    """invariant=True cuts the context into fixed spans: a split count with it is refused,
    on any device."""
    q, k = torch.zeros(1, 4, 16), torch.zeros(8, 2, 16)
    tables, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="paged_decode_attention: splits=4 with invariant=True"):
        pa.paged_decode_attention(q, k, k, tables, lens, block_size=4, splits=4, invariant=True)


@interpreter_only
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (7, 1)], ids=["group2", "group7"])
def test_invariant_attention_paths_in_the_interpreter(heads, kv_heads):
    """Under Triton's CPU interpreter, float32 (whose last bits show a changed order, where
    fp16's rounding would hide most), 32-position spans (up to 3 a token): the same property
    at small shapes."""
    ti = _invariant()
    rng = np.random.default_rng(6)
    case = AttentionCase(3, heads, kv_heads, 16, 4, 70, torch.float32, "cpu", seed=6)
    compared = attention_paths_check(
        case, lambda *a, **kw: ti.paged_decode(*a, span=32, **kw),
        lambda *a, **kw: ti.paged_varlen(*a, span=32, **kw), case.random_steps(5, rng),
        [1, 5, 17], rng, 1e-5)
    assert compared > 100


# --- end to end -------------------------------------------------------------------------

E2E_SHAPE = dict(vocab=512, hidden=256, intermediate=512, layers=2, heads=8, kv_heads=2,
                 head_dim=64)


def _decoder(batch_invariant: bool):
    """A small bf16 Llama on CUDA (GQA 8/2, head_dim 64), seeded random weights scaled so that
    the logits spread; contexts up to 384 tokens for 32 sequences."""
    from vt.step import KVGeometry
    from vt.torch.llama import LlamaConfig, LlamaDecoder
    torch.manual_seed(0)
    geo = KVGeometry(max_seqs=32, num_kv_blocks=32 * 24 + 1, block_size=16, max_context=384)
    module = LlamaDecoder(LlamaConfig(**E2E_SHAPE), geo, dtype=torch.bfloat16, device="cuda",
                          batch_invariant=batch_invariant)
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 2.0 / p.shape[1] ** 0.5)
    return module


def _alone_and_among_others(batch_invariant: bool, seed: int):
    """Three prompts (1, 37 and 200 tokens, 8 new tokens each), each served alone (sync) and
    at a random place among 30 others of 1..300 tokens with 1..12 new tokens (sync and ring;
    prompts chunked at 96 tokens a step, so steps mix prompt chunks and decode rows and the
    chunk bounds move with the others): [(mode, alone result, result among others)]."""
    from vt.backend import get_backend
    from vt.engine import Engine
    from vt.config import ExecutorConfig
    from vt.torch import TorchForwardModel
    rng = np.random.default_rng(seed)
    others = [rng.integers(0, 512, rng.integers(1, 301)).tolist() for _ in range(30)]
    budgets = rng.integers(1, 13, 30).tolist()
    targets = [rng.integers(0, 512, n).tolist() for n in (1, 37, 200)]
    be = get_backend("cuda")
    alone, pairs = [], []
    try:
        model = TorchForwardModel(be, _decoder(batch_invariant), prefill="flat")
        for mode in ("sync", "ring"):
            config = ExecutorConfig(mode=mode, serving_conc=32,
                                             capture_sizes=(1, 2, 4, 8, 16, 32))
            with Engine(be, model, config, record_logits=True, max_prefill_tokens=96) as eng:
                if not alone:
                    alone = [eng.generate([t], max_new_tokens=8)[0] for t in targets]
                for t, first in zip(targets, alone):
                    at = int(rng.integers(0, 31))
                    got = eng.generate(others[:at] + [t] + others[at:],
                                       max_new_tokens=budgets[:at] + [8] + budgets[at:])[at]
                    pairs.append((mode, first, got))
    finally:
        be.close()
    return pairs


@pytest.mark.gpu
def test_a_prompt_gets_the_same_tokens_and_logits_alone_and_among_30_others_on_cuda():
    """LlamaDecoder(batch_invariant=True) served by vt (sync and ring): each prompt's greedy
    tokens and every logits byte are the same alone and among 30 other requests."""
    _cuda()
    for mode, alone, got in _alone_and_among_others(True, int(torch.seed()) % 2**31):
        assert got.tokens == alone.tokens, f"{mode}: tokens {got.tokens} != alone {alone.tokens}"
        assert got.logits.tobytes() == alone.logits.tobytes(), \
            f"{mode}: logits differ from alone (max |diff| " \
            f"{np.abs(got.logits - alone.logits).max():.3g})"


@pytest.mark.gpu
def test_without_the_switch_the_logits_depend_on_the_batch_on_cuda():
    """batch_invariant=False, the same check: some prompt's logits bytes differ between alone
    and among the others (so the test above can fail)."""
    _cuda()
    pairs = _alone_and_among_others(False, 7)
    assert any(got.logits.tobytes() != alone.logits.tobytes() for _, alone, got in pairs)
