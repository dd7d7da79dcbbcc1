"""LlamaDecoder(batch_invariant=True) on the CPU and the sim: a token's logits bits depend on
that token's sequence alone, not on what else the step holds.

Op level, on fresh random inputs: the row-invariant linear, norm and SiLU product give each
row the bytes it gets alone, inside batches of 2..300 rows (F.linear does not: the check can
fail); paged attention with invariant=True gives a token the same bytes as a one-row decode
step, inside a decode step of other rows and inside prompt chunks cut at every bound.
Decoder level: a decode row alone and among other rows, bytes equal; a near tie built so that
the default decoder's greedy token flips between the two, and the invariant one's does not.
End to end: a near-tie prompt served by vt's Engine on the sim (prefill="flat"), alone and
among 30 concurrent requests, in sync and ring, gives the same tokens and logits bytes with
batch_invariant=True; with it off the logits bytes differ (so the comparison can fail).
"""
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")
pytestmark = pytest.mark.torch_allocator   # PyTorch's caching allocator keeps its blocks

import torch.nn.functional as F  # noqa: E402

from vt.engine import Engine  # noqa: E402
from vt.config import ExecutorConfig  # noqa: E402
from vt.step import KVGeometry  # noqa: E402
from vt.torch import TorchForwardModel, TorchInputs, cpu_ops  # noqa: E402
from vt.torch import paged_attention as pa  # noqa: E402
from vt.torch.llama import LlamaDecoder, resolve_kernels  # noqa: E402

from _torch_util import TINY  # noqa: E402

LLAMA = dataclasses.replace(TINY, qk_norm=False)
# 31 requests at once: the near-tie prompt and 30 others.
GEO31 = KVGeometry(max_seqs=32, num_kv_blocks=32 * 4 + 1, block_size=4, max_context=16)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def decoder(cfg, geometry, invariant: bool, seed: int = 0) -> LlamaDecoder:
    """Seeded random weights, spread so that logits are well apart (as _torch_util's)."""
    torch.manual_seed(seed)
    m = LlamaDecoder(cfg, geometry, dtype=torch.float32, device="cpu",
                     batch_invariant=invariant)
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 2.0 / p.shape[1] ** 0.5)
    return m


# --- ops -------------------------------------------------------------------------------

