"""The whole model on a backend against the float64 numpy model: prefill, eager decode with
padded rows, greedy generation, and a captured decode step replayed bit-identical to eager."""
import numpy as np
import pytest

from vt.step.inputblock import InputBlock
from vt.bundled import PRESETS, HybridModel, SamplingParams, init_weights
from vt.step.contract import PadRow
from vt.bundled.reference import ReferenceModel

from ._driver import Driver
from ._util import DeviceIO, assert_close

TOL = 1e-2   # fp16 storage of activations, weights and KV; fp32 accumulation
PRESET_IDS = ["tiny-dense", "tiny-moe"]
_WEIGHTS = {}


def _setup(be, preset, max_seqs=6, seed=0):
    cfg = PRESETS[preset]
    if (preset, seed) not in _WEIGHTS:
        _WEIGHTS[preset, seed] = init_weights(cfg, seed)
    w = _WEIGHTS[preset, seed]
    m = HybridModel(be, cfg, w, max_seqs=max_seqs, num_kv_blocks=max_seqs * 8)
    return m, ReferenceModel(cfg, w), Driver(m, DeviceIO(be))


def _prompts(cfg, lens, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab, n).tolist() for n in lens]


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_prefill_and_decode_match_the_float64_model(backend, preset):
    """Prefill logits, then 3 decode steps padded 3 -> 4 rows, within 1e-2 of float64."""
    m, ref, drv = _setup(backend, preset)
    prompts = _prompts(m.cfg, [5, 12, 1])
    rows = [4, 0, 2]
    got, toks = drv.prefill(prompts, rows)
    states = []
    for b, p in enumerate(prompts):
        st, want = ref.prefill(p)
        states.append(st)
        assert_close(got[b], want, TOL, f"prefill seq {b}")
    np.testing.assert_array_equal(toks, got.argmax(-1))
    for step in range(3):
        lg, sampled = drv.decode(rows, 4)
        for b in range(3):
            want = ref.step(states[b], int(toks[b]))
            assert_close(lg[b], want, TOL, f"decode step {step} seq {b}")
        toks = sampled[:3]
        np.testing.assert_array_equal(toks, lg[:3].argmax(-1))


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_greedy_generation_of_32_tokens_equals_the_float64_model(backend, preset):
    """Tokens sampled on the device feed the next step through the token table; 32 greedy
    tokens from a fixed prompt equal the numpy model's token for token."""
    m, ref, drv = _setup(backend, preset)
    # Prompt seeds picked so that no step of the float64 run is a near-tie (margin > 0.02,
    # ~10x the observed fp16 logit error): there the tokens must agree exactly.
    prompt = _prompts(m.cfg, [7], seed={"tiny-dense": 12, "tiny-moe": 6}[preset])[0]
    want, margins = ref.generate_greedy(prompt, 32)
    # The comparison is meaningful only where the float64 top-2 gap exceeds fp16 noise.
    assert min(margins) > 0.02, f"reference near-tie (min margin {min(margins):.3g}): pick another prompt"
    got = [int(drv.prefill([prompt], [3])[1][0])]
    for _ in range(31):
        _, t = drv.decode([3], 2)
        got.append(int(t[0]))
    assert got == want


@pytest.mark.parametrize("preset", PRESET_IDS)
def test_padded_rows_touch_only_scratch_entries(backend, preset):
    """Padding 2 rows to 8 leaves another sequence's KV blocks, GDN states and token-table
    entry bit-identical, and the real rows' logits agree with the unpadded run (to 2e-3: a
    GEMM's summation order may depend on M, and fp16 rounding amplifies that)."""
    outs = []
    for S in (2, 8):
        m, _, drv = _setup(backend, preset)
        drv.prefill(_prompts(m.cfg, [4, 9, 6]), [1, 5, 3])
        io = drv.io
        snap = lambda: ([io.get(m.states[i])[drv.state[3]] for i in m.cfg.gdn_layers] +
                        [io.get(c[j])[drv.bt[3, :2]] for j in m.cfg.attn_layers for c in (m.k_cache, m.v_cache)] +
                        [io.get(m.token_table)[3]])
        before = snap()
        outs.append([drv.decode([1, 5], S)[0][:2] for _ in range(3)])
        for x, y in zip(before, snap()):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), "an inactive sequence changed"
    for a, b in zip(*outs):
        assert_close(b, a, 2e-3, "padded vs unpadded")


