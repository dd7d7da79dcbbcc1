"""Shared fixtures: the same test functions run on every available backend; and a suite-wide
check that no pool, on any backend, ever called the driver's malloc while a graph was captured."""

import gc

import pytest

from vt import env
from vt.backend import available_backends, get_backend
from vt.backend.pool import DevicePool

_pool_totals = {"pools": 0, "captures": 0, "capture_mallocs": 0}


def _backend_params():
    params = [pytest.param("sim", id="sim")]
    reason = None if "cuda" in available_backends() else "no CUDA GPU on this machine"
    params.append(pytest.param("cuda", id="cuda",
                               marks=[pytest.mark.gpu] + ([pytest.mark.skip(reason=reason)] if reason else [])))
    return params


@pytest.fixture(params=_backend_params())
def backend(request):
    """A fresh backend of each available kind; closed after the test."""
    be = get_backend(request.param)
    yield be
    be.close()


@pytest.fixture
def sim_backend():
    be = get_backend("sim")
    yield be
    be.close()


@pytest.fixture
def delayed_sim():
    """A sim whose every device op first sleeps 1 ms: the host always runs ahead."""
    be = get_backend("sim", device_delay_s=0.001)
    yield be
    be.close()


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="run the tests marked slow (the long fuzz and soak; also VT_SLOW=1)")


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, hypothesis, every test module) lives for
    the whole run: moved out of the cyclic collector's reach (gc.freeze), so that a full
    collection, the automatic ones and the tests' own gc.collect() calls, scans only what the
    tests made since. Nothing a test made is frozen: leaks and finalizers are seen as before."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Tests marked slow skip with a reason unless --run-slow or VT_SLOW=1; tests marked gpu
    skip with a reason on a machine without a CUDA GPU."""
    if not (config.getoption("--run-slow") or env.get("VT_SLOW")):
        slow = pytest.mark.skip(reason="slow: run with --run-slow or VT_SLOW=1")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
    if "cuda" in available_backends():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_malloc_during_any_capture(monkeypatch):
    """Every DevicePool a test makes (fixtures, direct CudaBackend/SimBackend, engines) must report
    0 raw mallocs during capture when the test ends: the pool serves captures from pre-grown
    memory only. Totals are printed at the end of the run."""
    pools = []
    init = DevicePool.__init__

    def tracking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        pools.append(self)

    monkeypatch.setattr(DevicePool, "__init__", tracking_init)
    yield
    for pool in pools:
        captures, capture_mallocs = pool.capture_counts
        _pool_totals["pools"] += 1
        _pool_totals["captures"] += captures
        _pool_totals["capture_mallocs"] += capture_mallocs
        assert capture_mallocs == 0, f"{pool!r}: {capture_mallocs} driver mallocs during capture"


def pytest_terminal_summary(terminalreporter):
    t = _pool_totals
    if t["pools"]:
        terminalreporter.write_line(
            f"vt pools checked: {t['pools']} pools, {t['captures']} captures, "
            f"{t['capture_mallocs']} driver mallocs during capture")
