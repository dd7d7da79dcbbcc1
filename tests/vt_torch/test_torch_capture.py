"""What vt.torch adds around a captured torch forward on cuda: the private memory pool (without
it, a replay writes into tensors allocated after the capture: shown on a plain ExternalStream
forward), the refusal of an uncapturable call, the user's exception as it is, the pool freed at
close, and flat memory over many generate() calls."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install \".[torch]\")")

from vt.backend import get_backend  # noqa: E402
from vt.engine import Engine  # noqa: E402
from vt.config import ExecutorConfig  # noqa: E402
from vt.step import FORWARD_FIELDS  # noqa: E402
from vt.forward.user import ForwardModel  # noqa: E402
from vt.torch import TorchCaptureError, TorchForwardModel, TorchInputs  # noqa: E402
from vt.torch.views import as_tensor  # noqa: E402

from _torch_util import GEO, generate, prompts, step_model, tiny_llama  # noqa: E402

pytestmark = pytest.mark.torch_allocator

VOCAB, WIDTH, ROWS = 64, 4096, 8   # intermediates [ROWS, WIDTH] f32: 128 KiB each
SENTINEL = 7.0


@pytest.fixture
def cuda():
    be = get_backend("cuda")   # the gpu marker skips the test where there is no GPU
    yield be
    torch.cuda.synchronize()
    be.close()


def _weights():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(VOCAB, WIDTH, generator=g).cuda()
    w = torch.randn(WIDTH, VOCAB, generator=g).cuda() / WIDTH ** 0.5
    return emb, w


def _torch_forward(emb, w):
    """Two intermediates of [S, WIDTH] per step, freed when the forward returns."""
    def forward(inputs, logits_out):
        h = emb[inputs.input_ids.long()]
        h = torch.tanh(h) * 2
        logits_out.copy_(h @ w)
    return forward


def _plain_forward(table, emb, w):
    """The unsafe path a new user would write: a plain ForwardModel whose forward runs torch on
    vt's stream through ExternalStream, over torch.as_tensor views. Nothing routes torch's
    allocations during vt's capture."""
    fwd = _torch_forward(emb, w)

    def forward(stream, inputs, logits_out):
        dev = torch.device("cuda")
        with torch.cuda.stream(torch.cuda.ExternalStream(stream.handle)):
            t = TorchInputs.decode(as_tensor(table, dev),   # its input_ids: a gather on vt's stream
                                   *(as_tensor(getattr(inputs, f), dev) for f in FORWARD_FIELDS))
            fwd(t, as_tensor(logits_out, dev))
    return forward


def _corrupted_after_replays(be, model) -> int:
    """Build a ring engine (captures), then allocate tensors of the intermediates' size on vt's
    stream, as anything else run on it would (an eager step, the user's own code), fill them,
    replay many decode steps, and count the tensors no longer holding what was written."""
    cfg = ExecutorConfig(mode="ring", serving_conc=ROWS, capture_sizes=(ROWS,))
    with Engine(be, model, cfg) as eng:
        external = torch.cuda.ExternalStream(eng.runner.stream.handle)
        with torch.cuda.stream(external):
            mine = [torch.full((ROWS, WIDTH), SENTINEL, device="cuda") for _ in range(16)]
        torch.cuda.synchronize()
        res = eng.generate(prompts(ROWS, seed=0, vocab=VOCAB, max_len=2), max_new_tokens=24)
        assert eng.stats()["graph_steps"] >= 20
        torch.cuda.synchronize()
        assert all(len(r.tokens) == 24 for r in res)
        return sum(int((t != SENTINEL).any()) for t in mine)


@pytest.mark.gpu
def test_tensors_allocated_after_capture_stay_untouched_by_replays(cuda):
    """vt.torch: the graphs' intermediates live in the private pool; 0 tensors corrupted."""
    emb, w = _weights()
    model = TorchForwardModel(cuda, _torch_forward(emb, w), vocab=VOCAB, geometry=GEO)
    assert _corrupted_after_replays(cuda, model) == 0


@pytest.mark.gpu
def test_plain_external_stream_forward_corrupts_tensors_allocated_after_capture(cuda):
    """The unsafe path this package exists for, run and expected to corrupt: without the pool
    the graphs' intermediates are blocks of torch's cache, handed out again after the capture,
    and the replays write into those tensors. If this ever stops corrupting, the safe test
    above no longer proves anything."""
    emb, w = _weights()
    table = cuda.empty((GEO.max_seqs + 1,), np.int32)
    table[...] = 0
    model = ForwardModel(cuda, _plain_forward(table, emb, w), vocab=VOCAB,
                         token_table=table, geometry=GEO)
    assert _corrupted_after_replays(cuda, model) > 0