@pytest.mark.parametrize("preset", PRESET_IDS)
@pytest.mark.parametrize("S", [2, 4])
def test_captured_decode_replays_bit_identical_to_eager(backend, preset, S):
    """decode + sample captured once (0 pool mallocs during capture) and replayed with new
    metadata each step gives exactly the eager model's logits and tokens, step after step.
    tiny-moe (top-2 of 8 experts) at S=2 takes the routed expert path, at S=4 all experts."""
    be = backend
    (m_e, _, d_e), (m_g, _, d_g) = _setup(be, preset), _setup(be, preset)
    assert m_g.routed(S) == (preset == "tiny-moe" and S == 2)
    rows = [0, 2, 5][:min(3, S)]
    prompts = _prompts(m_e.cfg, [6, 3, 10])[:len(rows)]
    for drv in (d_e, d_g):
        drv.prefill(prompts, rows)
    s = d_g.io.s
    mb = m_g.cfg.max_blocks_per_seq
    host, dev = InputBlock(be.pinned_empty, S, mb), InputBlock(be.empty, S, mb)
    inp = dev.inputs
    m_g_pad = PadRow(m_g.scratch_row, m_g.scratch_state)
    logits = be.empty((S, m_g.cfg.vocab), np.float32, retained=True)
    toks = be.empty((S,), np.int32, retained=True)

    def step():
        host.copy_to(be, dev, s)         # the graph's H2D: re-reads the pinned block
        m_g.decode(s, inp, logits)
        m_g.sample(s, logits, inp, toks)

    def refresh():
        host.pad_from(0, m_g_pad)        # greedy sampling vectors; the rows below overwrite
        for k, v in d_g.decode_host(rows, S).items():
            getattr(host.inputs, k)[...] = v

    refresh()
    with be.pool.scratch_warmup("decode warm-up"):
        step()                       # eager warm-up: one real step (advances the sequences)
        s.synchronize()
    d_g.advance(rows)
    eager_l, eager_t = d_e.decode(rows, S)
    np.testing.assert_array_equal(d_g.io.get(logits), eager_l)
    with be.capture(s, name=f"decode S={S}") as cap:
        step()
    assert be.pool.stats().mallocs_during_capture == 0
    for _ in range(4):
        refresh()
        cap.graph.launch(s)
        s.synchronize()
        d_g.advance(rows)
        eager_l, eager_t = d_e.decode(rows, S)
        assert d_g.io.get(logits).tobytes() == eager_l.tobytes()
        np.testing.assert_array_equal(d_g.io.get(toks), eager_t)


def test_temperature_sampling_is_reproducible_and_in_the_top_k(backend):
    """Same seed -> same tokens; the tokens lie in each row's top-k."""
    runs = []
    for _ in range(2):
        m, _, drv = _setup(backend, "tiny-dense")
        drv.prefill(_prompts(m.cfg, [5, 5]), [0, 1])
        runs.append([drv.decode([0, 1], 2, SamplingParams(temperature=1.0, top_k=8, seed=3))
                     for _ in range(4)])
    for (l1, t1), (l2, t2) in zip(*runs):
        np.testing.assert_array_equal(t1, t2)
        for r in range(2):
            assert t1[r] in np.argsort(-l1[r])[:8]


def test_prefill_padding_is_spread_over_the_scratch_sequences():
    """The padding of a prefill bucket never makes a sequence longer than it must be: the GDN
    kernel's time follows the longest sequence, so the scratch ones share it evenly."""
    from vt.forward.hybrid import padded_lengths
    for chunks, seqs, total in [([40], 33, 128), ([60] * 32, 33, 2048), ([], 5, 8), ([3, 1], 3, 5)]:
        lens = padded_lengths(chunks, seqs, total)
        scratch = lens[len(chunks):]
        assert lens.sum() == total and len(lens) == seqs and list(lens[:len(chunks)]) == chunks
        assert scratch.min() >= 1 and scratch.max() - scratch.min() <= 1, lens
    assert padded_lengths([40], 33, 128)[1:].max() == 3        # not one scratch sequence of 57
    with pytest.raises(ValueError, match="do not fit"):
        padded_lengths([8, 8], 2, 16)                          # no room for a scratch sequence
