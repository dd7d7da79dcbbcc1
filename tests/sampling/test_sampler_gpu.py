"""The CUDA sampler on a GPU: tokens equal the numpy twin's at real vocabularies in every mode,
the distribution matches the sort-based reference, and a captured graph replays it."""
import numpy as np
import pytest

from vt.sampling import reference
from vt.sampling.sampler import Sampler

from ._cases import MODES, chi2, chi2_bound, knobs, random_logits

cp = pytest.importorskip("cupy", reason="no CuPy: the CUDA sampler needs it")
pytestmark = pytest.mark.gpu
try:
    _NO_GPU = None if cp.cuda.runtime.getDeviceCount() > 0 else "no CUDA GPU"
except Exception as exc:  # noqa: BLE001 (no driver)
    _NO_GPU = f"no CUDA GPU ({type(exc).__name__})"
if _NO_GPU:
    pytest.skip(_NO_GPU, allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def _return_cupys_cached_blocks():
    """These tests allocate through CuPy's default pool, which keeps freed blocks until the
    process exits; memcheck's leak check (tools/sanitize.sh) would report them as leaks."""
    yield
    cp.cuda.Device().synchronize()
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()


def _run(x, modes, positions=None, seed0=11, table_size=None, sampler=None):
    """Kernel tokens and token table for logits x [S, V] (outputs poisoned first); a fresh
    Sampler unless one is given."""
    S = x.shape[0]
    kn = knobs(modes, seed0)
    pos = np.arange(S, dtype=np.int32) * 7 + 3 if positions is None else positions
    rows = np.arange(S, dtype=np.int32)[::-1].copy()
    out = cp.full(S, -12345, cp.int32)
    table = cp.full(table_size or S + 1, -777, cp.int32)
    (sampler or Sampler()).run_cupy(0, cp.asarray(x), cp.asarray(rows), cp.asarray(pos),
                                    *(cp.asarray(kn[n]) for n in ("temperature", "top_k", "top_p",
                                                                  "min_p", "seed")), out, table)
    want = reference.sample_tokens(x, pos, **kn)
    return out.get(), table.get(), want, rows


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("V", [32000, 151936], ids=["V32000", "V151936"])
@pytest.mark.parametrize("S", [1, 8, 128], ids=["S001", "S008", "S128"])
def test_kernel_tokens_equal_numpy_twin(S, V, ties):
    """Every mode, alone (S 1 and 8) and mixed in one batch (S 128), on fresh logits."""
    rng = np.random.default_rng(S * 1000 + V + ties)
    names = list(MODES)
    batches = [[m] * S for m in names] if S < 128 else [list(rng.choice(names, S))]
    for modes in batches:
        x = random_logits(rng, S, V, ties)
        got, table, want, rows = _run(x, modes)
        np.testing.assert_array_equal(got, want, err_msg=f"modes {set(modes)}")
        np.testing.assert_array_equal(table[rows], np.maximum(want, 0))


def test_one_instance_gives_the_twins_tokens_call_after_call():
    """An instance keeps its counters between calls (the kernel leaves them zero): calls that
    take every path in turn (greedy, plain, the compact and the long top_k path, top_p, error
    rows, one and many blocks per row) on one instance each give the numpy twin's tokens."""
    from vt.sampling.sampler import COUNTER_ROWS
    rng = np.random.default_rng(17)
    sampler, names = Sampler(), list(MODES)
    for call in range(16):
        S, V = (1, 8, 33, 128)[call % 4], (32000, 151936)[call // 4 % 2]
        modes = [names[(call + j) % len(names)] for j in range(S)]
        x = random_logits(rng, S, V, ties=call % 3 == 0)
        if call % 5 == 2:
            x[0, 3] = np.nan                        # an error row ends early in its path
        got, table, want, rows = _run(x, modes, seed0=call, sampler=sampler)
        np.testing.assert_array_equal(got, want, err_msg=f"call {call}: S={S} V={V}")
        np.testing.assert_array_equal(table[rows], np.maximum(want, 0))
    dev = cp.cuda.Device().id
    assert not sampler._counters[dev][:].get().any()   # left zero, as the next call needs
    assert COUNTER_ROWS >= 128


def test_top_k_far_below_the_max_counts_every_first_digit():
    """The scan counts first digits only near each thread's max; a row whose k-th largest logit
    is far below its max (one outlier, k = 3000) must count them all again and still give the
    twin's token. A hot temperature keeps the outlier from winning every draw."""
    rng = np.random.default_rng(23)
    S, V = 6, 32000
    x = random_logits(rng, S, V)
    x[np.arange(S), rng.integers(0, V, S)] = 40.0
    kn = dict(temperature=np.full(S, 30.0, np.float32), top_k=np.array([3000, 3000, 50, 2000, 3000, 700], np.int32),
              top_p=np.array([1.0, 0.9, 1.0, 1.0, 0.5, 1.0], np.float32), min_p=np.zeros(S, np.float32),
              seed=np.arange(S, dtype=np.uint64) + 5)
    pos = np.arange(S, dtype=np.int32) + 9
    out, table = cp.full(S, -12345, cp.int32), cp.full(S + 1, -777, cp.int32)
    Sampler().run_cupy(0, cp.asarray(x), cp.arange(S, dtype=cp.int32), cp.asarray(pos),
                       *(cp.asarray(kn[n]) for n in ("temperature", "top_k", "top_p", "min_p", "seed")),
                       out, table)
    np.testing.assert_array_equal(out.get(), reference.sample_tokens(x, pos, **kn))


def test_error_rows_get_minus_one_and_table_zero():
    """NaN, +inf and all -inf rows: token -1, table 0; a -inf-masked row samples normally."""
    rng = np.random.default_rng(5)
    x = random_logits(rng, 6, 32000)
    x[0, 123] = np.nan
    x[1, 5] = np.inf
    x[2, :] = -np.inf
    x[3, 7] = np.nan
    x[4, ::2] = -np.inf
    got, table, want, rows = _run(x, ["greedy", "temperature", "top_p", "top_k", "combined", "min_p"])
    assert list(got[:4]) == [-1, -1, -1, -1] and (table[rows[:4]] == 0).all()
    assert got[4] >= 0 and got[4] % 2 == 1
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "greedy"])
def test_gpu_distribution_matches_sort_reference(mode):
    """>= 10^5 draws (one row per position, one launch): chi-square against float64 sorting."""
    rng = np.random.default_rng(3)
    V, N = 4000, 120_000
    row = (rng.standard_normal(V) * 2).astype(np.float32)
    t, k, p, m = MODES[mode]
    k = min(k, 400)
    x = cp.asarray(np.broadcast_to(row, (N, V)))
    vecs = [cp.full(N, t, cp.float32), cp.full(N, k, cp.int32), cp.full(N, p, cp.float32), cp.full(N, m, cp.float32),
            cp.full(N, 99, cp.uint64)]
    out = cp.full(N, -1, cp.int32)
    Sampler().run_cupy(0, x, cp.arange(N, dtype=cp.int32), cp.arange(N, dtype=cp.int32), *vecs, out,
                       cp.zeros(N, cp.int32))
    counts = np.bincount(out.get(), minlength=V)
    probs = reference.distribution(row, np.float32(t), k, float(np.float32(p)), float(np.float32(m)))
    assert counts[probs == 0].sum() == 0, "a token outside the kept set was drawn"
    stat, dof = chi2(counts, probs)
    assert stat < chi2_bound(dof), f"chi-square {stat:.1f} over {dof} dof"


