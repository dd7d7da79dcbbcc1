"""tools/pipeline_sim.py, the model docs/design.md quotes: its closed forms."""
import math

import pytest

from tool_loader import load_tool

sim = load_tool("pipeline_sim")


@pytest.mark.parametrize("h,d,latency", [(14.8, 14.7, 4.0), (20.0, 20.0, 2.0)])
def test_depth_2_at_balance_takes_half_of_h_plus_d_plus_latency(h, d, latency):
    assert math.isclose(sim.step_us(h, d, latency), (h + d + latency) / 2, rel_tol=1e-3)


@pytest.mark.parametrize("h,d", [(14.8, 14.7), (10.0, 30.0), (30.0, 10.0)])
def test_prepare_ahead_reaches_max_h_d(h, d):
    assert math.isclose(sim.step_us(h, d, 4.0, ahead=0.8 * h), max(h, d), rel_tol=1e-3)


def test_far_from_balance_depth_2_reaches_max_h_d_too():
    assert math.isclose(sim.step_us(24.0, 10.0, 4.0), 24.0, rel_tol=1e-3)   # host-bound
    assert math.isclose(sim.step_us(10.0, 60.0, 4.0), 60.0, rel_tol=1e-3)   # device-bound


def test_ahead_beyond_h_is_refused():
    with pytest.raises(ValueError, match="ahead"):
        sim.step_us(10.0, 10.0, 4.0, ahead=11.0)
