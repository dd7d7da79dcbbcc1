"""`vt run` reports the mode it runs: every combination of --mode, --unsafe-unguarded and the
mode variables (VT_ASYNC_EXECUTOR, VT_ASYNC_EXECUTOR_NO_DBUF, VT_ASYNC_EXECUTOR_POISON) is
either refused with one line or runs, and then the mode it prints (at the start and in the
summary) is the mode the engine's runner and graphs were built for: slots per size, the
guard, the staged H2D, the drain skip and the poison hook, read off the objects that ran and
checked against a table written here, not derived from vt/config.py."""
import itertools
import os
import re

import pytest

import vt.cli.run
import vt.engine.engine
from vt.cli.main import main
from vt.forward.toy import ToyForward
from vt.hooks import Poison
from mode_table import EXPECTED_MODES

EXPECTED = EXPECTED_MODES   # (depth, slots per size, guarded, staged H2D, drain skip)
RUN = ["run", "--backend", "sim", "--steps", "2", "--requests", "3", "--concurrency", "2",
       "--prompt-len", "4"]
SWITCH = (None, "0", "1")   # a variable unset, 0 or 1


def _combinations():
    for mode, opt_in, ring, unguarded, poison in itertools.product(
            (None, *EXPECTED), (False, True), SWITCH, SWITCH, SWITCH):
        environ = {k: v for k, v in (("VT_ASYNC_EXECUTOR", ring),
                                     ("VT_ASYNC_EXECUTOR_NO_DBUF", unguarded),
                                     ("VT_ASYNC_EXECUTOR_POISON", poison)) if v is not None}
        yield mode, opt_in, environ


def _asked_for(mode, environ):
    """The mode and poison the flags and variables ask for, or None: refused."""
    ring = environ.get("VT_ASYNC_EXECUTOR") == "1"
    unguarded = environ.get("VT_ASYNC_EXECUTOR_NO_DBUF") == "1"
    if mode is None:
        if ring and unguarded:
            return None
        mode = "ring" if ring else "unguarded" if unguarded else "drain"
    return mode, environ.get("VT_ASYNC_EXECUTOR_POISON") == "1"


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """No VT_* variable from the shell; the toy forward instead of the bundled model (its
    graphs are cheap to capture); every Engine vt run builds, with what it runs (read before
    close() frees its graphs)."""
    for var in [v for v in os.environ if v.startswith("VT_")]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VT_CAPTURE_SIZES", "1,2")

    def toy_model(be, cfg, **kwargs):
        model = ToyForward(be, vocab=cfg.vocab).step_model()
        model.close = lambda: None
        return model
    monkeypatch.setattr(vt.cli.run, "build_model", toy_model)
    engines = []

    class Recorded(vt.engine.engine.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append((self, _what_ran(self)))
    monkeypatch.setattr(vt.engine.engine, "Engine", Recorded)
    return engines


def _what_ran(engine):
    """(depth, slots per size, guarded, staged H2D, drain skip) of the objects that ran."""
    runner = engine.runner
    rings = list(runner.driver.rings.values())
    slots = {len(r.slots) for r in rings}
    guarded = {r.guarded for r in rings}
    staged = {s.staged for r in rings for s in r.slots}
    assert len(slots) == len(guarded) == len(staged) == 1, (slots, guarded, staged)
    return (engine.config.depth, slots.pop(), guarded.pop(), staged.pop(),
            runner._skip_graph_drain)


def test_every_accepted_combination_runs_the_mode_it_reports(capsys, monkeypatch, recorded):
    ran = refused = 0
    for mode, opt_in, environ in _combinations():
        for var in ("VT_ASYNC_EXECUTOR", "VT_ASYNC_EXECUTOR_NO_DBUF", "VT_ASYNC_EXECUTOR_POISON"):
            monkeypatch.delenv(var, raising=False)
        for var, value in environ.items():
            monkeypatch.setenv(var, value)
        argv = RUN + (["--mode", mode] if mode else []) + (["--unsafe-unguarded"] if opt_in else [])
        recorded.clear()
        rc = main(argv)
        out, err = capsys.readouterr()
        what = (argv, environ)
        asked = _asked_for(mode, environ)
        if asked is None or (asked[0] == "unguarded" and not opt_in):
            assert rc == 2 and out == "" and err.count("\n") == 1, (what, rc, out, err)
            assert not recorded, what
            refused += 1
            continue
        assert rc == 0, (what, out, err)
        expect_mode, expect_poison = asked
        ((engine, what_ran),) = recorded
        label = expect_mode + ("+poison" if expect_poison else "")
        # what vt run printed, at the start and in the summary
        start = re.search(r"mode=(\S+) \((.*?)\) conc=", out)
        assert start and start.group(1) == label, (what, out)
        assert re.search(rf"tokens/s, mode {re.escape(label)}\n", out), (what, out)
        # what the engine was built for
        assert engine.config.mode == expect_mode and engine.mode == label, what
        assert isinstance(engine.runner.hooks, Poison) == expect_poison, what
        assert what_ran == EXPECTED[expect_mode], what
        depth, slots, guarded, staged, skips = EXPECTED[expect_mode]
        assert start.group(2) == engine.config.describe(), what
        assert f"{slots} slot(s) per size" in start.group(2), what
        assert ("H2D staged" in start.group(2)) == staged, what
        assert (", guarded," in start.group(2)) == guarded, what
        assert ("WARNING: mode unguarded" in err) == (expect_mode == "unguarded"), what
        ran += 1
    assert ran and refused   # both outcomes were exercised
    print(f"{ran} combinations ran, {refused} refused")
