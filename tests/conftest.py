"""Shared fixtures: the same test functions run on every available backend."""
import pytest

from vt.backend import available_backends, get_backend


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


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu skip with a reason on a machine without a CUDA GPU."""
    if "cuda" in available_backends():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