def _refusal(cuda, forward):
    model = TorchForwardModel(cuda, forward, vocab=VOCAB, geometry=GEO)
    cfg = ExecutorConfig(mode="ring", serving_conc=2, capture_sizes=(2,))
    with pytest.raises(Exception) as info:
        Engine(cuda, model, cfg)
    chain, exc = [], info.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__
    refusals = [e for e in chain if isinstance(e, TorchCaptureError)]
    assert refusals, f"no TorchCaptureError in {[type(e).__name__ for e in chain]}: {info.value}"
    return str(refusals[0]), str(info.value)


@pytest.mark.gpu
@pytest.mark.api_errors
@pytest.mark.parametrize("op,body", [
    ("torch.Tensor.item", lambda i, out: out.fill_(i.seq_lens.max().item())),
    ("torch.tensor", lambda i, out: out.copy_(torch.tensor([1.0], device="cuda").expand_as(out))),
])
def test_an_uncapturable_call_is_refused_naming_it_and_vt_stays_usable(cuda, op, body):
    """.item() (a host sync) and a tensor made from host data: refused, the message names the
    call; a new engine on the same backend then captures and serves."""
    msg, outer = _refusal(cuda, body)
    assert op in msg and op in outer
    module = tiny_llama(cuda)
    assert len(generate(cuda, step_model(cuda, module), "ring", prompts(3, seed=1), 4)[0]) == 4


@pytest.mark.gpu
def test_an_exception_in_the_forward_during_capture_surfaces_as_it_is(cuda):
    """A forward raising while vt captures: the same exception reaches the caller; vt works on."""
    def forward(inputs, out):
        if torch.cuda.is_current_stream_capturing():
            raise KeyError("raised by the user's forward")
        out.zero_()
    model = TorchForwardModel(cuda, forward, vocab=VOCAB, geometry=GEO)
    with pytest.raises(KeyError, match="raised by the user"):
        Engine(cuda, model, ExecutorConfig(mode="ring", serving_conc=2, capture_sizes=(2,)))
    assert model.torch_memory_pools() == 0   # the failed engine's close dropped its pool
    module = tiny_llama(cuda)
    assert len(generate(cuda, step_model(cuda, module), "drain", prompts(2, seed=1), 3)[1]) == 3


@pytest.mark.gpu
def test_the_private_pool_lives_as_long_as_the_engine(cuda):
    """One pool per engine while it is open; close() frees it and its memory."""
    model = step_model(cuda, tiny_llama(cuda))
    eng = Engine(cuda, model, ExecutorConfig(mode="ring", serving_conc=4, capture_sizes=(1, 2, 4)))
    eng.generate(prompts(4, seed=2), max_new_tokens=4)
    assert model.torch_memory_pools() == 1
    reserved_open = torch.cuda.memory_reserved()
    eng.close()
    assert model.torch_memory_pools() == 0
    assert torch.cuda.memory_reserved() < reserved_open


def test_pool_and_torch_memory_stay_flat_over_many_generate_calls(backend):
    """generate() with new batch sizes, prompt lengths and budgets every call: after the first
    few, neither vt's pool nor (cuda) torch's allocator grows, and vt makes no driver malloc.
    1000 calls on cuda; 40 on the sim (vt's pool only: its torch tensors are CPU memory)."""
    cuda = backend.name == "cuda"
    if backend.pool.debug:
        pytest.skip("pool debug mode (VT_POOL_DEBUG=1, as tools/sanitize.sh runs) gives every "
                    "buffer its own exact-size malloc by design; flatness is the normal suite's")
    calls = 1000 if cuda else 40
    rng = np.random.default_rng(5)
    model = step_model(backend, tiny_llama(backend))
    cfg = ExecutorConfig(mode="ring", serving_conc=8, capture_sizes=(1, 2, 4, 8))

    def call(eng):
        n = int(rng.integers(1, 9))
        ps = [rng.integers(0, 96, size=int(rng.integers(1, 12))).tolist() for _ in range(n)]
        eng.generate(ps, max_new_tokens=[int(b) for b in rng.integers(1, 10, size=n)])

    def memory():
        if not cuda:
            return backend.pool.stats().bytes_reserved
        torch.cuda.synchronize()
        return (backend.pool.stats().bytes_reserved, torch.cuda.memory_reserved(),
                torch.cuda.memory_allocated())

    with Engine(backend, model, cfg) as eng:
        for _ in range(20):
            call(eng)
        before, mallocs = memory(), eng.stats()["driver_mallocs_since_warm_up"]
        for _ in range(calls):
            call(eng)
        assert memory() == before
        assert eng.stats()["driver_mallocs_since_warm_up"] == mallocs


def test_the_refusal_names_the_call_the_way_a_user_wrote_it():
    """The name a refusal gives (CPU: the tracking alone, the GPU tests above refuse for real)."""
    from vt.torch.capture import LastCall
    calls = {"torch.Tensor.item": lambda: torch.ones(1).item(),
             "torch.tensor": lambda: torch.tensor([1.0]),
             "torch.Tensor.tolist": lambda: torch.ones(2).tolist()}
    for name, call in calls.items():
        tracker = LastCall()
        with tracker:
            call()
        assert tracker.name == name
