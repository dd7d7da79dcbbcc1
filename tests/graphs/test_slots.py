"""SizeSlot / SlotRing / driver behaviour: capture with warm-up, padding, stale views, and the
whole decode step (inputs H2D, forward, sampling, tokens D2H) in one graph."""
import numpy as np
import pytest

from vt.backend import CaptureAllocationError
from vt.graphs import DecodeGraphDriver, GraphSettings, StaleLogitsError, StepHalves
from vt.config import ExecutorConfig
from vt.step.contract import DecodeRows
from vt.forward.toy import ToyForward
from vt.hooks import NULL_HOOKS, NoPoolPreGrow


def _driver(be, mode="drain", hooks=NULL_HOOKS):
    """The driver of `mode`'s config (its slots per size, guard and H2D path)."""
    toy = ToyForward(be, vocab=32)
    model = toy.step_model()
    g = toy.geometry
    c = ExecutorConfig(mode=mode, capture_sizes=(1, 2, 4, 8))
    settings = GraphSettings(sizes=c.capture_sizes, slots_per_size=c.slots_per_size,
                             guarded=c.guarded, staged=c.staged_h2d)
    step = StepHalves(forward=model.decode, sample=model.sample)
    return DecodeGraphDriver(be, be.stream(name="test"), step, vocab=32, max_blocks=g.max_blocks,
                             pad=g.pad, settings=settings, hooks=hooks), toy


def _acquire(drv, n):
    """The slot of a step of n rows through its ring's guard, and the seconds it waited."""
    return drv.ring_for(n).acquire()


def _rows(n, position=0):
    """n sequences in rows 0..n-1, block i+1 each, at `position`."""
    bt = np.zeros((n, 16), np.int32)
    bt[:, 0] = np.arange(1, n + 1)
    pos = np.full(n, position, np.int32)
    return DecodeRows(np.arange(n, dtype=np.int32), pos, pos + 1,
                      (bt[:, 0] * 4 + position).astype(np.int32), bt, np.arange(n, dtype=np.int32))


def _launch(drv, slot, rows):
    slot.host.fill(rows, drv.pad)
    return slot.launch(drv.stream, len(rows), 0)


def test_ring_on_without_pool_pre_grow_fails_at_the_second_capture(backend):
    """Slot 0 takes the warm-up's freed logits block; slot 1 needs a new one: refused."""
    drv, _ = _driver(backend, "ring", hooks=NoPoolPreGrow())
    with pytest.raises(CaptureAllocationError, match=r"S=8 slot=1") as err:
        drv.capture()
    assert backend.pool.stats().mallocs_during_capture == 0
    assert err.value.requested == 8 * 32 * 4
    slot = drv.rings[8].slots[0]                # captured before the failure: still replays
    out = _launch(drv, slot, _rows(2))
    drv.stream.synchronize()                    # the capture was ended: the stream still works
    assert np.isfinite(out.rows).all() and np.abs(out.rows).max() <= 1.0
    drv.close()


def test_off_path_needs_no_pre_grow(backend):
    """One slot per size: the warm-up's block serves its single capture."""
    drv, _ = _driver(backend, hooks=NoPoolPreGrow())
    drv.capture()
    assert sorted(drv.rings) == [1, 2, 4, 8]
    drv.close()


@pytest.mark.parametrize("mode", ["ring", "staged"])
def test_capture_with_warm_up_makes_no_malloc_during_capture(backend, mode):
    """Warm-up + pre-grow: every size (4 of them), k=2 slots, 0 driver calls while
    capturing; staged captures one step per size. A step is two captures (its forward's
    graph and its sampler's)."""
    drv, _ = _driver(backend, mode)
    before = backend.pool.stats()
    drv.capture()
    after = backend.pool.stats()
    assert after.mallocs_during_capture == 0
    assert after.captures - before.captures == 2 * (4 if mode == "staged" else 8)
    assert all(len(r.slots) == 2 for r in drv.rings.values())
    drv.close()


