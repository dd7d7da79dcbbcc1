"""The host-overwrite hazard's primitive: a replay reads its baked host vector when the copy
runs, not at launch."""
import time

import numpy as np
import pytest

TRIALS = 20
N = 1024
# Device work queued ahead of each replay, so the host runs ahead: the overwrite follows the
# launch within microseconds, but on a loaded CPU the sim's threads may wait several GIL switch
# intervals (5 ms each) for their turn, so the margin is 50 ms.
QUEUED_AHEAD_S = 0.05


def _count_corruptions(be, guarded: bool) -> int:
    """Replay a graph baking one pinned vector; the host overwrites it right after launch.

    guarded: before overwriting, wait on a blocking-sync event recorded after the replay.
    A trial is corrupted when the device received the overwritten data, not the launch's.
    """
    s = be.stream()
    h = be.pinned_empty((N,), np.int32)
    d = be.empty((N,), np.int32)
    seen = be.pinned_empty((N,), np.int32)
    reuse = be.event(blocking_sync=True)
    with be.capture(s, name="host-overwrite-hazard") as cap:
        be.copy_h2d(d, h, s)
    corrupted = 0
    for trial in range(TRIALS):
        h[:] = trial                     # Refresh(N): the inputs this replay must read
        be.busy_wait(s, QUEUED_AHEAD_S)
        cap.graph.launch(s)              # Replay(N)
        if guarded:
            reuse.record(s)
            reuse.synchronize()
        h[:] = -1 - trial                # Refresh(N+1) overwrites the same slot
        seen[:] = 0
        be.copy_d2h(seen, d, s)
        s.synchronize()
        corrupted += int(not np.array_equal(seen, np.full(N, trial, np.int32)))
    return corrupted


@pytest.mark.needs_overlap
def test_unguarded_overwrite_after_launch_corrupts_the_replay(backend, record_property):
    """Without a wait, the replay reads the host's next-step data (the host-overwrite hazard
    reproduced)."""
    corrupted = _count_corruptions(backend, guarded=False)
    print(f"\n[{backend.name}] host-overwrite hazard, unguarded: {corrupted}/{TRIALS} replays "
          f"read overwritten data")
    record_property("host_overwrite_unguarded_corrupted", f"{corrupted}/{TRIALS}")
    assert corrupted >= TRIALS - 2


def test_waiting_on_a_blocking_sync_event_before_overwriting_prevents_corruption(backend,
                                                                                 record_property):
    """Waiting on the reuse event recorded after the replay: never any corruption."""
    corrupted = _count_corruptions(backend, guarded=True)
    print(f"\n[{backend.name}] host-overwrite hazard, event-guarded: {corrupted}/{TRIALS} "
          f"replays read overwritten data")
    record_property("host_overwrite_guarded_corrupted", f"{corrupted}/{TRIALS}")
    assert corrupted == 0


def test_blocking_sync_wait_uses_far_less_cpu_than_spinning(backend, record_property):
    """A ~0.2 s blocking-sync event wait costs < 25% of the CPU time of a spinning query loop."""
    s = backend.stream()

    def cpu_of_wait(wait):
        ev = backend.event(blocking_sync=True)
        backend.busy_wait(s, 0.2)
        ev.record(s)
        wall, cpu = time.perf_counter(), time.process_time()
        wait(ev)
        return time.process_time() - cpu, time.perf_counter() - wall

    def spin(ev):
        while not ev.query():
            pass

    cpu_block, wall_block = cpu_of_wait(lambda ev: ev.synchronize())
    cpu_spin, wall_spin = cpu_of_wait(spin)
    print(f"\n[{backend.name}] 0.2 s event wait: blocking_sync {cpu_block * 1e3:.1f} ms CPU "
          f"({wall_block * 1e3:.0f} ms wall), spinning {cpu_spin * 1e3:.1f} ms CPU "
          f"({wall_spin * 1e3:.0f} ms wall)")
    record_property("blocking_wait_cpu_ms", round(cpu_block * 1e3, 2))
    record_property("spinning_wait_cpu_ms", round(cpu_spin * 1e3, 2))
    assert wall_block > 0.1 and wall_spin > 0.1, "the waits must actually wait"
    assert cpu_block < 0.25 * cpu_spin
