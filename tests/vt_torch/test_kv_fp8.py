"""The FP8 KV cache (LlamaDecoder(kv_cache_dtype="fp8"), vt.torch.kv_fp8) on the CPU: the codes
written, paged attention over the codes equal (bit for bit) to the same attention over a cache
in the query's dtype holding their dequantized values, the decoder's logits near the bf16/fp32
cache's, its prompt and decode paths agreeing, its captured steps on the sim giving its eager
tokens, and the refusals. The Triton kernels' twins: test_kv_fp8_triton.py."""
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")
pytestmark = pytest.mark.torch_allocator

from vt.config import ExecutorConfig  # noqa: E402
from vt.engine import Engine  # noqa: E402
from vt.torch import TorchForwardModel, TorchInputs, fused, kv_fp8  # noqa: E402
from vt.torch.llama import LlamaDecoder  # noqa: E402
from vt.torch.paged_attention import (paged_decode_attention, paged_varlen_attention,  # noqa: E402
                                      rope_cache_decode_attention)

from _torch_util import GEO, TINY, eager_greedy, generate, prompts, step_model  # noqa: E402

FP8 = torch.float8_e4m3fn
# qwen3: q/k norms, RoPE and the KV write in torch ops; llama: the fused RoPE-and-cache;
# llama-hd32: a one-row step's RoPE, KV write and attention in one call.
CONFIGS = {"qwen3": TINY, "llama": dataclasses.replace(TINY, qk_norm=False),
           "llama-hd32": dataclasses.replace(TINY, qk_norm=False, head_dim=32)}


def decoder(cfg, kv_cache_dtype, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = LlamaDecoder(cfg, GEO, dtype=dtype, device="cpu", kv_cache_dtype=kv_cache_dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 2.0 / p.shape[1] ** 0.5)
    return model


def test_the_codes_are_x_over_the_scale_clamped_and_rounded_to_nearest_e4m3():
    x = torch.tensor([0.3, 1.0, -1000.0, 500.0, 0.0, 2 ** -12, 1.0625 * 2])
    codes = kv_fp8.quantize(x, torch.tensor(2.0))
    assert codes.dtype == FP8
    # 0.15 -> 0.15625 (e4m3 near 0.15: 0.140625, 0.15625); 250 -> 256 (240, 256); the clamp
    # at +-448; 2^-13 is below half e4m3's smallest subnormal 2^-9: 0; 1.0625 ties to even 1.0
    assert codes.float().tolist() == [0.15625, 0.5, -448.0, 256.0, 0.0, 0.0, 1.0]
    assert kv_fp8.dequantize(codes, torch.tensor(2.0), torch.float32).tolist() == [
        0.3125, 1.0, -896.0, 512.0, 0.0, 0.0, 2.0]


def _cache(slots, kv_heads, hd, scale, seed):
    g = torch.Generator().manual_seed(seed)
    codes = kv_fp8.quantize(torch.randn(slots, kv_heads, hd, generator=g) * 3, scale)
    return codes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.5, 0.37])