def test_padded_size_is_the_smallest_captured_size_that_fits(sim_backend):
    """3 -> 4, 5 -> 8, 8 -> 8, 9 -> eager (None)."""
    drv, _ = _driver(sim_backend)
    drv.capture()
    assert [drv.padded_size(n) for n in (1, 3, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]
    assert drv.ring_for(9) is None
    drv.close()


def test_padded_rows_point_at_the_scratch_row(sim_backend):
    """Rows past n in a slot's host vectors hold the pad row after Refresh."""
    drv, toy = _driver(sim_backend)
    drv.capture()
    slot, _ = _acquire(drv, 3)
    slot.host.fill(_rows(3), toy.geometry.pad)
    inp = slot.host.inputs
    assert inp.token_rows.tolist() == [0, 1, 2, toy.geometry.max_seqs]
    assert inp.slot_mapping[3] == toy.geometry.pad.slot
    assert (inp.temperature[3], inp.top_k[3], inp.top_p[3]) == (0.0, 0, 1.0)   # padded rows sample greedily
    slot.host.fill(_rows(1), toy.geometry.pad)              # fewer rows: the tail is padded again
    assert inp.token_rows.tolist() == [0] + [toy.geometry.max_seqs] * 3
    drv.close()


def test_the_graph_returns_the_sampled_tokens_in_the_slot_pinned_output(backend):
    """One launch: inputs in, forward, sampling, token table updated, tokens back on the host."""
    drv, toy = _driver(backend)
    drv.capture()
    slot, _ = _acquire(drv, 2)
    slot.out_host[...] = -1
    out = _launch(drv, slot, _rows(2))
    slot.done.synchronize()
    expected = np.argmax(out.rows, axis=1)
    assert slot.out_host[:2, 0].tolist() == expected.tolist()
    table = backend.pinned_empty(toy.token_table.shape, np.int32)
    backend.copy_d2h(table, toy.token_table, drv.stream)
    drv.stream.synchronize()
    assert table[:2].tolist() == expected.tolist()
    drv.close()


def test_ring_alternates_slots(sim_backend):
    """The ring modes: acquisitions of one size go slot 0, 1, 0; drain always slot 0."""
    for mode in ("ring", "staged"):
        ring_drv, _ = _driver(sim_backend, mode)
        ring_drv.capture()
        assert [_acquire(ring_drv, 4)[0].index for _ in range(3)] == [0, 1, 0]
        ring_drv.close()
    off_drv, _ = _driver(sim_backend)
    off_drv.capture()
    assert [_acquire(off_drv, 4)[0].index for _ in range(3)] == [0, 0, 0]
    off_drv.close()


def test_ring_acquire_blocks_until_the_slot_replay_finished():
    """The guard waits on the reuse event of the slot's last replay (blocking)."""
    from vt.backend import get_backend
    be = get_backend("sim")
    drv, toy = _driver(be, "ring")
    drv.capture()
    slot, _ = _acquire(drv, 1)
    be.busy_wait(drv.stream, 0.05)
    _launch(drv, slot, _rows(1))
    _acquire(drv, 1)                    # slot 1: free
    again, waited = _acquire(drv, 1)    # slot 0 again: its replay is behind 50 ms of work
    assert again is slot and waited > 0.02
    drv.close()
    be.close()


def test_reading_a_stale_logits_view_raises(backend):
    """A graph view is valid until its slot is replayed again, then raises (k=2)."""
    drv, _ = _driver(backend, "ring")
    drv.capture()
    a, _ = _acquire(drv, 2)
    first = _launch(drv, a, _rows(2))
    assert first.non_owning_view
    b, _ = _acquire(drv, 2)
    second = _launch(drv, b, _rows(2))
    first.array                                   # slot 1 replayed: slot 0's view still valid
    c, _ = _acquire(drv, 2)
    assert c is a
    _launch(drv, c, _rows(2, position=1))
    with pytest.raises(StaleLogitsError, match=r"S=2 slot=0 generation 1 is stale"):
        first.array
    second.rows
    drv.stream.synchronize()
    drv.close()


def test_closed_driver_refuses_use(sim_backend):
    from vt.backend import ClosedError
    drv, _ = _driver(sim_backend)
    drv.close()
    drv.close()
    with pytest.raises(ClosedError, match="closed"):
        drv.capture()


@pytest.mark.parametrize("slots,error", [(0, ValueError), (3, ValueError), (2.0, TypeError),
                                         (True, TypeError)])
def test_graph_settings_take_one_or_two_slots_per_size(slots, error):
    """A depth-2 pipeline never needs a third slot (vt/config.py RING_SLOTS)."""
    with pytest.raises(error, match=r"slots_per_size must be an integer in \[1, 2\]"):
        GraphSettings(sizes=(1, 2), slots_per_size=slots, guarded=True, staged=False)
    assert GraphSettings(sizes=(np.int64(1),), slots_per_size=np.int64(2), guarded=True,
                         staged=False).slots_per_size == 2


def _count_graph_launches(monkeypatch, drv):
    """The names of the graphs launched from now on, in order (every graph of the backend:
    the slots' forward, sampler and whole-step graphs are one class)."""
    launched = []
    graph_class = type(drv.rings[2].peek().output.whole)
    launch = graph_class.launch
    monkeypatch.setattr(graph_class, "launch",
                        lambda self, stream: (launched.append(self.name), launch(self, stream))[1])
    return launched


@pytest.mark.parametrize("mode", ["drain", "ring", "staged"])
def test_a_slot_step_is_one_graph_launch_and_its_halves_two(backend, monkeypatch, mode):
    """slot.launch replays the joined step graph alone; launch_forward + launch_sampler replay
    the forward and the sampler graphs. Over four steps (each reading the tokens the one
    before fed into the token table), each on its own toy state, the two give the same
    logits and token records byte for byte, and the same generation count."""
    def steps(split: bool):
        drv, _ = _driver(backend, mode)
        drv.capture()
        launched = _count_graph_launches(monkeypatch, drv)
        records, logits, names = [], [], []
        for position in range(4):
            slot, _ = _acquire(drv, 2)
            slot.host.fill(_rows(2, position), drv.pad)
            slot.out_host[...] = -1
            if split:
                view = slot.launch_forward(drv.stream, 2, position)
                slot.launch_sampler(drv.stream)
            else:
                view = slot.launch(drv.stream, 2, position)
            slot.done.synchronize()
            names.append(list(launched))
            launched.clear()
            records.append(slot.out_host[:2].copy())
            logits.append(np.asarray(backend.xp.asnumpy(view.rows) if backend.name == "cuda"
                                     else view.rows).copy())
            assert view.generation == slot.output.generation and not slot.output.sampler_pending
        generations = [s.output.generation for s in drv.rings[2].slots]
        monkeypatch.undo()
        drv.close()
        return records, logits, names, generations
    whole, split = steps(False), steps(True)
    slot_names = ["S=2 slot=0", "S=2 slot=1" if mode == "ring" else "S=2 slot=0"] * 2
    assert whole[2] == [[f"{name} step"] for name in slot_names]
    assert split[2] == [[f"{name} forward", f"{name} sampler"] for name in slot_names]
    # each slot's output: staged slots share one
    assert whole[3] == split[3] == {"drain": [4], "ring": [2, 2], "staged": [4, 4]}[mode]
    for got, want in zip(split[0] + split[1], whole[0] + whole[1]):
        assert got.tobytes() == want.tobytes()
    assert len({r.tobytes() for r in whole[0]}) > 1   # the steps differ: their inputs were read


def test_a_whole_launch_waits_for_the_sampler_of_a_forward_launched_alone(sim_backend):
    """A whole launch is a forward and its sampler: after a forward alone, it is refused until
    that forward's sampler is launched, as a second forward is."""
    drv, _ = _driver(sim_backend)
    drv.capture()
    slot, _ = _acquire(drv, 2)
    slot.host.fill(_rows(2), drv.pad)
    slot.launch_forward(drv.stream, 2, 0)
    with pytest.raises(RuntimeError, match=r"S=2 slot=0: forward launched again before the "
                                           r"sampler of generation 1"):
        slot.launch(drv.stream, 2, 1)
    slot.launch_sampler(drv.stream)
    assert slot.launch(drv.stream, 2, 1).generation == 2 and not slot.output.sampler_pending
    with pytest.raises(RuntimeError, match="launch_sampler\\(\\) without a forward to sample "
                                           "\\(generation 2 is sampled already\\)"):
        slot.launch_sampler(drv.stream)
    drv.stream.synchronize()
    drv.close()
