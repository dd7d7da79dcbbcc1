"""LlamaDecoder's `kernels`: a decode step on vt's kernels ("vt": paged decode attention over
the live tokens, the fused norm / SiLU / RoPE-and-cache ops) computes what the plain torch
step ("torch": dense attention over max_context, masked) computes, and so does "vt" with
`linear="triton"` (vt.torch.triton_gemv's projections at <= 16 rows), and so does a mixed
step with `prompt_kernels="vt"` (prompt chunks and decode rows on those ops). On the CPU both run
plain torch (the CI twin of the wiring); on CUDA "vt" runs the Triton kernels. Tolerances (relative
Frobenius error of the logits): float32 1e-5; bf16 on CUDA 3e-2 (bf16 storage rounds each
layer's activations; the paged kernel sums in float32, SDPA in its own order)."""
import dataclasses

import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")
pytestmark = pytest.mark.torch_allocator   # PyTorch's caching allocator keeps its blocks

from vt.backend import get_backend  # noqa: E402
from vt.torch import TorchInputs  # noqa: E402
from vt.torch.llama import LlamaDecoder, resolve_kernels  # noqa: E402

from _torch_util import (GEO, TINY, eager_greedy, generate, prompts, step_model,  # noqa: E402
                         tiny_llama)

# "llama-hd32": head_dim 32, where a one-row decode step runs RoPE, the KV write and
# attention in one kernel (vt.torch.llama.ONE_KERNEL_MIN_HEAD_DIM).
CONFIGS = {"llama": dataclasses.replace(TINY, qk_norm=False), "qwen3": TINY,
           "llama-hd32": dataclasses.replace(TINY, qk_norm=False, head_dim=32)}


def twin(module: LlamaDecoder, kernels: str, linear: str = "torch",
         prompt_kernels: str = "auto") -> LlamaDecoder:
    """The same weights and KV cache on the other kernels."""
    other = LlamaDecoder(module.cfg, module.geometry, dtype=module.embed.weight.dtype,
                         device=module.k_cache.device, kernels=kernels, linear=linear,
                         prompt_kernels=prompt_kernels)
    other.load_state_dict(module.state_dict())
    with torch.no_grad():
        other.k_cache.copy_(module.k_cache)
        other.v_cache.copy_(module.v_cache)
    return other


def random_cache_and_tables(module: LlamaDecoder, B: int, g) -> torch.Tensor:
    """Random K and V in the module's cache; [B, max_blocks] tables of distinct blocks
    (block 0, the scratch, unused)."""
    geo = module.geometry
    with torch.no_grad():
        module.k_cache.copy_(torch.randn(module.k_cache.shape, generator=g))
        module.v_cache.copy_(torch.randn(module.v_cache.shape, generator=g))
    blocks = 1 + torch.randperm(geo.num_kv_blocks - 1, generator=g)[:B * geo.max_blocks]
    return blocks.view(B, geo.max_blocks).int()