def test_captured_graph_replays_the_same_tokens():
    """Launches captured on a CuPy stream replay to the eager tokens (no host sync inside),
    replay after replay (the instance's counters are left zero for the next one)."""
    rng = np.random.default_rng(9)
    x = random_logits(rng, 8, 32000)
    modes = list(MODES)[:7] + ["combined"]
    kn = {n: cp.asarray(v) for n, v in knobs(modes).items()}
    args = [cp.asarray(x), cp.arange(8, dtype=cp.int32), cp.arange(8, dtype=cp.int32) + 40]
    args += [kn[n] for n in ("temperature", "top_k", "top_p", "min_p", "seed")]
    out, table = cp.full(8, -5, cp.int32), cp.zeros(9, cp.int32)
    s = cp.cuda.Stream(non_blocking=True)
    sampler = Sampler()
    with s:
        sampler.run_cupy(s.ptr, *args, out, table)   # compiles, allocates its counters
        eager = out.get()
        s.begin_capture()
        sampler.run_cupy(s.ptr, *args, out, table)
        g = s.end_capture()
        for _ in range(3):
            out.fill(-5)
            g.launch(s)
            s.synchronize()
            np.testing.assert_array_equal(out.get(), eager)


@pytest.mark.parametrize("V", [32000, 151936], ids=["V32000", "V151936"])
def test_kernel_token_records_equal_numpy_twin(V):
    """Records (vt/sampling/logprobs.py) of a batch mixing every mode and logprobs counts from
    none to MAX_LOGPROBS: tokens and top ids equal, logprobs within 1e-5; unasked words untouched."""
    from vt.sampling.logprobs import RECORD_WORDS
    from vt.sampling.params import MAX_LOGPROBS

    rng = np.random.default_rng(V)
    S = 64
    modes = list(rng.choice(list(MODES), S))
    x = random_logits(rng, S, V, ties=True)
    kn = knobs(modes)
    counts = rng.integers(-1, MAX_LOGPROBS + 1, S).astype(np.int32)
    pos = np.arange(S, dtype=np.int32) * 3
    rows = np.arange(S, dtype=np.int32)
    got = cp.full((S, RECORD_WORDS), -999, cp.int32)
    Sampler().run_cupy(0, cp.asarray(x), cp.asarray(rows), cp.asarray(pos),
                       *(cp.asarray(kn[n]) for n in ("temperature", "top_k", "top_p", "min_p", "seed")),
                       got, cp.zeros(S + 1, cp.int32), cp.asarray(counts))
    want = np.full((S, RECORD_WORDS), -999, np.int32)
    Sampler().run_numpy(x, rows, pos, *(kn[n] for n in ("temperature", "top_k", "top_p", "min_p", "seed")),
                        want, np.zeros(S + 1, np.int32), counts)
    got = got.get()
    np.testing.assert_array_equal(got[:, 0], want[:, 0])
    for r in range(S):
        n = int(counts[r])
        if n < 0:
            assert (got[r, 2:] == -999).all() and got[r, 1] == want[r, 1]
            continue
        np.testing.assert_array_equal(got[r, 2:2 + n], want[r, 2:2 + n])
        f_got, f_want = got[r].view(np.float32), want[r].view(np.float32)
        np.testing.assert_allclose(f_got[1], f_want[1], atol=1e-5)
        np.testing.assert_allclose(f_got[2 + MAX_LOGPROBS:2 + MAX_LOGPROBS + n],
                                   f_want[2 + MAX_LOGPROBS:2 + MAX_LOGPROBS + n], atol=1e-5)


