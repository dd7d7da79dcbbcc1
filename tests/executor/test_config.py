"""ExecutorConfig: one validated mode from which everything else is derived, every knob from
the environment, every bad value named in the error; the one integer check."""
import os

import numpy as np
import pytest

from vt import env
from vt.config import DEFAULT_CAPTURE_SIZES, MODES, RING_SLOTS, SAFE_MODES, ExecutorConfig
from vt.step.contract import KVGeometry
from vt.validate import integer
from mode_table import EXPECTED_MODES

EXPECTED = EXPECTED_MODES   # (depth, slots per size, guarded, staged H2D, drain skip)


def _behaviour(c: ExecutorConfig):
    return c.depth, c.slots_per_size, c.guarded, c.staged_h2d, c.skips_graph_drain


def test_every_mode_derives_what_it_runs():
    assert set(EXPECTED) == set(MODES) and RING_SLOTS == 2
    for mode, expected in EXPECTED.items():
        c = ExecutorConfig(mode=mode)
        assert _behaviour(c) == expected, mode
        assert c.safe == (mode in SAFE_MODES)
        # the one unsafe combination: skipping the drain with nothing guarding the slot
        assert c.safe == (c.guarded or not c.skips_graph_drain)


def test_defaults_are_the_drain_mode():
    c = ExecutorConfig.from_env({})
    assert (c.mode, c.trace, c.capture_sizes) == ("drain", None, DEFAULT_CAPTURE_SIZES)
    assert c.slots_per_size == 1 and not c.skips_graph_drain and not c.guarded


@pytest.mark.parametrize("ring,unguarded,mode", [
    (None, None, "drain"), ("0", None, "drain"), ("1", None, "ring"), (None, "1", "unguarded"),
    ("0", "1", "unguarded"), ("1", "0", "ring"), ("0", "0", "drain")])
def test_the_mode_variables_name_a_mode(ring, unguarded, mode):
    environ = {k: v for k, v in (("VT_ASYNC_EXECUTOR", ring),
                                 ("VT_ASYNC_EXECUTOR_NO_DBUF", unguarded)) if v is not None}
    assert ExecutorConfig.from_env(environ).mode == mode


def test_environment_sets_every_knob():
    environ = {"VT_ASYNC_EXECUTOR": "1", "VT_ASYNC_EXECUTOR_TRACE": "/tmp/t.json",
               "VT_ASYNC_SERVING_CONC": "32", "VT_CAPTURE_SIZES": "8,1,4", "VT_WAIT_POLL_US": "5"}
    c = ExecutorConfig.from_env(environ)
    assert c.mode == "ring" and c.trace == "/tmp/t.json" and c.wait_poll_us == 5.0
    assert c.serving_conc == 32 and c.capture_sizes == (1, 4, 8) and c.slots_per_size == 2


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


def test_a_mode_override_replaces_the_mode_variables():
    """The mode is the whole mode: neither variable leaks into a mode given explicitly."""
    environ = {"VT_ASYNC_EXECUTOR": "1", "VT_ASYNC_EXECUTOR_NO_DBUF": "1"}
    for mode in MODES:
        assert ExecutorConfig.from_env(environ, mode=mode).mode == mode
    assert ExecutorConfig.from_env({"VT_ASYNC_EXECUTOR": "1"}, mode="drain").mode == "drain"


@pytest.mark.parametrize("var,value", [
    ("VT_ASYNC_EXECUTOR", "yes"), ("VT_ASYNC_EXECUTOR", "2"), ("VT_ASYNC_EXECUTOR_NO_DBUF", "true"),
    ("VT_ASYNC_SERVING_CONC", "0"), ("VT_ASYNC_SERVING_CONC", "many"),
    ("VT_CAPTURE_SIZES", "1,x"), ("VT_ASYNC_EXECUTOR_TRACE", "yes")])
def test_invalid_environment_values_name_the_variable(var, value):
    with pytest.raises(ValueError, match=var):
        ExecutorConfig.from_env({var: value})


