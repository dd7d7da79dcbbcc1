"""The KV-reuse hazard under overlap, proved the way the slot ring's was: an arm that
rewrites a KV block the moment the block pool hands it to a new owner, from a writer not
ordered after the decode stream (vt.hooks.KVPoison: NaN into the block, on a stream of its
own), detected by the tokens (a step that reads the poison gives NaN logits: an error row,
or other tokens).

With the pool's fence (production) a released block is handed out only once the host has
seen the last step that may read it complete, so no step in flight reads the poison: the
tokens equal the undisturbed run's. With the fence removed (fence=False) a block released
when step t launched is handed out by plan t + 1 while step t, slowed by device work, has
not read it yet: in drain, ring and staged (the host runs a step ahead) the poison lands in
a step in flight. Prefix caching is on, and the pool is tiny, so cached blocks are evicted
and rewritten every few steps."""
import pytest

from vt.backend import get_backend
from vt.forward.user import KVGeometry

from tests.engine._prefix import run, shared_prefix_workload, tokens

MODES = ("drain", "ring", "staged")
GEO = KVGeometry(max_seqs=8, num_kv_blocks=14, block_size=4, max_context=32)
DEVICE_WORK_S = 0.02


@pytest.fixture(scope="module")
def workload():
    return shared_prefix_workload(10, seed=5, max_new=(2, 5))


def _bad_results(be, workload, mode, fence) -> int:
    """The requests whose tokens differ from the unpoisoned reference's, run on `be` (closed
    after) with the poison armed, blocks reused and evicted."""
    p, b = workload
    try:
        ref = tokens(run(be, p, b, geometry=GEO, prefix_caching=False)[0])
        res, st, hooks = run(be, p, b, mode=mode, geometry=GEO, device_work_s=DEVICE_WORK_S,
                             poison=True, poison_fence=fence)
    finally:
        be.close()
    assert hooks.reused > 0 and st["prefix_cache"]["evictions"] > 0
    return sum(a != g for a, g in zip(ref, tokens(res)))


@pytest.mark.parametrize("mode", MODES)
def test_fence_keeps_every_step_off_a_rewritten_block_sim(workload, mode):
    assert _bad_results(get_backend("sim"), workload, mode, fence=True) == 0


@pytest.mark.parametrize("mode", MODES)
def test_without_the_fence_a_step_in_flight_reads_the_rewrite_sim(workload, mode):
    bad = _bad_results(get_backend("sim"), workload, mode, fence=False)
    assert bad > 0, "the unfenced arm read no poison: the hazard was not reproduced"


def test_sync_has_no_hazard_even_without_the_fence(workload):
    """Depth 1 collects step t before it plans t + 1: nothing is in flight to read a block."""
    assert _bad_results(get_backend("sim"), workload, "sync", fence=False) == 0


def _cuda():
    try:
        return get_backend("cuda")
    except Exception as exc:   # noqa: BLE001 (no GPU here: the reason is the skip's)
        pytest.skip(f"no cuda backend: {exc}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fence", (True, False))
def test_kv_reuse_hazard_cuda(workload, mode, fence):
    """The sim tests above on the GPU: the fence holds, the unfenced arm is detected."""
    bad = _bad_results(_cuda(), workload, mode, fence=fence)
    assert (bad == 0) if fence else (bad > 0)