def test_paged_attention_over_codes_is_attention_over_their_values(dtype, scale):
    """Decode and varlen attention over an FP8 cache (the codes as they are, K's scale on the
    scores, V's on the output): bit for bit the same calls over a cache in q's dtype holding
    kv_fp8.dequantize's values where the scales are powers of two (vt's 1.0; the values are
    then exact in the dtype); otherwise float32 attention over the exact values, but for the
    output's rounding to q's dtype."""
    ks, vs = torch.tensor(scale), torch.tensor(scale * 2)
    bs, kvh, hd, heads = 4, 2, 16, 4
    kc, vc = _cache(64, kvh, hd, ks, 1), _cache(64, kvh, hd, vs, 2)
    power_of_two = scale != 0.37
    ref = dtype if power_of_two else torch.float32
    kd, vd = kv_fp8.dequantize(kc, ks, ref), kv_fp8.dequantize(vc, vs, ref)
    tables = torch.tensor([[3, 1, 7, 2], [5, 9, 4, 0], [11, 12, 13, 14]], dtype=torch.int32)
    lens = torch.tensor([13, 6, 16], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, heads, hd, generator=g).to(dtype)
    qsl = torch.tensor([0, 5, 6, 10], dtype=torch.int32)
    qv = torch.randn(10, heads, hd, generator=g).to(dtype)
    pairs = [(paged_decode_attention(q, kc, vc, tables, lens, block_size=bs, k_scale=ks,
                                     v_scale=vs),
              paged_decode_attention(q.to(ref), kd, vd, tables, lens, block_size=bs)),
             (paged_varlen_attention(qv, kc, vc, qsl, lens, tables, block_size=bs,
                                     max_query_len=5, k_scale=ks, v_scale=vs),
              paged_varlen_attention(qv.to(ref), kd, vd, qsl, lens, tables, block_size=bs,
                                     max_query_len=5))]
    for got, want in pairs:
        assert got.dtype == dtype
        if power_of_two:
            assert torch.equal(got, want)
        else:   # float32 rounding (relative to the output's scale), then bf16's (2^-9)
            rtol = 0 if dtype == torch.float32 else 2 ** -8
            assert torch.allclose(got.float(), want, rtol=rtol, atol=1e-5 * want.abs().max())
    if scale == 1.0:   # e4m3's values are bf16's: the read is exact
        assert torch.equal(kd.float(), kc.float())


def test_the_kv_write_stores_the_codes_of_what_a_cache_in_the_models_dtype_stores():
    """rope_and_cache and rope_cache_decode_attention into an FP8 cache: the codes are
    kv_fp8.quantize of the rotated key and the value that a bf16 cache receives, and the
    one-call attention is paged attention over the written codes (this step's own included)."""
    S, heads, kvh, hd, bs = 3, 4, 2, 32, 4
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(S, (heads + 2 * kvh) * hd, generator=g) * 2).bfloat16()
    pos = torch.tensor([3, 0, 9], dtype=torch.int32)
    cos, sin = (torch.randn(16, hd, generator=g) for _ in range(2))
    slots = torch.tensor([7, 8, 21], dtype=torch.int32)
    ks, vs = torch.tensor(0.5), torch.tensor(0.25)
    kb, vb = torch.zeros(32, kvh, hd).bfloat16(), torch.zeros(32, kvh, hd).bfloat16()
    kc, vc = torch.zeros(32, kvh, hd, dtype=FP8), torch.zeros(32, kvh, hd, dtype=FP8)
    args = dict(heads=heads, kv_heads=kvh, head_dim=hd)
    qb = fused.rope_and_cache(qkv, pos, cos, sin, kb, vb, slots, **args)
    q8 = fused.rope_and_cache(qkv, pos, cos, sin, kc, vc, slots, **args, k_scale=ks, v_scale=vs)
    assert torch.equal(qb, q8)
    s = slots.long()
    assert torch.equal(kc[s].view(torch.uint8), kv_fp8.quantize(kb[s], ks).view(torch.uint8))
    assert torch.equal(vc[s].view(torch.uint8), kv_fp8.quantize(vb[s], vs).view(torch.uint8))
    tables = torch.tensor([[1, 0, 2], [2, 0, 0], [3, 4, 5]], dtype=torch.int32)
    lens = pos + 1
    tables[:, 0] = torch.tensor([1, 2, 3])
    slots = torch.tensor([1 * bs + 3, 2 * bs + 0, 4 * bs + 1], dtype=torch.int32)   # each pos
    k2, v2 = torch.zeros(32, kvh, hd, dtype=FP8), torch.zeros(32, kvh, hd, dtype=FP8)
    got = rope_cache_decode_attention(qkv, pos, cos, sin, k2, v2, slots, tables, lens,
                                      block_size=bs, k_scale=ks, v_scale=vs, **args)
    want = paged_decode_attention(q8, kv_fp8.dequantize(k2, ks, qkv.dtype),
                                  kv_fp8.dequantize(v2, vs, qkv.dtype), tables, lens,
                                  block_size=bs)
    assert torch.equal(got, want)


