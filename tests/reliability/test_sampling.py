"""Sampling seeds and parameter edges: a seed's draws are its own, the kernel derives each row's
key exactly as the numpy twin does, a tiny temperature takes its limit, and every out-of-range
knob is a one-line error naming the field.

| defect class | test |
|---|---|
| two seeds' streams are shifts of each other (key = hash(seed * c + position)) | test_no_seed_draws_another_seeds_stream_shifted |
| row keys collide across seeds and positions (held before; a guard) | test_row_keys_of_many_seeds_and_positions_are_distinct |
| the row key is not Philox4x32-10 as published | test_numpy_philox_gives_the_published_known_answers |
| the kernel's key derivation differs from the numpy twin's | test_kernel_row_key_built_on_the_host_equals_the_numpy_twins |
| a tiny temperature (1e-38..1e-45) fails the row as "NaN or +inf logits" | test_tiny_temperature_takes_the_argmax, test_engine_serves_a_tiny_temperature_as_greedy |
| a temperature past float32 (x / inf: NaN at masked tokens) is accepted | test_temperature_past_float32_is_refused |
| 10**400 raises OverflowError; a huge int prints all its digits (10**40 for top_p, min_p, seed held before) | test_huge_ints_are_one_line_value_errors_naming_the_field |
| top_k past int32 is accepted, then overflows the row vectors | test_huge_ints_are_one_line_value_errors_naming_the_field |
| numpy bools taken as numbers (held before; a guard) | test_numpy_bools_are_type_errors |
| numpy scalars give other vectors than plain numbers | test_numpy_scalars_give_the_same_row_vectors_as_python_numbers |
| GPU: the kernel's draws for these seeds and temperatures differ from the twin's | test_gpu_kernel_draws_equal_the_twin_for_shift_seeds_and_tiny_temperatures |
"""
import shutil
import subprocess

import numpy as np
import pytest

from vt.sampling import device_code, kernels, reference
from vt.sampling.params import GREEDY, SamplingParams, row_vectors
from vt.sampling.sampler import Sampler

from tests.sampling._cases import MODES, knobs, random_logits

_GAMMA = 0x9E3779B97F4A7C15
_GAMMA_INV = pow(_GAMMA, -1, 2**64)
SHIFT_SEED = (-_GAMMA_INV) % 2**64      # 1018231460777725123: seed * GAMMA = -1 (mod 2**64)
TINY = [1e-38, 3e-39, 1e-40, 1e-42, 1e-44, 1e-45]


def _plain_draws(seed: int, n: int, V: int = 1000) -> np.ndarray:
    """Seed `seed`'s tokens at positions 0..n-1 from one flat row (every token equally likely)."""
    x = np.zeros((n, V), np.float32)
    return reference.sample_tokens(x, np.arange(n, dtype=np.int32), np.ones(n, np.float32),
                                   np.zeros(n, np.int32), np.ones(n, np.float32), np.zeros(n, np.float32),
                                   np.full(n, seed, np.uint64))


def test_no_seed_draws_another_seeds_stream_shifted():
    """SHIFT_SEED and seed 0, and seeds s + k * GAMMA^-1 against s (shifted by k under a key of
    seed * GAMMA + position): at any shift up to 8 their tokens agree only by chance (1 in V)."""
    assert SHIFT_SEED == 1018231460777725123 and SHIFT_SEED < 2**63
    n = 300
    a, b = _plain_draws(0, n + 16), _plain_draws(SHIFT_SEED, n + 16)
    for k in range(-8, 9):
        agree = (b[8:8 + n] == a[8 + k:8 + k + n]).mean()
        assert agree < 0.05, f"shift {k}: {agree:.0%} of SHIFT_SEED's tokens are seed 0's"
    rng = np.random.default_rng(31)
    pos = np.arange(64, dtype=np.int64)
    for s in rng.integers(0, 2**62, 20, dtype=np.int64).tolist():
        for k in (-3, -1, 1, 2, 5):
            t = (s + k * _GAMMA_INV) % 2**64
            if t >= 2**63:
                continue
            same = reference.row_key(t, pos + 8) == reference.row_key(s, pos + 8 + k)
            assert not same.any(), f"seed {t} repeats seed {s}'s keys shifted by {k}"


def test_row_keys_of_many_seeds_and_positions_are_distinct():
    """3000 seeds (random, small and adjacent) x 64 positions: 192000 different 64-bit keys, so
    no seed's stream within these positions repeats another's at any shift."""
    rng = np.random.default_rng(7)
    seeds = np.concatenate([rng.integers(0, 2**63, 2000, dtype=np.uint64), np.arange(1000, dtype=np.uint64)])
    pos = np.arange(64, dtype=np.int32)
    keys = reference.row_key(np.repeat(seeds, pos.size), np.tile(pos, seeds.size))
    assert np.unique(keys).size == keys.size


