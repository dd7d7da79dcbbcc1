"""tools/plan_broadcast_cost.py runs: a worker process answers every step, and the steady
step's message is the three moving vectors (12 bytes a row) behind a 16-byte header."""
from tools import plan_broadcast_cost


def test_the_cost_tool_measures_a_steady_step_and_a_change():
    r = plan_broadcast_cost.measure(rows=64, max_context=256, block_size=16, steps=300)
    assert r["message_bytes"] == 16 + 12 * 64
    assert 0 < r["send_us_p50"] <= r["send_us_p99"]
    assert 0 < r["one_way_us_p50"] <= r["one_way_us_p99"]
    assert r["change_us_p50"] > 0
