"""Speculative decoding over vt.torch's LlamaDecoder: its decode is the verify step (a row's
k + 1 tokens as decode rows over its cached prefix). The sim twin of the GPU test below."""
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from vt.backend.zeros import zeros  # noqa: E402
from vt.engine.speculative import generate_speculative  # noqa: E402
from vt.forward.speculative import SpeculativeConfig, SpeculativeModel, verify_table_rows  # noqa: E402
from vt.config import ExecutorConfig  # noqa: E402
from vt.torch import TorchForwardModel  # noqa: E402
from vt.engine import Engine  # noqa: E402
from vt.backend import available_backends  # noqa: E402

from vt_torch._torch_util import GEO, TINY, prompts as make_prompts, tiny_llama  # noqa: E402

K = 4


def _run(be, mode, method, accept=1.0):
    ps = make_prompts(4, seed=3)
    budgets = [10, 14, 12, 9]
    with Engine(be, TorchForwardModel(be, tiny_llama(be), geometry=GEO),
                ExecutorConfig(mode="drain", capture_sizes=(1, 2, 4))) as eng:
        want = [r.tokens for r in eng.generate(ps, max_new_tokens=budgets)]
    table = zeros(be, (verify_table_rows(GEO.max_seqs, GEO.max_seqs, K),), np.int32)
    target = TorchForwardModel(be, tiny_llama(be), geometry=GEO, token_table=table)
    refs = {tuple(p): w for p, w in zip(ps, want)}
    model = SpeculativeModel(be, target, SpeculativeConfig(method, k=K, accept=accept, references=refs))
    got, st = generate_speculative(be, model, ExecutorConfig(mode=mode, capture_sizes=(1, 2, 4)),
                                   ps, budgets)
    return got, want, st


@pytest.mark.parametrize("method,accept", [("oracle", 1.0), ("oracle", 0.5), ("ngram", 1.0)])
def test_llama_speculative_tokens_equal_its_own_on_the_sim(sim_backend, method, accept):
    got, want, st = _run(sim_backend, "ring", method, accept)
    assert all(np.array_equal(a, b) for a, b in zip(got, want)), (got, want)
    if method == "oracle":
        assert st.acceptance_rate == pytest.approx(accept, abs=0.15)