def test_numpy_philox_gives_the_published_known_answers():
    """Random123's known-answer vectors for philox4x32-10 (counter, key -> output)."""
    kat = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
           ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in kat:
        assert tuple(int(w[0]) for w in reference.philox4x32_10(counter, key)) == want
    assert int(reference.row_key(0, 0)[0]) == 0xE169C58D << 32 | 0x6627E8D5


def test_kernel_row_key_built_on_the_host_equals_the_numpy_twins(tmp_path):
    """device_code.ROW_KEY (the text the kernel compiles, and the kernel's call of it) built with
    g++ gives reference.row_key's 64 bits for 20000 (seed, position) pairs, edges included."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ on this machine: the host build of the kernel's row_key needs it")
    assert device_code.ROW_KEY in kernels.CODE
    assert "const u64 base = row_key(seed[row], (u32)pos[row]);" in kernels.CODE
    src = tmp_path / "row_key.cpp"
    src.write_text("#include <cstdio>\ntypedef unsigned long long u64;\ntypedef unsigned int u32;\n"
                   "#define ROW_KEY_FN static inline\n" + device_code.ROW_KEY + r"""
int main() {
  u64 seed; u32 pos;
  while (std::scanf("%llu %u", &seed, &pos) == 2) std::printf("%llu\n", row_key(seed, pos));
  return 0;
}
""")
    exe = tmp_path / "row_key"
    subprocess.run([gxx, "-O2", "-std=c++17", "-o", str(exe), str(src)], check=True, capture_output=True)
    rng = np.random.default_rng(12)
    seeds = np.concatenate([[0, 1, SHIFT_SEED, 2**32 - 1, 2**32, 2**63 - 1] * 4,
                            rng.integers(0, 2**63, 19976, dtype=np.uint64)]).astype(np.uint64)
    pos = np.concatenate([[0, 1, 2**31 - 1, 4095] * 6, rng.integers(0, 2**31, 19976)]).astype(np.int32)
    lines = "".join(f"{int(s)} {int(p)}\n" for s, p in zip(seeds, pos))
    out = subprocess.run([str(exe)], input=lines, check=True, capture_output=True, text=True).stdout
    host = np.array([int(v) for v in out.split()], np.uint64)
    np.testing.assert_array_equal(host, reference.row_key(seeds, pos))


def _knob_rows(mode: str, t: float, S: int) -> dict:
    kn = knobs([mode] * S)
    kn["temperature"] = np.full(S, t, np.float32)
    return kn


@pytest.mark.parametrize("t", TINY)
@pytest.mark.parametrize("mode", [m for m in MODES if m != "greedy"])
def test_tiny_temperature_takes_the_argmax(mode, t):
    """Rows whose max is positive, negative, 0 (tied) and tied: each gets a token of its largest
    logit, never -1, the lowest id where max / t overflows float32 (50 / t does for every t
    here; 0 / t does not, so the race picks among those ties); a NaN row is still an error."""
    rng = np.random.default_rng(int(t * 1e45) + len(mode))
    x = random_logits(rng, 6, 3000)
    x[1] -= 100.0                   # every logit negative
    x[2] = -1.0
    x[2, [40, 41]] = 0.0            # the max is 0, tied
    x[3, [7, 900]] = 50.0           # a tie at a positive max
    x[4, ::3] = -np.inf
    x[5, 17] = np.nan
    kn = _knob_rows(mode, t, 6)
    out, table = np.full(6, -9, np.int32), np.full(6, -9, np.int32)
    Sampler().run_numpy(x, np.arange(6, dtype=np.int32), np.arange(6, dtype=np.int32) * 5, kn["temperature"],
                        kn["top_k"], kn["top_p"], kn["min_p"], kn["seed"], out, table)
    want = np.argmax(np.where(np.isnan(x), -np.inf, x), axis=1)
    assert out[[0, 1, 3, 4]].tolist() == want[[0, 1, 3, 4]].tolist() and out[5] == -1
    assert out[2] in (40, 41) and out[3] == 7
    assert table.tolist() == [*out[:5].tolist(), 0]


def test_a_temperature_that_rounds_to_zero_in_float32_is_greedy():
    assert SamplingParams(1e-46).greedy and not SamplingParams(1e-45).greedy
    x = random_logits(np.random.default_rng(3), 4, 500)
    kn = _knob_rows("temperature", 1e-46, 4)
    assert (reference.sample_tokens(x, np.arange(4), **kn) == x.argmax(1)).all()


def test_engine_serves_a_tiny_temperature_as_greedy(sim_backend):
    """The bundled model on the sim: requests at temperatures 1e-38..1e-45 end "length" with
    the greedy tokens (they failed as NaN or +inf logits)."""
    from vt.engine.engine import Engine
    from vt.forward.hybrid import HybridStepModel
    from vt.config import ExecutorConfig
    from vt.bundled import PRESETS, HybridModel

    from engine_runs import preset_weights

    cfg = PRESETS["tiny-dense"]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, cfg.vocab, size=int(rng.integers(2, 7))) for _ in TINY]
    model = HybridModel(sim_backend, cfg, preset_weights("tiny-dense"), max_seqs=8, num_kv_blocks=64)
    try:
        with Engine(sim_backend, HybridStepModel(sim_backend, model), ExecutorConfig(capture_sizes=(1, 2, 4, 8))) as eng:
            greedy = eng.generate(prompts, max_new_tokens=6, sampling=GREEDY)
            tiny = eng.generate(prompts, max_new_tokens=6,
                                sampling=[SamplingParams(t, top_k=20, seed=i) if i % 2 else
                                          SamplingParams(t, seed=i) for i, t in enumerate(TINY)])
    finally:
        model.close()
    for g, r in zip(greedy, tiny):
        assert r.finish_reason == "length", r.error
        assert r.tokens == g.tokens


@pytest.mark.parametrize("value", [1e39, 3.5e38, 1e300, np.float64(1e300), 10**39])
def test_temperature_past_float32_is_refused(value):
    with pytest.raises(ValueError, match=r"SamplingParams\.temperature=.* exceeds float32's largest value"):
        SamplingParams(value)
    SamplingParams(3.4e38)          # the largest float32 (rounded) is still a temperature


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "top_k", "seed"])
@pytest.mark.parametrize("value", [10**400, -(10**400), 10**40], ids=["1e400", "-1e400", "1e40"])
def test_huge_ints_are_one_line_value_errors_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=") as e:
        SamplingParams(**{field: value})
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 160, msg
    if abs(value) > 10**300:
        assert "<an int of 401 digits>" in msg


def test_a_longdouble_past_a_float_is_a_value_error():
    big = np.longdouble("1e400")
    if np.isinf(big):
        pytest.skip("this machine's long double is a double: no value past a float's range")
    with pytest.raises(ValueError, match=r"SamplingParams\.temperature=.* is beyond a float's range"):
        SamplingParams(big)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "top_k", "seed"])
@pytest.mark.parametrize("value", [np.True_, np.False_])
def test_numpy_bools_are_type_errors(field, value):
    with pytest.raises(TypeError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**{field: value})


def test_numpy_scalars_give_the_same_row_vectors_as_python_numbers():
    plain = SamplingParams(0.5, top_k=7, top_p=0.25, min_p=0.125, seed=2**63 - 1)
    for t, k, p, m, s in [(np.float32(0.5), np.int8(7), np.float16(0.25), np.float64(0.125), np.uint64(2**63 - 1)),
                          (np.float64(0.5), np.uint16(7), np.float32(0.25), np.float32(0.125), np.int64(2**63 - 1))]:
        sp = SamplingParams(t, top_k=k, top_p=p, min_p=m, seed=s)
        assert sp == plain and sp.greedy is False and hash(sp) == hash(plain)
        assert [type(getattr(sp, f)) for f in ("temperature", "top_k", "top_p", "min_p", "seed")] == \
            [float, int, float, float, int]
        for name, v in row_vectors([sp]).items():
            assert v.tobytes() == row_vectors([plain])[name].tobytes(), name
    assert SamplingParams(np.float32(0)).greedy and SamplingParams(1, top_k=np.int64(2**31 - 1)).top_k == 2**31 - 1


# ---- on a GPU: the kernel's draws equal the twin's for the same seeds and temperatures ----

@pytest.mark.gpu
def test_gpu_kernel_draws_equal_the_twin_for_shift_seeds_and_tiny_temperatures():
    """Byte for byte: every mode at V 32000 and 151936; seeds 0 and SHIFT_SEED (one position
    apart), adjacent and random seeds at random positions; the modes' temperatures and TINY."""
    cp = pytest.importorskip("cupy", reason="no CuPy: the CUDA sampler needs it")
    rng = np.random.default_rng(41)
    for V in (32000, 151936):
        for mode in MODES:
            S = 64
            x = random_logits(rng, S, V, ties=mode == "top_k")
            kn = knobs([mode] * S)
            kn["seed"] = np.array([0, SHIFT_SEED] * 8 + list(range(16)) + list(rng.integers(0, 2**63, 32)), np.uint64)
            if mode != "greedy":
                kn["temperature"][::4] = np.float32(TINY[int(rng.integers(len(TINY)))])
            pos = rng.integers(0, 2**31, S).astype(np.int32)
            pos[:16] = np.repeat(np.arange(8), 2) + np.tile([0, 1], 8)   # SHIFT_SEED one position on
            out, table = cp.full(S, -12345, cp.int32), cp.full(S, -777, cp.int32)
            Sampler().run_cupy(0, cp.asarray(x), cp.arange(S, dtype=cp.int32), cp.asarray(pos),
                               *(cp.asarray(kn[n]) for n in ("temperature", "top_k", "top_p", "min_p", "seed")),
                               out, table)
            want = reference.sample_tokens(x, pos, **kn)
            np.testing.assert_array_equal(out.get(), want, err_msg=f"V={V} {mode}")
            np.testing.assert_array_equal(table.get(), np.maximum(want, 0))
            assert (want >= 0).all(), f"V={V} {mode}: a tiny temperature gave an error row"
