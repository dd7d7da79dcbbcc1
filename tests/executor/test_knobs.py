"""ExecutorConfig: every knob from the environment, every bad value named in the error."""
import pytest

from vt.knobs import DEFAULT_CAPTURE_SIZES, ExecutorConfig


def test_defaults_are_the_off_path():
    c = ExecutorConfig.from_env({})
    assert (c.async_executor, c.no_dbuf, c.poison, c.trace) == (False, False, False, None)
    assert c.ring_depth == 2 and c.capture_sizes == DEFAULT_CAPTURE_SIZES and c.h2d == "graph"
    assert c.slots_per_size == 1 and not c.skips_graph_drain


def test_environment_sets_every_knob():
    env = {"VT_ASYNC_EXECUTOR": "1", "VT_ASYNC_EXECUTOR_POISON": "1",
           "VT_ASYNC_EXECUTOR_TRACE": "/tmp/t.json", "VT_ASYNC_SERVING_CONC": "32",
           "VT_ASYNC_EXECUTOR_RING": "3", "VT_ASYNC_EXECUTOR_H2D": "staged",
           "VT_CAPTURE_SIZES": "8,1,4"}
    c = ExecutorConfig.from_env(env)
    assert c.async_executor and c.poison and c.trace == "/tmp/t.json"
    assert c.serving_conc == 32 and c.ring_depth == 3 and c.h2d == "staged"
    assert c.capture_sizes == (1, 4, 8) and c.slots_per_size == 3


def test_trace_one_means_the_default_path_and_zero_means_off():
    assert ExecutorConfig.from_env({"VT_ASYNC_EXECUTOR_TRACE": "1"}).trace == "vt_trace.json"
    assert ExecutorConfig.from_env({"VT_ASYNC_EXECUTOR_TRACE": "0"}).trace is None


@pytest.mark.parametrize("value", ["yes", "true", "on", "trace", "out.txt", "2"])
def test_trace_is_0_1_or_a_json_path(value):
    """Anything else, a boolean spelled another way above all, is refused instead of becoming
    a trace file of that name."""
    with pytest.raises(ValueError, match=r"VT_ASYNC_EXECUTOR_TRACE must be 0, 1 .* ending in "
                                         rf"\.json, got '{value}'"):
        ExecutorConfig.from_env({"VT_ASYNC_EXECUTOR_TRACE": value})


@pytest.mark.parametrize("value", ["t.json", "/tmp/run 1/T.JSON"])
def test_trace_json_paths_are_taken_as_given(value):
    assert ExecutorConfig.from_env({"VT_ASYNC_EXECUTOR_TRACE": value}).trace == value


def test_overrides_win_over_the_environment():
    c = ExecutorConfig.from_env({"VT_ASYNC_EXECUTOR": "1"}, async_executor=False, no_dbuf=True)
    assert c.no_dbuf and not c.async_executor


@pytest.mark.parametrize("var,value", [
    ("VT_ASYNC_EXECUTOR", "yes"), ("VT_ASYNC_EXECUTOR", "2"), ("VT_ASYNC_EXECUTOR_NO_DBUF", "true"),
    ("VT_ASYNC_EXECUTOR_POISON", "-1"), ("VT_ASYNC_SERVING_CONC", "0"),
    ("VT_ASYNC_SERVING_CONC", "many"), ("VT_ASYNC_EXECUTOR_H2D", "pinned"),
    ("VT_CAPTURE_SIZES", "1,x"), ("VT_ASYNC_EXECUTOR_RING", "1.5"),
    ("VT_ASYNC_EXECUTOR_TRACE", "yes")])
def test_invalid_environment_values_name_the_variable(var, value):
    with pytest.raises(ValueError, match=var):
        ExecutorConfig.from_env({var: value})


def test_a_config_error_from_the_environment_lists_the_variables():
    with pytest.raises(ValueError, match=r"makes no sense.*VT_ASYNC_EXECUTOR=1"):
        ExecutorConfig.from_env({"VT_ASYNC_EXECUTOR": "1", "VT_ASYNC_EXECUTOR_NO_DBUF": "1"})


@pytest.mark.parametrize("kwargs,match", [
    (dict(async_executor=True, no_dbuf=True), "no_dbuf=True with async_executor=True"),
    (dict(no_dbuf=True, depth=1), "no drain to skip"),
    (dict(ring_depth=1), "ring_depth must be >= 2"),
    (dict(depth=3), "depth must be 1"),
    (dict(h2d="fast"), "h2d must be one of"),
    (dict(capture_sizes=(1, 2, 2)), "duplicates"),
    (dict(capture_sizes=(0, 4)), "positive int"),
    (dict(serving_conc=0), "serving_conc must be a positive int"),
    (dict(async_executor=1), "async_executor must be a bool"),
    (dict(trace=""), "trace must be a file path"),
])
def test_nonsense_configs_are_rejected_with_the_reason(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExecutorConfig(**kwargs)


def test_unknown_override_is_a_type_error():
    with pytest.raises(TypeError, match="no field"):
        ExecutorConfig.from_env({}, ring=2)