def position_logits(module, prompt):
    """Logits [len(prompt), vocab] of the module called one position at a time (decode steps)
    for one sequence."""
    dev, g = module.k_cache.device, module.geometry
    table = torch.zeros(g.max_seqs + 1, dtype=torch.int32, device=dev)
    blocks = torch.arange(1, g.max_blocks + 1, dtype=torch.int32, device=dev)[None]
    out = []
    for p, tok in enumerate(prompt):
        table[0] = tok
        i32 = lambda v: torch.tensor([v], dtype=torch.int32, device=dev)   # noqa: E731
        slot = int(blocks[0, p // g.block_size]) * g.block_size + p % g.block_size
        logits = torch.empty(1, module.cfg.vocab, device=dev)
        module(TorchInputs.decode(table, i32(0), i32(p), i32(p + 1), i32(slot), blocks, i32(0)),
               logits)
        out.append(logits[0])
    return torch.stack(out)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_fp8_decoder_is_a_float32_cache_decoder_holding_the_dequantized_values(
        name, monkeypatch):
    """Bit for bit: the FP8-KV decoder's logits equal those of the same decoder with a float32
    cache into which each key and value is written as its e4m3 code's value (scale 1.0),
    every KV write path included (the torch write, rope_and_cache, the one-row call)."""
    cfg = CONFIGS[name]
    prompt = (prompts(1, seed=9, max_len=20)[0] * 20)[:12]
    fp8 = decoder(cfg, "fp8")
    ref = decoder(cfg, "auto")
    ref.load_state_dict(fp8.state_dict())
    got = position_logits(fp8, prompt)
    one = torch.tensor(1.0)

    def write_dequantized(cache, slots, x, scale):
        assert scale is None and cache.dtype == torch.float32   # the reference's cache
        cache.index_copy_(0, slots, kv_fp8.dequantize(kv_fp8.quantize(x, one), one, x.dtype))
    monkeypatch.setattr(kv_fp8, "write", write_dequantized)
    assert torch.equal(got, position_logits(ref, prompt))


# Relative Frobenius error of the logits, FP8 against the model's-dtype cache, over 20
# positions of this tiny random model (float32): measured 0.064 (qwen3), 0.094 (llama),
# 0.107 (llama-hd32). e4m3 rounds each K and V element by up to 2^-4 relative, and the
# random weights (no trained structure) pass that on at about its size.
FP8_KV_LOGITS_RTOL = 0.15


@pytest.mark.parametrize("name", CONFIGS)
def test_fp8_kv_logits_are_near_the_model_dtype_caches(name):
    cfg = CONFIGS[name]
    prompt = prompts(1, seed=7, max_len=20)[0] + prompts(1, seed=8, max_len=20)[0]
    prompt = (prompt * 4)[:20]
    ref = position_logits(decoder(cfg, "auto"), prompt)
    got = position_logits(decoder(cfg, "fp8"), prompt)
    err = ((got - ref).norm() / ref.norm()).item()
    assert 0 < err < FP8_KV_LOGITS_RTOL, err   # > 0: the cache did hold FP8 codes


# The prompt step computes K and V in one matmul over its tokens, a decode step in one row
# each: their float32 values differ in the last bits, and where one sits at an e4m3 rounding
# boundary the codes differ by one step (2^-4 relative), which a model's-dtype cache never
# shows (test_torch_flat: 1e-4). Measured here: most requests within 4e-6, the largest
# difference 9.8e-3 (logits of magnitude ~3).
PROMPT_DECODE_ATOL = 3e-2


def _run(be, module, mode, ps, new, prefill):
    cfg = ExecutorConfig(mode=mode, serving_conc=4, capture_sizes=(1, 2, 4))
    model = TorchForwardModel(be, module, vocab=module.cfg.vocab, geometry=GEO, prefill=prefill)
    with Engine(be, model, cfg, record_logits=True) as eng:
        return eng.generate(ps, max_new_tokens=new)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_prompt_and_decode_paths_agree_and_captured_steps_give_the_eager_tokens(
        sim_backend, name):
    """An FP8-KV decoder on the sim: each request's first-token logits from the flat prompt
    step (paged varlen attention) are within PROMPT_DECODE_ATOL of the position-by-position
    decode steps',
    and ring mode's captured decode steps give the greedy tokens of the module called
    eagerly, position by position."""
    module = decoder(CONFIGS[name], "fp8", seed=3)
    assert module.k_cache.dtype == FP8 and module.layers[0].attn.k_scale.item() == 1.0
    ps = prompts(4, seed=5, max_len=12)
    flat = _run(sim_backend, module, "ring", ps, 5, "flat")
    positions = _run(sim_backend, module, "sync", ps, 1, "positions")
    for f, p in zip(flat, positions):
        np.testing.assert_allclose(f.logits[0], p.logits[0], atol=PROMPT_DECODE_ATOL, rtol=0)
    expect = [eager_greedy(module, p, 5) for p in ps]
    assert [list(map(int, r.tokens)) for r in flat] == expect
    assert generate(sim_backend, step_model(sim_backend, module), "ring", ps, 5) == expect


def test_fp8_weights_and_an_fp8_kv_cache_together_serve_the_eager_tokens(sim_backend,
                                                                          monkeypatch):
    """quantization="fp8" with kv_cache_dtype="fp8": FP8 projections and an FP8 cache, and
    ring mode's captured steps on the sim give the module's eager greedy tokens. Every step
    quantizes its activations (W8A8 from one row), so an eager prompt step of one prompt and
    the engine's of all three compute each row alike (test_fp8_load.py says why)."""
    from vt.torch import fp8
    from vt.torch.llama import quantize_weights_
    monkeypatch.setattr(fp8, "W8A8_MIN_ROWS", 1)
    dense = decoder(CONFIGS["llama"], "auto", seed=4)
    module = LlamaDecoder(CONFIGS["llama"], GEO, dtype=torch.float32, device="cpu",
                          quantization="fp8", kv_cache_dtype="fp8")
    quantize_weights_(module, dense.state_dict())
    assert module.k_cache.dtype == FP8 and module.layers[0].attn.qkv.qweight.dtype == FP8
    ps = prompts(3, seed=6, max_len=10)
    expect = [eager_greedy(module, p, 5) for p in ps]
    assert generate(sim_backend, step_model(sim_backend, module), "ring", ps, 5) == expect


def test_the_kv_cache_dtype_is_checked_in_one_line():
    cfg = CONFIGS["llama"]
    cases = [(dict(kv_cache_dtype="fp16"), "kv_cache_dtype='fp16' must be one of"),
             (dict(kv_cache_dtype="fp8", kernels="torch"),
              "kv_cache_dtype='fp8' runs on vt's kernels"),
             (dict(kv_cache_dtype="fp8", prompt_kernels="torch"),
              "kv_cache_dtype='fp8' runs on vt's kernels"),
             (dict(kv_cache_dtype="fp8", batch_invariant=True),
              "kv_cache_dtype='fp8' with batch_invariant=True is not implemented")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            LlamaDecoder(cfg, GEO, dtype=torch.float32, device="cpu", **kwargs)
        assert "\n" not in str(e.value)
    assert LlamaDecoder(cfg, GEO, dtype=torch.float32, device="cpu",
                        kv_cache_dtype=None).k_cache.dtype == torch.float32


def test_paged_attention_refuses_an_fp8_cache_without_its_scales_or_invariant():
    q = torch.randn(1, 4, 16)
    kc = torch.zeros(8, 2, 16, dtype=FP8)
    tables, lens = torch.tensor([[1]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match="needs k_scale a float32 tensor of one element, got None"):
        paged_decode_attention(q, kc, kc, tables, lens, block_size=4)
    with pytest.raises(ValueError, match="FP8 cache with invariant=True is not implemented"):
        paged_decode_attention(q, kc, kc, tables, lens, block_size=4, invariant=True,
                               k_scale=one, v_scale=one)
    with pytest.raises(ValueError, match="k_scale and v_scale are for an FP8 cache"):
        paged_decode_attention(q, q.new_zeros(8, 2, 16), q.new_zeros(8, 2, 16), tables, lens,
                               block_size=4, k_scale=one, v_scale=one)
