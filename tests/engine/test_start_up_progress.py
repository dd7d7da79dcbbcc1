"""Engine(start_up_progress=...) says what its construction does and how far along it is: each
phase starts at 0 of its total and counts every piece up to it; without a callback the
construction prints nothing."""
import pytest

from vt.engine.engine import Engine
from vt.engine.progress import StartUpProgress
from vt.forward.toy import ToyForward
from vt.config import ExecutorConfig


def _run(be, mode, sizes, **kwargs):
    config = ExecutorConfig(mode=mode, serving_conc=4, capture_sizes=sizes)
    with Engine(be, ToyForward(be).step_model(), config, **kwargs) as eng:
        return eng.generate([[1, 2, 3]], max_new_tokens=3)


@pytest.mark.parametrize("mode,per_size", [("ring", 2), ("staged", 1), ("drain", 1)])
def test_every_graph_and_eager_shape_is_reported_in_order(sim_backend, mode, per_size):
    seen = []
    res = _run(sim_backend, mode, (1, 2, 4), start_up_progress=seen.append)
    assert len(res[0].tokens) == 3
    assert all(isinstance(p, StartUpProgress) for p in seen)
    capture = [p for p in seen if p.phase == "capturing decode graphs"]
    warm = [p for p in seen if p.phase == "warming up eager steps"]
    assert capture + warm == seen   # the graphs first, then the eager shapes
    total = 3 * per_size
    assert [(p.done, p.total) for p in capture] == [(i, total) for i in range(total + 1)]
    slots = [f", slot {i}" for i in range(per_size)] if per_size > 1 else [""]
    assert [p.detail for p in capture[1:]] == [f"size {s}{slot}" for s in (4, 2, 1)
                                               for slot in slots]
    # eager decode at each captured size and the capacity (the toy's 64 rows), then the
    # prompt path
    assert [(p.done, p.total, p.detail) for p in warm] == [
        (0, 5, ""), (1, 5, "decode, 1 rows"), (2, 5, "decode, 2 rows"),
        (3, 5, "decode, 4 rows"), (4, 5, "decode, 64 rows"), (5, 5, "the prompt path")]


def test_without_a_callback_the_start_up_prints_nothing(sim_backend, capsys):
    _run(sim_backend, "ring", (1, 2))
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_a_callback_that_is_not_callable_is_refused(sim_backend):
    with pytest.raises(TypeError, match="start_up_progress must be a callable or None, got str"):
        _run(sim_backend, "ring", (1,), start_up_progress="stderr")