def test_penalty_kernels_equal_numpy_twin():
    """penalize and count_tokens (vt/sampling/penalties.py) on random state, every row's stages
    drawn from {none, PENALIZE, MIN_TOKENS, both}: the same float32 logits bit for bit (no FMA
    contraction; stop tokens -inf while min_left > 0), the same counts and min_left."""
    from vt.sampling import penalties
    from vt.sampling.params import MAX_MIN_TOKENS_STOPS
    rng = np.random.default_rng(5)
    S, V, R, MB, MS = 32, 151936, 40, 1024, MAX_MIN_TOKENS_STOPS
    x = random_logits(rng, S, V, ties=True)
    rows = rng.permutation(R)[:S].astype(np.int32)
    pen = rng.integers(0, 4, S).astype(np.int32)
    pres, freq = (rng.uniform(-2, 2, S).astype(np.float32) for _ in range(2))
    rep = rng.uniform(0.5, 2, S).astype(np.float32)
    counts = rng.integers(0, 3, (R, V)).astype(np.uint16)
    bits = rng.integers(0, 2**32, (R, -(-V // 32)), dtype=np.uint64).astype(np.uint32)
    ids = np.full((R, MB), -1, np.int32)
    vals = np.zeros((R, MB), np.float32)
    left = rng.integers(0, 3, R).astype(np.int32)
    stops = np.full((R, MS), -1, np.int32)
    for r in range(R):
        k = int(rng.integers(0, 50))
        ids[r, :k] = rng.choice(V, k, replace=False)
        vals[r, :k] = rng.uniform(-100, 100, k)
        k = int(rng.integers(0, MS + 1))
        stops[r, :k] = rng.choice(V, k, replace=False)
    assert (pen & 2).any() and (left[rows[(pen & 2) > 0]] > 0).any()
    want = x.copy()
    penalties.penalize(want, rows, pen, pres, freq, rep, counts, bits, ids, vals, left, stops)
    got = cp.asarray(x)
    dev = [cp.asarray(a) for a in (rows, pen, pres, freq, rep, counts, bits, ids, vals, left, stops)]
    penalties.launch_penalize(got, *dev)
    np.testing.assert_array_equal(got.get(), want)
    assert np.isneginf(want).sum() > np.isneginf(x).sum()    # some stop token was banned
    toks = rng.integers(-1, V, S).astype(np.int32)
    penalties.count(toks, rows, pen, counts, left)
    penalties.launch_count(cp.asarray(toks), dev[0], dev[1], dev[5], dev[9])
    np.testing.assert_array_equal(dev[5].get(), counts)
    np.testing.assert_array_equal(dev[9].get(), left)