@pytest.mark.parametrize("K,N", [(64, 160), (576, 960), (1536, 576)])
def test_linear_rows_give_each_row_its_bytes_alone_and_f_linear_does_not(K, N):
    g = torch.Generator().manual_seed(K)
    x, w, b = torch.randn(300, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N)
    alone = torch.cat([cpu_ops.linear_rows(x[i:i + 1], w, b) for i in range(300)])
    plain_alone = torch.cat([F.linear(x[i:i + 1], w, b) for i in range(300)])
    plain_differs = 0
    for M in (2, 7, 31, 300):
        rows = torch.randperm(300, generator=g)[:M]
        assert same_bytes(cpu_ops.linear_rows(x[rows], w, b), alone[rows]), M
        plain_differs += not same_bytes(F.linear(x[rows], w, b), plain_alone[rows])
    assert plain_differs, "F.linear gave every row its one-row bytes: the check proves nothing"
    want = F.linear(x.double(), w.double(), b.double())
    assert ((alone.double() - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.parametrize("width", [64, 576, 1536, 14336])
def test_norm_and_silu_rows_give_each_row_its_bytes_alone(width):
    g = torch.Generator().manual_seed(width)
    x, w = torch.randn(300, 2 * width, generator=g), torch.randn(2 * width, generator=g)
    norm_alone = torch.cat([cpu_ops.rms_norm(x[i:i + 1], w, 1e-6) for i in range(300)])
    silu_alone = torch.cat([cpu_ops.silu_mul(x[i:i + 1]) for i in range(300)])
    for M in (2, 7, 31, 300):
        rows = torch.randperm(300, generator=g)[:M]
        assert same_bytes(cpu_ops.rms_norm_rows(x[rows], w, 1e-6), norm_alone[rows]), M
        assert same_bytes(cpu_ops.silu_mul_rows(x[rows]), silu_alone[rows]), M


def _cache(g, blocks=64, block_size=4, kv_heads=2, head_dim=16):
    k = torch.randn(blocks * block_size, kv_heads, head_dim, generator=g)
    return k, torch.randn(k.shape, generator=g)


def test_invariant_attention_gives_a_token_the_same_bytes_in_any_step():
    """Token t of a 23-token sequence: a one-row decode step, a row of a 5-row decode step,
    a decode row of a mixed step, and every position inside prompt chunks cut at every
    bound beside another sequence: one set of bytes (and within 1e-5 of float64)."""
    g = torch.Generator().manual_seed(0)
    bs, heads, hd, L = 4, 4, 16, 23
    k, v = _cache(g)
    table = torch.randperm(63, generator=g)[:8].add(1).int()       # the sequence's blocks
    other = torch.randperm(63, generator=g)[:8].add(1).int()
    q = torch.randn(L, heads, hd, generator=g)                       # every position's query
    i32 = lambda *xs: torch.tensor(xs, dtype=torch.int32)   # noqa: E731
    alone = torch.stack([pa.paged_decode_attention(q[t:t + 1], k, v, table[None], i32(t + 1),
                                                   block_size=bs, invariant=True)[0]
                         for t in range(L)])
    for t in (0, 5, L - 1):   # a decode row among others (other rows: other lengths)
        rows = torch.randn(5, heads, hd, generator=g)
        rows[2] = q[t]
        tables = torch.stack([other, other, table, other, other])
        out = pa.paged_decode_attention(rows, k, v, tables, i32(3, 9, t + 1, 1, 30),
                                        block_size=bs, invariant=True)
        assert same_bytes(out[2], alone[t]), t
    for start in range(L):           # a chunk of positions start..L-1 after another sequence
        n = L - start
        qs = torch.cat([torch.randn(3, heads, hd, generator=g), q[start:]])
        out = pa.paged_varlen_attention(qs, k, v, i32(0, 3, 3 + n), i32(7, L),
                                        torch.stack([other, table]), block_size=bs,
                                        max_query_len=max(n, 3), invariant=True)
        assert same_bytes(out[3:], alone[start:]), start
    mixed = pa.paged_varlen_attention(torch.cat([q[9:10], q[:4]]), k, v, i32(0, 1, 5),
                                      i32(10, 4), torch.stack([table, other]), block_size=bs,
                                      max_query_len=4, invariant=True)
    assert same_bytes(mixed[0], alone[9])
    ref = torch.stack([_attention_float64(q[t], k, v, table, t + 1, bs) for t in range(L)])
    assert ((alone.double() - ref).norm() / ref.norm()).item() < 1e-5


def _attention_float64(q, k, v, table, length, bs):
    slots = pa.live_slots(table, length, bs)
    group = q.shape[0] // k.shape[1]
    keys = k[slots].double().repeat_interleave(group, 1)
    vals = v[slots].double().repeat_interleave(group, 1)
    probs = (torch.einsum("hd,lhd->hl", q.double(), keys) / q.shape[1] ** 0.5).softmax(-1)
    return torch.einsum("hl,lhd->hd", probs, vals)


# --- the decoder ------------------------------------------------------------------------

def decode_inputs(table, rows, positions, tables) -> TorchInputs:
    """A decode step of rows `rows` (token_table rows) at `positions` over `tables`."""
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)   # noqa: E731
    pos = i32(positions)
    bs = 4
    slots = tables[torch.arange(len(rows)), pos.long() // bs] * bs + pos % bs
    return TorchInputs.decode(table, i32(rows), pos, pos + 1, slots.int(), tables,
                              i32([0] * len(rows)))


def row_alone_and_in_a_batch(m: LlamaDecoder, seed: int):
    """Logits of decode row 0 alone and as row 3 of 6 rows, the cache restored between."""
    g = torch.Generator().manual_seed(seed)
    geo = m.geometry
    with torch.no_grad():
        m.k_cache.normal_(generator=g)
        m.v_cache.normal_(generator=g)
    kc, vc = m.k_cache.clone(), m.v_cache.clone()
    tables = (1 + torch.randperm(geo.num_kv_blocks - 1, generator=g)[:6 * geo.max_blocks]
              ).view(6, geo.max_blocks).int()
    table = torch.randint(0, m.cfg.vocab, (geo.max_seqs + 1,), generator=g).int()
    order = [1, 2, 4, 0, 3, 5]   # row 0 sits at index 3 of the batch
    positions = [11, 3, 14, 0, 7, 12]
    alone = torch.empty(1, m.cfg.vocab)
    m(decode_inputs(table, [0], [positions[0]], tables[:1]), alone)
    with torch.no_grad():
        m.k_cache.copy_(kc)
        m.v_cache.copy_(vc)
    batch = torch.empty(6, m.cfg.vocab)
    m(decode_inputs(table, order, [positions[r] for r in order], tables[order]), batch)
    return alone[0], batch[3]


@pytest.mark.parametrize("cfg", [LLAMA, TINY, dataclasses.replace(LLAMA, head_dim=32)],
                         ids=["llama", "qwen3", "llama-hd32"])
def test_a_decode_row_has_its_bytes_alone_in_a_batch_only_when_invariant(cfg):
    geo = KVGeometry(max_seqs=8, num_kv_blocks=64, block_size=4, max_context=32)
    alone, batch = row_alone_and_in_a_batch(decoder(cfg, geo, invariant=True), seed=1)
    assert same_bytes(alone, batch)
    alone, batch = row_alone_and_in_a_batch(decoder(cfg, geo, invariant=False), seed=1)
    assert not same_bytes(alone, batch)


def test_a_near_tie_flips_on_the_default_decoder_and_not_on_the_invariant_one():
    """A runner-up's head row scaled until, on the default decoder, the row's greedy token
    alone differs from its token in the batch; the invariant decoder with the same weights
    gives one token and one set of logits bytes."""
    geo = KVGeometry(max_seqs=8, num_kv_blocks=64, block_size=4, max_context=32)
    default, invariant = decoder(LLAMA, geo, False), decoder(LLAMA, geo, True)
    flipped = _flip_a_near_tie(default, seed=2)
    assert flipped, "no scale of a runner-up's head row flipped the default decoder's token"
    invariant.load_state_dict(default.state_dict())
    a, b = row_alone_and_in_a_batch(invariant, seed=2)
    assert a.argmax() == b.argmax() and same_bytes(a, b)
    top2 = a.topk(2).values
    assert (top2[0] - top2[1]).item() < 1e-5 * abs(top2[0].item()), "not a near tie"


def _flip_a_near_tie(m: LlamaDecoder, seed: int) -> bool:
    """Scale the head row of a runner-up y until logit(y) falls between the winner x's
    logits alone and in the batch, or x's between y's: the greedy token then differs. The
    logit is linear in the row, so the scale that puts it there is known but for float32's
    rounding, which a few neighbouring scales get past. True once the token differs."""
    alone, batch = row_alone_and_in_a_batch(m, seed)
    x = alone.argmax().item()
    head = m.lm_head.weight
    for y in alone.topk(8).indices.tolist()[1:]:
        if alone[y] <= 0 or alone[y] == batch[y] and alone[x] == batch[x]:
            continue
        base = head[y].clone()
        f0 = (alone[x] / alone[y]).item()
        spread = abs((alone[y] - batch[y]) / alone[y]).item() + abs(
            (alone[x] - batch[x]) / alone[x]).item()
        for f in f0 * (1 + spread * np.linspace(-3, 3, 61)):
            with torch.no_grad():
                head[y] = base * f
            a, b = row_alone_and_in_a_batch(m, seed)
            if a.argmax() != b.argmax():
                return True
        with torch.no_grad():
            head[y] = base
    return False


# --- served by the Engine on the sim -----------------------------------------------------

def near_tie_decoder(invariant: bool):
    """A tiny decoder and a prompt whose first greedy token wins by a few float32 ulps on
    the invariant decoder (the runner-up's head row scaled up to the winner's logit)."""
    m = decoder(LLAMA, GEO31, invariant=True, seed=3)
    prompt = [5, 17, 2, 41, 8, 30, 11]
    first = first_token_logits(m, prompt)
    top, second = first.topk(2).indices.tolist()
    head = m.lm_head.weight
    with torch.no_grad():
        base = head[second].clone()
        for below in np.linspace(0.0, 1e-3, 200):   # the runner-up's logit, below the top's
            target = first[top].item() - abs(first[top].item()) * below
            head[second] = base * (target / first[second].item())
            logits = first_token_logits(m, prompt)
            if logits.argmax() == top and logits[top] - logits[second] < 1e-5 * abs(logits[top]):
                break
        else:
            raise AssertionError("no scale made a near tie")
    if not invariant:
        twin = decoder(LLAMA, GEO31, invariant=False)
        twin.load_state_dict(m.state_dict())
        m = twin
    return m, prompt


def first_token_logits(m: LlamaDecoder, prompt) -> torch.Tensor:
    """The prompt's last position's logits, one position per call (the decoder's cache
    overwritten)."""
    g = m.geometry
    table = torch.zeros(g.max_seqs + 1, dtype=torch.int32)
    blocks = torch.arange(1, g.max_blocks + 1, dtype=torch.int32)[None]
    out = torch.empty(1, m.cfg.vocab)
    i32 = lambda v: torch.tensor([v], dtype=torch.int32)   # noqa: E731
    for p, tok in enumerate(prompt):
        table[0] = tok
        slot = int(blocks[0, p // g.block_size]) * g.block_size + p % g.block_size
        m(TorchInputs.decode(table, i32(0), i32(p), i32(p + 1), i32(slot), blocks, i32(0)), out)
    return out[0].clone()


def serve_alone_and_among_30(be, m: LlamaDecoder, prompt, mode: str):
    """(the prompt's result alone, its result as the 13th of 31 requests submitted at once),
    on one engine; prompts are prefilled 24 tokens a step, so chunks of them share steps
    with the first requests' decode rows."""
    rng = np.random.default_rng(4)
    others = [rng.integers(0, m.cfg.vocab, size=int(rng.integers(1, 8))).tolist()
              for _ in range(30)]
    batch = others[:12] + [prompt] + others[12:]
    model = TorchForwardModel(be, m, prefill="flat")
    cfg = ExecutorConfig(mode=mode, serving_conc=32, capture_sizes=(1, 32))
    with Engine(be, model, cfg, record_logits=True, max_prefill_tokens=24) as eng:
        alone = eng.generate([prompt], max_new_tokens=6)[0]
        among = eng.generate(batch, max_new_tokens=6)[12]
        stats = eng.stats()   # captured decode steps, and prompt chunks beside decode rows
        assert stats["graph_steps"] > 0 and stats["mixed_steps"] > 0
    return alone, among


@pytest.mark.parametrize("mode", ["sync", "ring"])
def test_near_tie_prompt_alone_and_among_30_is_bytes_equal_when_invariant(sim_backend, mode):
    m, prompt = near_tie_decoder(invariant=True)
    alone, among = serve_alone_and_among_30(sim_backend, m, prompt, mode)
    assert list(alone.tokens) == list(among.tokens)
    assert alone.logits.tobytes() == among.logits.tobytes()
    top2 = np.sort(alone.logits[0])[-2:]
    assert top2[1] - top2[0] < 1e-5 * abs(top2[1]), "the prompt is not a near tie"


def test_the_same_prompt_on_the_default_decoder_gets_other_logits_bytes(sim_backend):
    """The comparison above can fail: without batch_invariant the logits bytes differ."""
    m, prompt = near_tie_decoder(invariant=False)
    alone, among = serve_alone_and_among_30(sim_backend, m, prompt, "sync")
    assert alone.logits.tobytes() != among.logits.tobytes()


# --- the switch ---------------------------------------------------------------------------

def test_the_switch_reads_vt_batch_invariant_and_refuses_what_it_cannot_keep(monkeypatch):
    geo = KVGeometry(max_seqs=2, num_kv_blocks=8, block_size=4, max_context=8)
    monkeypatch.setenv("VT_BATCH_INVARIANT", "1")
    assert LlamaDecoder(LLAMA, geo, device="cpu").batch_invariant is True
    assert LlamaDecoder(LLAMA, geo, device="cpu", batch_invariant=False).batch_invariant is False
    monkeypatch.setenv("VT_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="VT_BATCH_INVARIANT must be 0 or 1, got 'yes'"):
        LlamaDecoder(LLAMA, geo, device="cpu")
    monkeypatch.delenv("VT_BATCH_INVARIANT")
    assert LlamaDecoder(LLAMA, geo, device="cpu").batch_invariant is False
    with pytest.raises(TypeError, match="batch_invariant must be a bool or None, got 1"):
        LlamaDecoder(LLAMA, geo, device="cpu", batch_invariant=1)
    with pytest.raises(ValueError, match="batch_invariant=True runs every step on vt's kernels; "
                                         "kernels='torch'"):
        LlamaDecoder(LLAMA, geo, device="cpu", kernels="torch", batch_invariant=True)
    with pytest.raises(ValueError, match="prompt_kernels='torch' must be 'auto' or 'vt'"):
        LlamaDecoder(LLAMA, geo, device="cpu", prompt_kernels="torch", batch_invariant=True)
    with pytest.raises(ValueError, match="linear='triton' with batch_invariant=True"):
        LlamaDecoder(LLAMA, geo, device="cpu", linear="triton", batch_invariant=True)
    with pytest.raises(ValueError, match="needs a power-of-two head_dim.*head_dim=96"):
        resolve_kernels("auto", "auto", torch.device("cuda"), 96, invariant=True)
    m = LlamaDecoder(LLAMA, geo, device="cpu", batch_invariant=True)
    assert (m.kernels, m.prompt_kernels, m.linear) == ("vt", "vt", "invariant")
