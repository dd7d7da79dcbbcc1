"""The speculative step's CUDA source against its numpy twins, on the CPU (tests/speculative/
_cuda_on_cpu.py runs it), and both against the intended semantics of an oracle run: the
drafts are the reference's next tokens, the verify rows sit at the row's next positions with
those tokens as inputs, and a row emits what the target agrees with, then the target's own
token."""
import sys

import numpy as np
import pytest

from vt.forward import spec_kernels
from vt.forward.spec_kernels import (ACCEPT, DRAFT_COLLECT, DRAFT_PROLOGUE, NGRAM, ORACLE,
                                     PROLOGUE, SEED)
from vt.forward.speculative import read_record
from vt.sampling.logprobs import RECORD_WORDS
from vt.step.contract import kv_slot

from ._cuda_on_cpu import build, compiler, cuda_function_on_cpu

pytestmark = pytest.mark.skipif(compiler() is None, reason="needs g++ to build the CUDA source "
                                                           "for the CPU")

MAX_SEQS, PAD_ROW, BLOCK_SIZE, MAX_CONTEXT, NUM_BLOCKS = 6, 6, 4, 40, 64
MB = -(-MAX_CONTEXT // BLOCK_SIZE)
PAD_SLOT, PAD_STATE = 7, 5


@pytest.fixture(scope="module")
def cuda_lib(tmp_path_factory):
    return build(spec_kernels.CODE, tmp_path_factory.mktemp("spec_cuda"))


@pytest.fixture
def on_cpu(cuda_lib, monkeypatch):
    """run(kernel, *args, **kw): the kernel's run_cupy with the CUDA source run on the CPU."""
    from vt.backend import nvrtc
    monkeypatch.setattr(nvrtc, "cuda_function", cuda_function_on_cpu(cuda_lib, spec_kernels.CODE))
    monkeypatch.setitem(sys.modules, "cupy", np)
    return lambda kernel, *args, **kw: kernel.run_cupy(None, *args, **kw)


def run_numpy(kernel, *args, **kw):
    return kernel.run_numpy(*args, **kw)


def _rows(rng, S):
    """S step rows: distinct sequence rows, the last ones padding (the pad row, repeated)."""
    live = rng.permutation(MAX_SEQS)[:S].astype(np.int32)
    live[S - rng.integers(0, 2):] = PAD_ROW
    return live


def _both(on_cpu, kernel, arrays: dict, **kw):
    """Run `kernel` on two copies of `arrays` (its positional arguments, in order), by its
    numpy twin and by the CUDA source; every array must come out equal."""
    a = {n: v.copy() for n, v in arrays.items()}
    b = {n: v.copy() for n, v in arrays.items()}
    run_numpy(kernel, *a.values(), **kw)
    on_cpu(kernel, *b.values(), **kw)
    for n in arrays:
        np.testing.assert_array_equal(a[n], b[n], err_msg=f"{kernel.name}: {n} differs")
    return a


@pytest.mark.parametrize("seed", range(6))
def test_every_kernels_cuda_source_equals_its_numpy_twin(on_cpu, seed):
    """Random rows, positions up to past max_context (the clamps), padding rows, NaN logits,
    a small vocabulary (n-gram matches): prologue, oracle, n-gram, accept and seed write the
    same arrays on both paths."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 6))
    w, S, V = k + 1, int(rng.integers(1, MAX_SEQS + 1)), 5
    width = MAX_CONTEXT + k + 1
    rows = MAX_SEQS + 1
    token_rows = _rows(rng, S)
    pos = rng.integers(0, MAX_CONTEXT + k + 1, rows).astype(np.int32)
    table_len = rows + MAX_SEQS * w
    ints = lambda hi, *shape: rng.integers(0, hi, shape).astype(np.int32)   # noqa: E731
    poison = lambda *shape: np.full(shape, -7, np.int32)   # noqa: E731

    _both(on_cpu, PROLOGUE, dict(
        token_rows=token_rows, block_tables=ints(NUM_BLOCKS, S, MB), pos=pos,
        drafts=ints(V, S, k), token_table=ints(V, table_len), v_rows=poison(S * w),
        v_pos=poison(S * w), v_lens=poison(S * w), v_slots=poison(S * w),
        v_tables=poison(S * w, MB), v_state=poison(S * w), **_knobs(rng, S, S * w)),
        k=k, base=rows, pad_row=PAD_ROW, pad_slot=PAD_SLOT, pad_state=PAD_STATE,
        block_size=BLOCK_SIZE, max_context=MAX_CONTEXT)
    _both(on_cpu, ORACLE, dict(token_rows=token_rows, pos=pos, ref=ints(V, rows, width),
                               drafts=poison(S, k)),
          right=int(rng.integers(0, k + 1)), vocab=V)
    _both(on_cpu, NGRAM, dict(token_rows=token_rows, pos=pos, hist=ints(3, rows, width),
                              drafts=poison(S, k)),
          n_min=1, n_max=int(rng.integers(1, 4)))

    g = ints(V, MAX_SEQS * w)   # the sampler's tokens, drafts agreeing with a prefix
    logits = rng.standard_normal((MAX_SEQS * w, V)).astype(np.float32)
    g[rng.integers(0, S * w)] = -1                    # an error token mid-run
    drafts = np.maximum(g.reshape(MAX_SEQS, w)[:S, :k], 0)
    for r in range(S):
        drafts[r, rng.integers(0, k + 1):] += 1       # the first mismatch (none at k)
    drafts %= V
    accepted = _both(on_cpu, ACCEPT, dict(
        targets=g, v_logits=logits, drafts=drafts, token_rows=token_rows, pos=pos.copy(),
        hist=ints(V, rows, width), token_table=ints(V, table_len),
        records=poison(S, RECORD_WORDS), logits_out=np.full((S, V), -7.0, np.float32)),
        k=k, pad_row=PAD_ROW)
    assert (accepted["records"][:, 2] >= 1).all()

    n = int(rng.integers(1, MAX_SEQS + 1))
    _both(on_cpu, SEED, dict(token_rows=rng.permutation(MAX_SEQS)[:n].astype(np.int32),
                             positions=ints(MAX_CONTEXT + 3, n), token_table=ints(V, table_len),
                             pos=pos.copy(), hist=ints(V, rows, width)))


@pytest.mark.parametrize("seed", range(4))
def test_the_draft_kernels_cuda_source_equals_its_numpy_twin_and_the_pass_layout(on_cpu, seed):
    """The draft's prologue and collect on both paths, and the layout the draft's passes
    read: row v serves step row v % S at position pos + v // S - 1 (pass 0: p - 1 and p,
    its input tokens the row's history there; pass j: p + j), each with its own token-table
    entry and the row's block table, greedy knobs; past max_context, before 0 or a padded
    row: the pad slot. Collect puts pass j's token of row r at drafts[r, j], -1 made 0."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 6))
    S, V = int(rng.integers(1, MAX_SEQS + 1)), 9
    n, rows, width = S * (k + 1), MAX_SEQS + 1, MAX_CONTEXT + k + 1
    token_rows = _rows(rng, S)
    pos = rng.integers(1, MAX_CONTEXT + k + 1, rows).astype(np.int32)
    pos[rng.integers(0, rows)] = 0                     # a row at position 0: p - 1 is before it
    tables = rng.integers(0, NUM_BLOCKS, (S, MB)).astype(np.int32)
    hist = rng.integers(-1, V, (rows, width)).astype(np.int32)   # -1: an error token
    poison = lambda *shape: np.full(shape, -7, np.int32)   # noqa: E731
    f32 = lambda: np.full(n, 7.0, np.float32)   # noqa: E731
    out = _both(on_cpu, DRAFT_PROLOGUE, dict(
        token_rows=token_rows, block_tables=tables, pos=pos, hist=hist,
        d_table=poison(rows + MAX_SEQS * (k + 1)), d_rows=poison(n), d_pos=poison(n),
        d_lens=poison(n), d_slots=poison(n), d_tables=poison(n, MB), d_state=poison(n),
        d_temperature=f32(), d_top_k=poison(n), d_top_p=f32(), d_min_p=f32(),
        d_seed=np.full(n, 7, np.uint64)),
        k=k, base=rows, pad_row=PAD_ROW, pad_slot=PAD_SLOT, pad_state=PAD_STATE,
        block_size=BLOCK_SIZE, max_context=MAX_CONTEXT)
    for v in range(n):
        r, shift = v % S, v // S - 1
        row = int(token_rows[r])
        p = int(pos[row]) + shift
        live = row != PAD_ROW and 0 <= p < MAX_CONTEXT
        assert out["d_rows"][v] == rows + v and out["d_state"][v] == PAD_STATE
        assert (out["d_tables"][v] == tables[r]).all()
        if live:
            assert (out["d_pos"][v], out["d_lens"][v]) == (p, p + 1)
            assert out["d_slots"][v] == kv_slot(tables[r], p, BLOCK_SIZE)
        else:
            assert out["d_slots"][v] == PAD_SLOT
        if v < 2 * S:
            want = max(int(hist[row, min(p, width - 1)]), 0) if p >= 0 else 0
            assert out["d_table"][rows + v] == want
    assert (out["d_temperature"] == 0).all() and (out["d_seed"] == 0).all()
    assert (out["d_table"][rows + 2 * S:] == -7).all()   # later passes' inputs: the sampler's
    passes = rng.integers(-1, V, (k, MAX_SEQS)).astype(np.int32)
    got = _both(on_cpu, DRAFT_COLLECT, dict(passes=passes, drafts=poison(S, k)))["drafts"]
    np.testing.assert_array_equal(got, np.maximum(passes[:, :S].T, 0))


def _knobs(rng, S: int, n: int) -> dict:
    """A step's sampling knobs [S] (random) and the verify rows' [n] (poisoned), in the
    prologue's order."""
    step = dict(temperature=rng.random(S).astype(np.float32), top_k=rng.integers(0, 9, S).astype(np.int32),
                top_p=rng.random(S).astype(np.float32), min_p=rng.random(S).astype(np.float32),
                seed=rng.integers(0, 2**63, S, dtype=np.uint64))
    out = {}
    for name, v in step.items():
        out[name], out["v_" + name] = v, np.full(n, 7, v.dtype)
    return out


def _oracle_run(run, prompts, refs, *, k, right, vocab=50):
    """Decode every prompt with the oracle proposing its reference (the first `right` drafts
    of a step right) against a toy causal target whose greedy continuation of a row's true
    prefix is the reference (and of any other prefix, a hash of it). Checks each verify
    row's position, slot and input token against the row's tokens so far; returns each
    row's tokens after its prompt and the counts each step emitted."""
    S, w, n = len(prompts), k + 1, len(refs[0])
    rows, width, base = MAX_SEQS + 1, MAX_CONTEXT + k + 1, MAX_SEQS + 1
    seqs = [list(p) + list(r) for p, r in zip(prompts, refs)]
    token_rows = np.array([2 * i + 1 for i in range(S)], np.int32)   # rows 1, 3, ...
    tables = np.array([np.random.default_rng(i).permutation(NUM_BLOCKS)[:MB] for i in range(S)],
                      np.int32)
    pos, hist = np.zeros(rows, np.int32), np.zeros((rows, width), np.int32)
    ref = np.zeros((rows, width), np.int32)
    table = np.zeros(base + S * w, np.int32)
    for r, row in enumerate(token_rows):
        hist[row, :len(prompts[r])] = prompts[r]
        ref[row, :len(seqs[r])] = seqs[r]
        table[row] = seqs[r][len(prompts[r])]   # the prefill's first token
    run(SEED, token_rows, np.array([len(p) - 1 for p in prompts], np.int32), table, pos, hist)
    known = [list(p) + [s[len(p)]] for p, s in zip(prompts, seqs)]

    def target_next(prefix: list[int], seq: list[int]) -> int:
        if prefix == seq[:len(prefix)]:
            return seq[len(prefix)]
        return (sum((i + 3) * t for i, t in enumerate(prefix)) + 7) % vocab

    counts = []
    while min(len(kn) - len(p) for kn, p in zip(known, prompts)) < n - k:
        drafts = np.full((S, k), -7, np.int32)
        run(ORACLE, token_rows, pos, ref, drafts, right=right, vocab=vocab)
        v = {name: np.full(S * w, -7, np.int32) for name in ("rows", "pos", "lens", "slots", "state")}
        v_tables = np.full((S * w, MB), -7, np.int32)
        knobs = _knobs(np.random.default_rng(0), S, S * w)
        run(PROLOGUE, token_rows, tables, pos, drafts, table, v["rows"], v["pos"], v["lens"],
            v["slots"], v_tables, v["state"], *knobs.values(), k=k, base=base, pad_row=PAD_ROW,
            pad_slot=PAD_SLOT, pad_state=PAD_STATE, block_size=BLOCK_SIZE,
            max_context=MAX_CONTEXT)
        logits = np.zeros((S * w, vocab), np.float32)
        targets = np.full(S * w, -7, np.int32)
        for r in range(S):
            inputs = [int(table[v["rows"][r * w + j]]) for j in range(w)]
            assert inputs[0] == known[r][-1], "the verify's first input is the row's last token"
            for j in range(w):
                q = len(known[r]) - 1 + j
                i = r * w + j
                assert (v["pos"][i], v["lens"][i]) == (q, q + 1)
                assert v["slots"][i] == kv_slot(tables[r], q, BLOCK_SIZE)
                assert (v_tables[i] == tables[r]).all() and v["state"][i] == PAD_STATE
                assert knobs["v_seed"][i] == knobs["seed"][r]
                assert knobs["v_temperature"][i] == knobs["temperature"][r]
                targets[i] = target_next(known[r][:-1] + inputs[:j + 1], seqs[r])
                logits[i, targets[i]] = 1.0
        records = np.full((S, RECORD_WORDS), -7, np.int32)
        logits_out = np.zeros((S, vocab), np.float32)
        run(ACCEPT, targets, logits, drafts, token_rows, pos, hist, table, records, logits_out,
            k=k, pad_row=PAD_ROW)
        np.testing.assert_array_equal(logits_out, logits[::w])
        step = []
        for r, row in enumerate(token_rows):
            emitted = read_record(records[r]).tolist()
            known[r] += emitted
            step.append(len(emitted))
            assert pos[row] == len(known[r]) - 1 and table[row] == known[r][-1]
            assert hist[row, :len(known[r])].tolist() == known[r]
        counts.append(step)
    return [kn[len(p):] for kn, p in zip(known, prompts)], counts


@pytest.mark.parametrize("impl", ["numpy", "cuda source"])
@pytest.mark.parametrize("k,right", [(4, 4), (4, 2), (2, 0), (1, 1)])
def test_an_oracle_run_emits_the_reference_and_accepts_its_right_drafts(on_cpu, impl, k, right):
    """Two rows, prompts of 5 and 9 tokens, references of 21 tokens: every step emits the
    right drafts and the target's own next token (right + 1 tokens), all of them the
    reference's."""
    rng = np.random.default_rng(k * 10 + right)
    prompts = [rng.integers(0, 50, 5).tolist(), rng.integers(0, 50, 9).tolist()]
    refs = [rng.integers(0, 50, 21).tolist() for _ in prompts]
    run = run_numpy if impl == "numpy" else on_cpu
    got, counts = _oracle_run(run, prompts, refs, k=k, right=right)
    for g, want in zip(got, refs):
        assert g == want[:len(g)] and len(g) >= len(want) - k
    assert counts and all(c == [right + 1] * len(prompts) for c in counts)


def test_an_oracle_one_position_late_has_no_draft_accepted(monkeypatch):
    """The run's checks are not vacuous: an oracle that reads its reference one position too
    far proposes the token after the right one, so every step emits the target's own token
    alone (still the reference's)."""
    def late(self, token_rows, pos, ref, drafts, *, right, vocab):
        for r, row in enumerate(token_rows):
            for j in range(drafts.shape[1]):
                t = int(ref[row, min(int(pos[row]) + 2 + j, ref.shape[1] - 1)])
                drafts[r, j] = t if j < right else (t + 1) % vocab
    monkeypatch.setattr(spec_kernels.OracleDrafts, "run_numpy", late)
    rng = np.random.default_rng(1)
    prompts, refs = [rng.integers(0, 50, 5).tolist()], [rng.integers(0, 50, 21).tolist()]
    got, counts = _oracle_run(run_numpy, prompts, refs, k=4, right=4)
    assert got[0] == refs[0][:len(got[0])]
    assert all(c == [1] for c in counts)