@pytest.mark.gpu
@pytest.mark.skipif("cuda" not in available_backends(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["drain", "ring", "staged"])
@pytest.mark.parametrize("method", ["oracle", "ngram"])
def test_llama_speculative_tokens_equal_its_own_on_the_gpu(mode, method):
    from vt.backend import get_backend
    be = get_backend("cuda")
    try:
        got, want, _ = _run(be, mode, method)
    finally:
        be.close()
    assert all(np.array_equal(a, b) for a, b in zip(got, want)), (got, want)


TINY4 = dataclasses.replace(TINY, layers=4)


def _draft_run(be, mode, draft_kind):
    """A 4-layer decoder (random weights) with a draft of its own: "itself" (a second decoder
    with its weights, its own KV cache) or "two layers" (a 2-layer decoder of other random
    weights). Its tokens alone, and with the draft proposing."""
    ps = make_prompts(4, seed=3)
    budgets = [10, 14, 12, 9]
    cfg = ExecutorConfig(mode="drain", capture_sizes=(1, 2, 4))
    with Engine(be, TorchForwardModel(be, tiny_llama(be, cfg=TINY4), geometry=GEO), cfg) as eng:
        want = [r.tokens for r in eng.generate(ps, max_new_tokens=budgets)]
    table = lambda: zeros(be, (verify_table_rows(GEO.max_seqs, GEO.max_seqs, K),), np.int32)   # noqa: E731
    target = TorchForwardModel(be, tiny_llama(be, cfg=TINY4), geometry=GEO, token_table=table())
    module = tiny_llama(be, cfg=TINY4) if draft_kind == "itself" else tiny_llama(be, seed=1)
    draft = TorchForwardModel(be, module, geometry=GEO, token_table=table())
    model = SpeculativeModel(be, target, SpeculativeConfig("draft", k=K, draft=draft))
    got, st = generate_speculative(be, model, ExecutorConfig(mode=mode, capture_sizes=(1, 2, 4)),
                                   ps, budgets)
    return got, want, st


@pytest.mark.parametrize("draft_kind", ["itself", "two layers"])
def test_llama_with_a_llama_draft_gives_its_own_tokens_on_the_sim(sim_backend, draft_kind):
    """A vt.torch draft in the verify step's graph: the target's tokens; the target's own
    weights as the draft have every draft accepted."""
    got, want, st = _draft_run(sim_backend, "ring", draft_kind)
    assert all(np.array_equal(a, b) for a, b in zip(got, want)), (got, want)
    if draft_kind == "itself":
        assert st.acceptance_rate == 1.0, st
    else:
        assert st.acceptance_rate < 1.0, st


@pytest.mark.gpu
@pytest.mark.skipif("cuda" not in available_backends(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["drain", "ring", "staged"])
@pytest.mark.parametrize("draft_kind", ["itself", "two layers"])
def test_llama_with_a_llama_draft_gives_its_own_tokens_on_the_gpu(mode, draft_kind):
    """The GPU twin: the draft's passes (its decode at 2S and S rows, vt's CUDA sampler at
    temperature 0, the draft prologue and collect kernels) captured in the verify step's
    graph on cuda."""
    from vt.backend import get_backend
    be = get_backend("cuda")
    try:
        got, want, st = _draft_run(be, mode, draft_kind)
    finally:
        be.close()
    assert all(np.array_equal(a, b) for a, b in zip(got, want)), (got, want)
    if draft_kind == "itself":
        assert st.acceptance_rate > 0.9, st


def _engine_run(be, method, accept=1.0):
    """vt.torch's decoder through the Engine (prefix caching on, its default), a second turn
    hitting the first's cached blocks: speculation's tokens and the decoder's own."""
    ps = make_prompts(4, seed=5)
    budgets = [11, 7, 13, 9]
    cfg = ExecutorConfig(mode="ring", capture_sizes=(1, 2, 4))
    table = zeros(be, (verify_table_rows(GEO.max_seqs, GEO.max_seqs, K),), np.int32)
    module = tiny_llama(be)
    with Engine(be, TorchForwardModel(be, module, geometry=GEO, token_table=table), cfg) as eng:
        want = [r.tokens for r in eng.generate(ps, max_new_tokens=budgets)]
        turn2 = [list(p) + w + [3, 4] for p, w in zip(ps, want)]
        want2 = [r.tokens for r in eng.generate(turn2, max_new_tokens=6)]
    refs = {tuple(p): w for p, w in zip(ps + turn2, want + want2)}
    spec = SpeculativeConfig(method, k=K, accept=accept, references=refs)
    with Engine(be, TorchForwardModel(be, module, geometry=GEO, token_table=table), cfg,
                speculative=spec) as eng:
        assert eng.prefix_caching
        got = [r.tokens for r in eng.generate(ps, max_new_tokens=budgets)]
        got2 = [r.tokens for r in eng.generate(turn2, max_new_tokens=6)]
        st = eng.stats()
    return got + got2, want + want2, st


@pytest.mark.parametrize("method", ["oracle", "ngram"])
def test_llama_through_the_engine_with_prefix_caching_on_the_sim(sim_backend, method):
    got, want, st = _engine_run(sim_backend, method)
    assert got == want
    assert st["prefix_cache"]["cached_tokens"] > 0
    if method == "oracle":
        assert st["speculative"]["acceptance_rate"] > 0.6


@pytest.mark.gpu
@pytest.mark.skipif("cuda" not in available_backends(), reason="needs a CUDA GPU")
def test_llama_through_the_engine_with_prefix_caching_on_the_gpu():
    from vt.backend import get_backend
    be = get_backend("cuda")
    try:
        got, want, _ = _engine_run(be, "oracle")
    finally:
        be.close()
    assert got == want


def _one_token_steps_and_a_verify_step(device: str, invariant: bool, dtype):
    """A tiny decoder with nn's own initialization (logits close together, as random 8B
    weights give), a prompt decoded a token a step, then k + 1 = 5 more tokens two ways: one
    token a step, and as one verify step (the rows of one sequence at consecutive positions,
    as SpeculativeModel's prologue builds them). Returns both [5, vocab] logits."""
    from vt.torch import TorchInputs
    from vt.torch.llama import LlamaDecoder
    torch.manual_seed(7)
    m = LlamaDecoder(TINY_NEAR, GEO, dtype=dtype, device=device, batch_invariant=invariant)
    g, dev = GEO, torch.device(device)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)   # noqa: E731
    blocks = torch.arange(1, g.max_blocks + 1, dtype=torch.int32, device=dev)[None]
    slot = lambda p: int(blocks[0, p // g.block_size]) * g.block_size + p % g.block_size   # noqa: E731
    rng = np.random.default_rng(7)
    prompt, new = rng.integers(0, TINY_NEAR.vocab, 9).tolist(), rng.integers(0, TINY_NEAR.vocab, 5)
    table = torch.zeros(g.max_seqs + 1 + 5, dtype=torch.int32, device=dev)
    one = torch.empty(1, TINY_NEAR.vocab, dtype=torch.float32, device=dev)
    singles = []
    for p, tok in enumerate(prompt + new.tolist()):
        table[0] = tok
        m(TorchInputs.decode(table, i32([0]), i32([p]), i32([p + 1]), i32([slot(p)]), blocks,
                             i32([0])), one)
        if p >= len(prompt):
            singles.append(one.clone())
    L = len(prompt)
    table[g.max_seqs + 1:] = i32(new.tolist())
    verify = torch.empty(5, TINY_NEAR.vocab, dtype=torch.float32, device=dev)
    m(TorchInputs.decode(table, i32(list(range(g.max_seqs + 1, g.max_seqs + 6))),
                         i32([L + j for j in range(5)]), i32([L + j + 1 for j in range(5)]),
                         i32([slot(L + j) for j in range(5)]), blocks.expand(5, -1).contiguous(),
                         i32([0] * 5)), verify)
    return torch.cat(singles).cpu(), verify.cpu()


TINY_NEAR = dataclasses.replace(TINY, vocab=512, qk_norm=False)


def _same_bytes(a, b) -> bool:
    return a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))


def test_a_verify_steps_logits_are_the_one_token_steps_bytes_with_the_batch_invariant_decoder():
    """On the sim's CPU kernels: the batch-invariant decoder gives each verify position the
    logits bytes a one-token step gives it (so speculation's greedy tokens are its own, and
    the oracle's right drafts all accepted); the default decoder does not (its one-row and
    five-row projections sum in other orders), which is how the oracle's acceptance fell on
    the GPU with random weights."""
    singles, verify = _one_token_steps_and_a_verify_step("cpu", True, torch.float32)
    assert _same_bytes(singles, verify)
    singles, verify = _one_token_steps_and_a_verify_step("cpu", False, torch.float32)
    assert not _same_bytes(singles, verify), "the default decoder matched: the check proves nothing"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_verify_steps_logits_are_the_one_token_steps_bytes_on_the_gpu():
    """The GPU twin, in bf16: the batch-invariant decoder's Triton kernels give a verify
    position the one-token step's logits bytes."""
    singles, verify = _one_token_steps_and_a_verify_step("cuda", True, torch.bfloat16)
    assert _same_bytes(singles, verify)



def _invariant_llama(be):
    """tiny_llama's weights, batch-invariant: a verify position's logits bits are the one-token
    step's, so a sampled draw is too (on the GPU, where its kernels are fast)."""
    from vt.torch import torch_device
    from vt.torch.llama import LlamaDecoder
    torch.manual_seed(0)
    model = LlamaDecoder(TINY, GEO, dtype=torch.float32, device=torch_device(be), batch_invariant=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.5 / p.shape[1] ** 0.5 * 4)
    return model


def _sampled_run(be, module, mode, method):
    """Seeded sampled requests (every knob, and a greedy one) on `module`: its tokens through
    the Engine without speculation, and with it."""
    from vt.step.contract import SamplingParams
    ps = make_prompts(4, seed=11)
    budgets = [12, 9, 14, 10]
    sps = [SamplingParams(0.9, seed=5), SamplingParams(1.2, top_k=20, seed=6),
           SamplingParams(0.8, top_p=0.9, min_p=0.02, seed=7), SamplingParams()]
    with Engine(be, TorchForwardModel(be, module, geometry=GEO),
                ExecutorConfig(mode="drain", capture_sizes=(1, 2, 4))) as eng:
        want = [r.tokens for r in eng.generate(ps, max_new_tokens=budgets, sampling=sps)]
    table = zeros(be, (verify_table_rows(GEO.max_seqs, GEO.max_seqs, K),), np.int32)
    target = TorchForwardModel(be, module, geometry=GEO, token_table=table)
    refs = {tuple(p): w for p, w in zip(ps, want)}
    model = SpeculativeModel(be, target, SpeculativeConfig(method, k=K, references=refs))
    got, st = generate_speculative(be, model, ExecutorConfig(mode=mode, capture_sizes=(1, 2, 4)),
                                   ps, budgets, sampling=sps)
    return got, want, st


def test_llama_sampled_speculation_gives_its_own_sampled_tokens_on_the_sim(sim_backend):
    """The same seeds give the same tokens with speculation and without; the oracle proposing
    them has its drafts accepted. (The default kernels: on these well-spread logits a verify
    step's rounding flips no draw; the GPU twin runs the batch-invariant decoder.)"""
    got, want, st = _sampled_run(sim_backend, tiny_llama(sim_backend), "ring", "oracle")
    assert all(np.array_equal(a, b) for a, b in zip(got, want)), (got, want)
    assert st.acceptance_rate > 0.6


@pytest.mark.gpu
@pytest.mark.skipif("cuda" not in available_backends(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["drain", "ring", "staged"])
@pytest.mark.parametrize("method", ["oracle", "ngram"])
def test_llama_sampled_speculation_gives_its_own_sampled_tokens_on_the_gpu(mode, method):
    """The GPU twin, run twice (the same tokens run to run): vt's CUDA sampler over the verify
    rows of the batch-invariant decoder gives the tokens it samples without speculation."""
    from vt.backend import get_backend
    be = get_backend("cuda")
    try:
        module = _invariant_llama(be)
        got, want, st = _sampled_run(be, module, mode, method)
        again, _, _ = _sampled_run(be, module, mode, method)
    finally:
        be.close()
    assert all(np.array_equal(a, b) for a, b in zip(got, want)), (got, want)
    assert all(np.array_equal(a, b) for a, b in zip(again, got))
    if method == "oracle":
        assert st.acceptance_rate > 0.6
