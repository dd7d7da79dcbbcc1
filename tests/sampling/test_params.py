"""SamplingParams: every bad type raises TypeError and every bad value ValueError, naming the
field; the per-row vectors carry the knobs in the sampler's dtypes."""
import numpy as np
import pytest

from vt.sampling.params import GREEDY, ROW_VECTORS, SamplingParams, row_vectors

BAD_TYPES = [("temperature", "1.0"), ("temperature", True), ("temperature", None), ("top_k", 1.5),
             ("top_k", True), ("top_k", "5"), ("top_p", "0.9"), ("top_p", False), ("min_p", [0.1]),
             ("seed", 1.0), ("seed", True)]
BAD_VALUES = [("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
              ("top_k", -1), ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", float("nan")),
              ("min_p", -0.01), ("min_p", 1.0), ("min_p", float("inf")), ("seed", -1), ("seed", 2**63)]


@pytest.mark.parametrize("field,value", BAD_TYPES)
def test_wrong_type_raises_type_error_naming_the_field(field, value):
    with pytest.raises(TypeError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value", BAD_VALUES)
def test_bad_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_good_values_are_kept_as_plain_python_numbers():
    """Each accepted value reads back equal, as a Python float or int (numpy scalars
    converted), with top_k=None and top_k=0 both meaning no cut."""
    cases = [((1.0,), dict(top_k=None, top_p=1.0, min_p=0.0, seed=0), (1.0, 0, 1.0, 0.0, 0)),
             ((0.5,), dict(top_k=0, top_p=0.5, min_p=0.5, seed=2**63 - 1),
              (0.5, 0, 0.5, 0.5, 2**63 - 1)),
             ((2,), dict(top_k=151936, top_p=1, min_p=0, seed=np.int64(3)), (2.0, 151936, 1.0, 0.0, 3)),
             ((np.float32(1e-3),), dict(top_k=np.int32(1), top_p=1e-6, min_p=0.999),
              (float(np.float32(1e-3)), 1, 1e-6, 0.999, 0))]
    for args, kw, want in cases:
        p = SamplingParams(*args, **kw)
        got = (p.temperature, p.top_k or 0, p.top_p, p.min_p, p.seed)
        assert got == want
        assert all(type(v) in (int, float) for v in got), got
    assert GREEDY.temperature == 0


def test_top_k_is_checked_against_the_vocabulary():
    SamplingParams(1.0, top_k=32000).check_vocab(32000)
    SamplingParams(1.0).check_vocab(10)
    with pytest.raises(ValueError, match=r"SamplingParams\.top_k=32001 exceeds the vocabulary size 32000"):
        SamplingParams(1.0, top_k=32001).check_vocab(32000)


def test_row_vectors_hold_each_request_in_the_sampler_dtypes():
    ps = [GREEDY, SamplingParams(0.7, top_k=50, top_p=0.9, min_p=0.05, seed=123),
          SamplingParams(1.0, top_k=None, seed=2**63 - 1)]
    v = row_vectors(ps)
    assert list(v) == list(ROW_VECTORS)
    for name, dtype in ROW_VECTORS.items():
        assert v[name].dtype == dtype and v[name].shape == (3,)
    assert v["top_k"].tolist() == [0, 50, 0]
    assert v["seed"].tolist() == [0, 123, 2**63 - 1]
    np.testing.assert_array_equal(v["temperature"], np.float32([0, 0.7, 1.0]))
    np.testing.assert_array_equal(v["top_p"], np.float32([1, 0.9, 1]))
    np.testing.assert_array_equal(v["min_p"], np.float32([0, 0.05, 0]))


def test_knobs_after_temperature_are_keyword_only():
    """SamplingParams(0.8, 8, seed) of the older (temperature, top_k, seed) order is refused
    instead of landing the seed in top_p."""
    with pytest.raises(TypeError):
        SamplingParams(0.8, 8, 3)


@pytest.mark.parametrize("V", [300, 32000, 151936])
def test_the_workspace_bound_covers_every_row_count_with_few_sizes(V):
    """workspace_for(S) >= what the kernel lays out for S rows (and the counters too, past
    COUNTER_ROWS rows), and takes one size per power of two of S, so a pool warmed with
    workspace_sizes() (which adds an instance's counter buffer) serves every later call."""
    from vt.sampling.device_code import counter_bytes, workspace_bytes
    from vt.sampling.sampler import COUNTER_ROWS, split, workspace_for, workspace_sizes
    for sms in (1, 78, 132):
        for S in [*range(1, 300), COUNTER_ROWS + 1, 3 * COUNTER_ROWS]:
            own = counter_bytes(S) + 8 if S > COUNTER_ROWS else 0
            assert workspace_bytes(S, split(S, V, sms)[0]) + own <= workspace_for(S, V, sms)
        assert ({workspace_for(S, V, sms) for S in range(1, 65)} | {counter_bytes(COUNTER_ROWS)}
                == set(workspace_sizes(64, V, sms)))
        assert len(workspace_sizes(64, V, sms)) == 8
