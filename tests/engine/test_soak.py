"""Soak: one engine, thousands of steps with continuous admissions; pool
bytes, driver mallocs, live graphs, events, streams and pinned buffers flat after warm-up;
every admitted request finished with its tokens. The harness is tools/soak.py (the GPU run
uses it too); CI runs a short soak, `--run-slow` / VT_SLOW=1 the 10,000-step one."""

import pytest

from tools import soak as soak_tool
from vt.backend import get_backend


def _soak(steps, mode, **kw):
    be = get_backend("sim")
    try:
        rep = soak_tool.soak(be, steps=steps, mode=mode, chunk_steps=max(200, steps // 8), **kw)
    finally:
        be.close()
    soak_tool.print_report(rep)
    assert rep["steps"] >= steps
    assert len(rep["chunks"]) >= 3, "too few chunks to see a trend"
    assert not rep["problems"], rep["problems"][:5]
    assert rep["flat"], f"resources drifted after warm-up: {rep['drift']}"
    assert rep["driver_mallocs_since_warm_up"] == 0
    assert rep["reference_mismatches"] == 0 and rep["reference_requests"] > 0
    s = rep["start"]
    assert s["graphs"] > 0 and s["events"] > 0 and s["pinned_buffers"] > 0
    return rep


@pytest.mark.parametrize("mode", ["drain", "ring", "staged"])
def test_short_soak_is_flat(mode):
    rep = _soak(1200, mode, conc=8)
    assert rep["stats"]["graph_steps"] > rep["stats"]["mixed_steps"] > 0


@pytest.mark.slow
def test_soak_10000_steps_is_flat():
    rep = _soak(10_000, "ring", conc=8)
    assert sum(c["requests"] for c in rep["chunks"]) > 1000


@pytest.mark.slow
def test_soak_ring_eager_mix_is_flat():
    """Capture sizes up to 4 at concurrency 8: oversize steps run eagerly between graph ones."""
    _soak(4000, "ring", conc=8, capture_sizes=(1, 2, 4))


def test_the_soak_sees_a_leak(monkeypatch):
    """The harness is not blind: an engine that keeps one event per generate() drifts."""
    from vt.engine.engine import Engine
    kept, generate = [], Engine.generate

    def leaky(self, *a, **kw):
        kept.append(self.be.event())
        return generate(self, *a, **kw)

    monkeypatch.setattr(Engine, "generate", leaky)
    be = get_backend("sim")
    try:
        rep = soak_tool.soak(be, steps=900, mode="ring", chunk_steps=200, log=lambda s: None)
    finally:
        be.close()
    assert not rep["flat"] and "events" in rep["drift"]
