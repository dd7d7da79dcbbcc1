"""The fuzz harness for the tests: tools/fuzz.py (shared with the GPU runner), plus a drawer
backed by hypothesis, so hypothesis draws (and shrinks) the same distribution of cases."""

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from tools import fuzz as harness
from vt import env

Case, run_case, numpy_case, UNSAFE = harness.Case, harness.run_case, harness.numpy_case, harness.UNSAFE
SIM_DELAYS = (0.0, 0.0, 1e-4, 3e-4)


class HypothesisDraw:
    """tools/fuzz.py's drawer interface over hypothesis' `draw`."""

    def __init__(self, draw):
        self._draw = draw

    def int(self, lo, hi):
        return self._draw(st.integers(lo, hi))

    def bool(self):
        return self._draw(st.booleans())

    def choice(self, options):
        return self._draw(st.sampled_from(tuple(options)))


@st.composite
def cases(draw, **kw):
    """A tools/fuzz.py Case drawn by hypothesis (replayable from its printed JSON)."""
    return harness.draw_case(HypothesisDraw(draw), **{"sim_delays": SIM_DELAYS, **kw})


def fuzz_settings(max_examples):
    """No example database (nothing written into the checkout); a failure prints the
    @reproduce_failure blob, and the test prints the case's JSON and replay command. No
    shrinking unless VT_FUZZ_SHRINK=1: each example runs several engines, and shrinking one
    can take hypothesis' full five minutes; the failing case is printed whole anyway."""
    phases = tuple(Phase) if env.get("VT_FUZZ_SHRINK") else tuple(
        p for p in Phase if p not in (Phase.shrink, Phase.explain))
    return settings(max_examples=max_examples, deadline=None, database=None, print_blob=True,
                    phases=phases,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


class Tally:
    """Steps and cases a fuzz test ran, printed at its end (pytest -s, or on failure)."""

    def __init__(self, name):
        self.name, self.cases, self.steps, self.graph_steps, self.requests = name, 0, 0, 0, 0
        self.by_mode = {}

    def add(self, rep):
        self.cases += 1
        self.requests += rep.case.requests
        for mode, run in rep.runs.items():
            self.steps += run.stats["steps"]
            self.graph_steps += run.stats["graph_steps"]
            self.by_mode[mode] = self.by_mode.get(mode, 0) + run.stats["steps"]

    def __str__(self):
        return (f"{self.name}: {self.cases} cases, {self.requests} requests, {self.steps} steps "
                f"({self.graph_steps} graph) over all modes; per mode {self.by_mode}")
