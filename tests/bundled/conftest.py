"""Fixtures of the model tests."""
import pytest

from ._util import DeviceIO


@pytest.fixture
def io(backend):
    return DeviceIO(backend)