def random_decode_step(module: LlamaDecoder, lens, seed: int) -> TorchInputs:
    """A decode step of len(lens) rows over a cache of random K and V: row n is at position
    lens[n] - 1 (random_cache_and_tables)."""
    g = torch.Generator().manual_seed(seed)
    geo, dev = module.geometry, module.k_cache.device
    S = len(lens)
    tables = random_cache_and_tables(module, S, g)
    pos = torch.tensor(lens, dtype=torch.int32) - 1
    slots = tables[torch.arange(S), pos // geo.block_size] * geo.block_size + pos % geo.block_size
    table = torch.randint(0, module.cfg.vocab, (geo.max_seqs + 1,), generator=g).int()
    i32 = lambda t: t.int().to(dev)   # noqa: E731
    return TorchInputs.decode(i32(table), i32(torch.arange(S)), i32(pos), i32(pos + 1),
                              i32(slots), i32(tables), i32(torch.zeros(S)))


def random_mixed_step(module: LlamaDecoder, decode_lens, chunks, seed: int) -> TorchInputs:
    """A mixed step over a cache of random K and V: len(decode_lens) decode rows (row n at
    position decode_lens[n] - 1), then one prompt chunk per (n, L) of `chunks`: its last n
    of L context positions (n == L: a prompt's first chunk, its whole context)."""
    g = torch.Generator().manual_seed(seed)
    geo, dev = module.geometry, module.k_cache.device
    B = len(decode_lens) + len(chunks)
    tables = random_cache_and_tables(module, B, g)
    spans = [(1, L) for L in decode_lens] + list(chunks)     # (new tokens, context after)
    pos = torch.cat([torch.arange(L - n, L) for n, L in spans]).int()
    seq = torch.cat([torch.full((n,), i) for i, (n, _) in enumerate(spans)])
    slots = tables[seq, pos // geo.block_size] * geo.block_size + pos % geo.block_size
    qsl = [0]
    for n, _ in spans:
        qsl.append(qsl[-1] + n)
    lens = [L for _, L in spans]
    table = torch.randint(0, module.cfg.vocab, (geo.max_seqs + 1,), generator=g).int()
    ids = torch.randint(0, module.cfg.vocab, (qsl[-1],), generator=g).int()
    i32 = lambda t: torch.as_tensor(t).int().to(dev)   # noqa: E731
    return TorchInputs(i32(ids), i32(pos), i32(slots), i32(qsl), i32(lens), i32(tables),
                       i32([q - 1 for q in qsl[1:]]), i32(torch.arange(B)), i32(torch.zeros(B)),
                       i32(table), tuple(qsl), tuple(lens))


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def decode_both(ref: LlamaDecoder, lens, seed, linear: str = "torch"):
    """(vt's logits, torch's logits, the twin) of one random decode step; both caches after."""
    inputs = random_decode_step(ref, lens, seed)
    fast = twin(ref, "vt", linear)
    outs = [torch.empty(len(lens), ref.cfg.vocab, device=ref.k_cache.device) for _ in range(2)]
    fast(inputs, outs[0])
    ref(inputs, outs[1])
    return outs[0], outs[1], fast


def test_kernels_choice():
    """auto: vt's kernels on the CPU and on CUDA with a power-of-two head_dim, plain torch
    otherwise; prompt steps follow decode steps unless chosen, and never take vt's kernels
    without them."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kernels("auto", "auto", cpu, 64) == ("vt", "vt")
    assert resolve_kernels("auto", "auto", cpu, 96) == ("vt", "vt")
    assert resolve_kernels("auto", "auto", cuda, 64) == ("vt", "vt")
    assert resolve_kernels("auto", "torch", cuda, 64) == ("vt", "torch")
    assert resolve_kernels("auto", "auto", cuda, 96) == ("torch", "torch")
    assert resolve_kernels("vt", "auto", cpu, 96) == ("vt", "vt")
    assert resolve_kernels("torch", "auto", cpu, 64) == ("torch", "torch")
    with pytest.raises(ValueError, match="kernels='triton' must be"):
        resolve_kernels("triton", "auto", cpu, 64)
    with pytest.raises(ValueError, match="prompt_kernels='triton' must be"):
        resolve_kernels("auto", "triton", cpu, 64)
    with pytest.raises(ValueError, match="prompt_kernels='vt' needs kernels='vt'"):
        resolve_kernels("auto", "vt", cuda, 96)
    with pytest.raises(ValueError, match="prompt_kernels='vt' needs kernels='vt'"):
        resolve_kernels("torch", "vt", cpu, 64)


def test_linear_choice_is_checked(sim_backend):
    ref = tiny_llama(sim_backend, cfg=CONFIGS["llama"], kernels="torch")
    with pytest.raises(ValueError, match="linear='cublas' must be 'auto', 'torch' or 'triton'"):
        twin(ref, "vt", "cublas")
    with pytest.raises(ValueError, match="needs kernels='vt'"):
        twin(ref, "torch", "triton")


@pytest.mark.parametrize("kernels,linear,rows,want", [
    ("vt", "auto", 1, "fused"), ("vt", "auto", 4, "fused"), ("vt", "triton", 4, "fused"),
    ("vt", "torch", 1, "torch"), ("torch", "auto", 1, "torch")])
def test_step_linear_follows_linear_and_kernels(sim_backend, kernels, linear, rows, want):
    """linear="auto" takes the Triton linears (fused.linear) in decode steps on vt's kernels,
    nn.Linear's F.linear on the torch ops; a step with prompt tokens always takes F.linear."""
    import torch.nn.functional as F
    from vt.torch import fused
    ref = tiny_llama(sim_backend, cfg=CONFIGS["llama"], kernels="torch")
    m = twin(ref, kernels, linear)
    ops = m.step_ops(random_decode_step(ref, [5] * rows, seed=1))
    assert ops.linear is ops.attn_linear is (fused.linear if want == "fused" else F.linear)
    assert m.step_ops(random_mixed_step(ref, [5] * rows, [(3, 3)], seed=1)).linear is F.linear


def describe(ops) -> tuple[str, ...]:
    """A LayerOps's parts by name: its linears, add_norm, gate_up_silu and attention, each
    with the options bound to it ("/inv": invariant; a head norm after the attention)."""
    import torch.nn.functional as F
    from vt.torch import fused, llama
    names = {F.linear: "F.linear", fused.linear: "triton", fused.invariant_linear: "invariant",
             fused.linear_silu_mul: "linear_silu_mul", llama.torch_add_norm: "torch",
             llama.fused_add_norm: "fused", llama.torch_gate_up_silu: "torch",
             llama.linear_then_silu_mul: "silu_mul", llama.torch_rope_attention: "torch_rope",
             llama.fused_rope_attention: "fused_rope",
             llama.one_kernel_attention: "one_kernel", llama.no_head_norm: "",
             llama.module_head_norm: "module", llama.invariant_head_norm: "invariant"}

    def name(f):
        kw = getattr(f, "keywords", {})
        out = names[getattr(f, "func", f)]
        if "linear" in kw:
            out += f"({names[kw['linear']]})"
        if kw.get("invariant"):
            out += "/inv"
        if kw.get("head_norm") is not None:
            out += f"/{names[kw['head_norm']]}".rstrip("/")
        return out
    return (ops.fused,) + tuple(name(getattr(ops, part)) for part in
                                ("linear", "attn_linear", "add_norm", "gate_up_silu", "attention"))


TORCH_OPS = (False, "F.linear", "F.linear", "torch", "torch", "torch_rope")
TRITON_OPS = (True, "triton", "triton", "fused", "linear_silu_mul", "fused_rope")
PROMPT_OPS = (True, "F.linear", "F.linear", "fused", "silu_mul(F.linear)", "fused_rope")
INVARIANT = (True, "invariant", "invariant", "fused/inv", "silu_mul(invariant)/inv", "fused_rope")
QWEN3 = {"attn_linear": "F.linear", "attention": "torch_rope/module"}
QWEN3_INVARIANT = {"attention": "torch_rope/invariant"}
PARTS = ("fused", "linear", "attn_linear", "add_norm", "gate_up_silu", "attention")


def like(ops: tuple, **parts) -> tuple:
    return tuple(parts.get(name, value) for name, value in zip(PARTS, ops))


@pytest.mark.parametrize("arch,settings,decode,one_row,prompt", [
    ("llama", {}, TRITON_OPS, TRITON_OPS, PROMPT_OPS),
    ("llama-hd32", {}, TRITON_OPS, like(TRITON_OPS, attention="one_kernel"), PROMPT_OPS),
    ("qwen3", {}, like(TRITON_OPS, **QWEN3), like(TRITON_OPS, **QWEN3), like(PROMPT_OPS, **QWEN3)),
    ("llama-hd32", dict(linear="torch"), PROMPT_OPS, like(PROMPT_OPS, attention="one_kernel"),
     PROMPT_OPS),
    ("llama-hd32", dict(prompt_kernels="torch"), TRITON_OPS,
     like(TRITON_OPS, attention="one_kernel"), TORCH_OPS),
    ("llama-hd32", dict(kernels="torch"), TORCH_OPS, TORCH_OPS, TORCH_OPS),
    ("qwen3", dict(kernels="torch"), *[like(TORCH_OPS, attention="torch_rope/module")] * 3),
    ("llama-hd32", dict(batch_invariant=True), INVARIANT,
     like(INVARIANT, attention="one_kernel"), INVARIANT),
    ("qwen3", dict(batch_invariant=True), *[like(INVARIANT, **QWEN3_INVARIANT)] * 3)])
def test_each_kind_of_step_runs_the_ops_its_settings_choose(arch, settings, decode, one_row,
                                                             prompt):
    """The implementations each kind of step runs, as chosen when the decoder is built: what
    the CUDA step launches (on the CPU its torch forms compute the same), pinned per setting.
    A Qwen3 (q/k norms) on vt's kernels projects qkv and o with F.linear unless invariant."""
    m = LlamaDecoder(CONFIGS[arch], GEO, dtype=torch.float32, device="cpu",
                     **dict(dict(batch_invariant=False), **settings))
    got = (describe(m.decode_ops), describe(m.one_row_ops), describe(m.prompt_ops))
    assert got == (decode, one_row, prompt)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_triton_linear_wiring_computes_the_torch_step_on_cpu(sim_backend, arch):
    """On the CPU linear="triton" runs fused.linear's torch form: the same ops in the same
    order as linear="torch", so the logits are equal bit for bit."""
    ref = tiny_llama(sim_backend, cfg=CONFIGS[arch], kernels="torch")
    inputs = random_decode_step(ref, [5, 17, 1, GEO.max_context], seed=3)
    outs = []
    for linear in ("torch", "triton"):
        m = twin(ref, "vt", linear)
        outs.append(torch.empty(4, ref.cfg.vocab))
        m(inputs, outs[-1])
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("lens", [[5, 17, 1, GEO.max_context], [17]], ids=["rows", "one-row"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_vt_kernels_decode_step_equals_torch_on_cpu(sim_backend, arch, lens):
    """float32 on the CPU: logits within 1e-5, and the K and V written to the cache within
    1e-5 (layer 0 writes the same; later layers see attention summed in another order)."""
    ref = tiny_llama(sim_backend, cfg=CONFIGS[arch], kernels="torch")
    got, want, fast = decode_both(ref, lens, seed=1)
    assert rel_err(got, want) < 1e-5
    torch.testing.assert_close(fast.k_cache, ref.k_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.v_cache, ref.v_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.k_cache[0], ref.k_cache[0], rtol=0, atol=0)


@pytest.mark.parametrize("arch,lens,want", [("llama-hd32", [17], True),
                                             ("llama-hd32", [5, 17], False),
                                             ("llama", [17], False), ("qwen3", [17], False)])
def test_one_row_decode_runs_rope_cache_attention(sim_backend, monkeypatch, arch, lens, want):
    """A one-row decode step with head_dim >= 32 and no qk_norm takes RoPE, the KV write and
    attention as one call (rope_cache_decode_attention), once per layer; anything else not."""
    from vt.torch import llama
    calls = []
    real = llama.rope_cache_decode_attention
    monkeypatch.setattr(llama, "rope_cache_decode_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    ref = tiny_llama(sim_backend, cfg=CONFIGS[arch], kernels="torch")
    decode_both(ref, lens, seed=1)
    assert len(calls) == (ref.cfg.layers if want else 0)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_vt_kernels_greedy_tokens_equal_torch_on_cpu(sim_backend, arch):
    ref = tiny_llama(sim_backend, cfg=CONFIGS[arch], kernels="torch")
    fast = twin(ref, "vt")
    for p in prompts(3, seed=4):
        assert eager_greedy(fast, p, 6) == eager_greedy(ref, p, 6)


def mixed_both(ref: LlamaDecoder, seed: int):
    """(logits with prompt_kernels="vt", logits of the torch ops, the vt twin) of one random
    mixed step: two decode rows, a first chunk and a later one (its prefix cached)."""
    inputs = random_mixed_step(ref, [5, GEO.max_context], [(6, 6), (3, 9)], seed)
    fast = twin(ref, "vt", prompt_kernels="vt")
    outs = [torch.empty(inputs.batch, ref.cfg.vocab, device=ref.k_cache.device)
            for _ in range(2)]
    fast(inputs, outs[0])
    ref(inputs, outs[1])
    return outs[0], outs[1], fast


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_vt_prompt_kernels_mixed_step_equals_torch_on_cpu(sim_backend, arch):
    """prompt_kernels="vt" on the CPU, float32: a mixed step's logits within 1e-5 of the
    torch ops', and the K and V it writes within 1e-5."""
    ref = tiny_llama(sim_backend, cfg=CONFIGS[arch], kernels="torch")
    got, want, fast = mixed_both(ref, seed=3)
    assert rel_err(got, want) < 1e-5
    torch.testing.assert_close(fast.k_cache, ref.k_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.v_cache, ref.v_cache, rtol=1e-5, atol=1e-5)


def test_prompt_kernels_choice_is_checked(sim_backend):
    ref = tiny_llama(sim_backend, cfg=CONFIGS["llama"], kernels="torch")
    with pytest.raises(ValueError, match="prompt_kernels='triton' must be 'auto', 'torch' or 'vt'"):
        twin(ref, "vt", prompt_kernels="triton")
    with pytest.raises(ValueError, match="prompt_kernels='vt' needs kernels='vt'"):
        twin(ref, "torch", prompt_kernels="vt")
    assert twin(ref, "torch").prompt_kernels == "torch", "auto follows kernels"
    assert twin(ref, "vt").prompt_kernels == "vt"


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    return get_backend("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("step,linear", [("decode", "torch"), ("decode", "triton"),
                                         ("one-row", "triton"), ("mixed", "torch")])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_triton_step_within_bf16_of_the_torch_ops_on_cuda(arch, step, linear):
    """bf16 on CUDA: a decode step on the Triton kernels (with cuBLAS's or the Triton
    linears), and a mixed step with prompt_kernels="vt", within 3e-2 of the torch ops'
    logits, on fresh random caches and weights."""
    be = _cuda()
    try:
        ref = tiny_llama(be, cfg=CONFIGS[arch], dtype=torch.bfloat16, kernels="torch",
                         seed=int(torch.seed()) % 2**31)
        if step == "mixed":
            got, want, _ = mixed_both(ref, seed=4)
        else:
            lens = [17] if step == "one-row" else [5, 17, 1, GEO.max_context, 2]
            got, want, _ = decode_both(ref, lens, seed=2, linear=linear)
        assert torch.isfinite(got).all()
        assert rel_err(got, want) < 3e-2
    finally:
        be.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,linear,arch,n", [
    (torch.float32, "torch", "llama", 4), (torch.float16, "torch", "llama", 4),
    (torch.float16, "triton", "llama", 4), (torch.float16, "triton", "llama-hd32", 1)])
def test_triton_greedy_tokens_equal_dense_on_cuda(dtype, linear, arch, n):
    """float32 and float16 on CUDA: vt serving the Triton decoder (captured decode steps) gives
    the dense torch decoder's eager greedy tokens; one prompt at head_dim 32 serves one-row
    steps through rope_cache_decode_attention."""
    be = _cuda()
    try:
        ref = tiny_llama(be, cfg=CONFIGS[arch], dtype=dtype, kernels="torch")
        fast = twin(ref, "vt", linear)
        ps = prompts(n, seed=5)
        expect = [eager_greedy(ref, p, 8) for p in ps]
        assert [eager_greedy(fast, p, 8) for p in ps] == expect
        assert generate(be, step_model(be, fast), "ring", ps, 8) == expect
    finally:
        be.close()


@pytest.mark.gpu
def test_vt_prompt_kernels_serve_the_dense_greedy_tokens_on_cuda():
    """float32 on CUDA: vt serving the decoder with prefill="flat" and prompt_kernels="vt"
    (prompt chunks and mixed steps on vt's kernels) gives the dense decoder's eager tokens."""
    from vt.torch import TorchForwardModel
    be = _cuda()
    try:
        ref = tiny_llama(be, cfg=CONFIGS["llama"], dtype=torch.float32, kernels="torch")
        fast = twin(ref, "vt", prompt_kernels="vt")
        ps = prompts(4, seed=6)
        expect = [eager_greedy(ref, p, 8) for p in ps]
        model = TorchForwardModel(be, fast, vocab=fast.cfg.vocab, geometry=GEO, prefill="flat")
        assert generate(be, model, "ring", ps, 8) == expect
    finally:
        be.close()


def _assert_pdl_changes_no_bit(module, steps, monkeypatch):
    """The module's decode step captured in a CUDA graph and replayed over fresh steps (random
    cache, tables, token and position each; `steps`: each one's lens) gives the logits and the
    cache the same step launched without PDL gives, bit for bit: a kernel that read or wrote
    before waiting on the one before would race."""
    from vt.torch import triton_pdl
    runs = []
    for pdl in (True, False):
        monkeypatch.setattr(triton_pdl, "ENABLED", pdl)
        static = random_decode_step(module, steps[0], seed=100)
        out = torch.empty(len(steps[0]), module.cfg.vocab, device="cuda")
        module(static, out)                                   # compiles, outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            module(static, out)
        got = []
        for i, step_lens in enumerate(steps):
            step = random_decode_step(module, step_lens, seed=i)   # also fills the cache
            for f in dataclasses.fields(step):
                value = getattr(step, f.name)
                if isinstance(value, torch.Tensor):
                    getattr(static, f.name).copy_(value)
            graph.replay()
            got.append((out.clone(), module.k_cache.clone(), module.v_cache.clone()))
        del graph
        runs.append(got)
    for (logits, k, v), (logits0, k0, v0) in zip(*runs):
        assert torch.isfinite(logits).all()
        assert torch.equal(logits, logits0)
        assert torch.equal(k.view(torch.uint8), k0.view(torch.uint8))
        assert torch.equal(v.view(torch.uint8), v0.view(torch.uint8))


def _skip_without_pdl():
    from vt.torch import triton_pdl
    if not triton_pdl.launch_options(torch.device("cuda"), 1)["PDL"]:
        pytest.skip("PDL needs compute capability 9.0 (and VT_TRITON_PDL not 0)")


@pytest.mark.gpu
def test_one_row_step_with_pdl_equals_it_without_bit_for_bit_on_cuda(monkeypatch):
    """bf16 on CUDA: a one-row decode step (head_dim 32: every kernel of it Triton's, each
    launched with programmatic dependent launch), 12 replays (_assert_pdl_changes_no_bit)."""
    be = _cuda()
    try:
        _skip_without_pdl()
        ref = tiny_llama(be, cfg=CONFIGS["llama-hd32"], dtype=torch.bfloat16, kernels="torch")
        fast = twin(ref, "vt", "triton")
        _assert_pdl_changes_no_bit(fast, [[1 + (97 * i) % GEO.max_context] for i in range(12)],
                                   monkeypatch)
    finally:
        be.close()


@pytest.mark.gpu
def test_w8a8_step_with_pdl_equals_it_without_bit_for_bit_on_cuda(monkeypatch):
    """FP8 weights and KV cache, 32 rows: the W8A8 linears and the quantizations around them
    take PDL at every row count (triton_pdl's any_rows), between split attention that merges
    in its own kernel and the other kernels launched without it; 6 replays."""
    from vt.step import KVGeometry
    from vt.torch.llama import LlamaDecoder
    be = _cuda()
    try:
        _skip_without_pdl()
        geo = KVGeometry(max_seqs=32, num_kv_blocks=32 * 8 + 1, block_size=4, max_context=32)
        torch.manual_seed(0)
        module = LlamaDecoder(CONFIGS["llama-hd32"], geo, dtype=torch.bfloat16, device="cuda",
                              quantization="fp8", kv_cache_dtype="fp8")
        steps = [[1 + (37 * i + 11 * n) % geo.max_context for n in range(32)] for i in range(6)]
        _assert_pdl_changes_no_bit(module, steps, monkeypatch)
    finally:
        be.close()