def test_a_config_error_from_the_environment_lists_the_variables():
    with pytest.raises(ValueError, match=r"makes no sense.*VT_ASYNC_EXECUTOR=1"):
        ExecutorConfig.from_env({"VT_ASYNC_EXECUTOR": "1", "VT_ASYNC_EXECUTOR_NO_DBUF": "1"})
    with pytest.raises(ValueError, match=r"in \[1, 1024\], got 2000 .*VT_ASYNC_SERVING_CONC=2000"):
        ExecutorConfig.from_env({"VT_ASYNC_SERVING_CONC": "2000"})


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="fast"), "mode must be one of sync, drain, ring, staged, unguarded, got 'fast'"),
    (dict(mode=None), "mode must be one of"),
    (dict(capture_sizes=(1, 2, 2)), "duplicates"),
    (dict(capture_sizes=(0, 4)), r"capture_sizes entry must be an integer in \[1, 1024\], got 0"),
    (dict(serving_conc=0), r"serving_conc must be an integer in \[1, 1024\], got 0"),
    (dict(trace=""), "trace must be a file path"),
])
def test_nonsense_configs_are_rejected_with_the_reason(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExecutorConfig(**kwargs)


def test_one_way_to_build_a_config():
    """The constructor with keyword fields, which reads no environment; from_env() is the one
    reader of the VT_* variables; replace() derives one from another. No other builder."""
    builders = {name for name, attr in vars(ExecutorConfig).items()
                if isinstance(attr, (classmethod, staticmethod))}
    assert builders == {"from_env"}
    assert ExecutorConfig(mode="ring", serving_conc=8) == ExecutorConfig.from_env({}, mode="ring")


def test_the_constructor_reads_no_environment(monkeypatch):
    monkeypatch.setenv("VT_ASYNC_EXECUTOR", "1")
    monkeypatch.setenv("VT_ASYNC_SERVING_CONC", "4")
    assert ExecutorConfig() == ExecutorConfig(mode="drain", serving_conc=8)
    assert ExecutorConfig.from_env() == ExecutorConfig(mode="ring", serving_conc=4)


def test_unknown_override_is_a_type_error():
    with pytest.raises(TypeError, match="no field"):
        ExecutorConfig.from_env({}, ring=2)


def test_replace_keeps_the_check():
    c = ExecutorConfig(mode="ring")
    assert c.replace(mode="staged").staged_h2d
    with pytest.raises(ValueError, match="mode must be one of"):
        c.replace(mode="nope")


# ------------------------------------------------------------------ the one integer check
@pytest.mark.parametrize("value", [8, np.int64(8), np.int32(8), np.uint16(8)])
def test_numpy_integers_are_integers_everywhere(value):
    assert integer("x", value, 1) == 8 and type(integer("x", value, 1)) is int
    g = KVGeometry(max_seqs=value, num_kv_blocks=value, block_size=value, max_context=value)
    assert g.max_seqs == 8 and type(g.max_seqs) is int
    c = ExecutorConfig(serving_conc=value, capture_sizes=(value, 1))
    assert c.serving_conc == 8 and c.capture_sizes == (1, 8)
    assert all(type(s) is int for s in c.capture_sizes)


@pytest.mark.parametrize("value,error", [
    (True, TypeError), (8.0, TypeError), ("8", TypeError), (None, TypeError),
    (np.float64(8), TypeError), (0, ValueError), (np.int64(0), ValueError), (2**40, ValueError)])
def test_one_refusal_shape_everywhere(value, error):
    """The same message, and the same error type, from every constructor that takes sizes."""
    shape = rf"must be an integer in \[1, \d+\], got {value!r}".replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(error, match="x " + shape):
        integer("x", value, 1, 2**31 - 1)
    with pytest.raises(error, match=r"KVGeometry.max_seqs " + shape):
        KVGeometry(max_seqs=value, num_kv_blocks=4, block_size=4, max_context=8)
    with pytest.raises(error, match=r"ExecutorConfig.serving_conc " + shape):
        ExecutorConfig(serving_conc=value)


# ------------------------------------------------------------------ the test arms' variable
def test_the_poison_variable_selects_the_poison_hooks():
    from vt.hooks import NULL_HOOKS, Poison, hooks_from_env
    assert hooks_from_env({}) is NULL_HOOKS
    assert hooks_from_env({"VT_ASYNC_EXECUTOR_POISON": "0"}) is NULL_HOOKS
    assert isinstance(hooks_from_env({"VT_ASYNC_EXECUTOR_POISON": "1"}), Poison)
    with pytest.raises(ValueError, match="VT_ASYNC_EXECUTOR_POISON must be 0 or 1"):
        hooks_from_env({"VT_ASYNC_EXECUTOR_POISON": "yes"})


@pytest.mark.parametrize("environ,mode", [
    ({}, "drain"), ({"VT_ASYNC_EXECUTOR": "1", "VT_ASYNC_EXECUTOR_POISON": "1"}, "ring+poison"),
    ({"VT_ASYNC_EXECUTOR_NO_DBUF": "1", "VT_ASYNC_EXECUTOR_POISON": "1"}, "unguarded+poison")])
def test_an_engine_without_a_config_takes_mode_and_hooks_from_the_environment(
        sim_backend, monkeypatch, environ, mode):
    """Engine(config=None): the mode variables and POISON; an explicit config takes neither."""
    from vt.engine.engine import Engine
    from vt.forward.toy import ToyForward
    for var in [v for v in os.environ if v.startswith("VT_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("VT_CAPTURE_SIZES", "1,2")
    for var, value in environ.items():
        monkeypatch.setenv(var, value)
    with Engine(sim_backend, ToyForward(sim_backend).step_model()) as eng:
        assert eng.mode == mode and eng.stats()["mode"] == mode
    with Engine(sim_backend, ToyForward(sim_backend).step_model(),
                ExecutorConfig(capture_sizes=(1, 2))) as eng:
        assert eng.mode == "drain"
