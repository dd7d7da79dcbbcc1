"""DevicePool over a fake raw provider (backend-agnostic), plus the pool of each real backend."""
import gc
import threading

import numpy as np
import pytest

from vt.backend import CaptureAllocationError, ClosedError
from vt.backend.pool import DevicePool, round_size


class FakeRaw:
    """Raw provider that records every call and the pool's capture state at that moment."""

    def __init__(self):
        self.pool = None
        self.next = 0x10000
        self.live = {}
        self.calls = []     # (op, ptr/size, capture name at call time)

    def malloc(self, nbytes):
        ptr, self.next = self.next, self.next + nbytes + 4096
        self.live[ptr] = nbytes
        self.calls.append(("malloc", nbytes, self.pool.capture_name if self.pool else None))
        return ptr

    def free(self, ptr):
        assert ptr in self.live, f"double or foreign free of {ptr:#x}"
        del self.live[ptr]
        self.calls.append(("free", ptr, self.pool.capture_name if self.pool else None))


def make_pool(debug=False):
    raw = FakeRaw()
    pool = DevicePool(raw, debug=debug)
    raw.pool = pool
    return raw, pool


def test_sizes_round_up_to_512_bytes():
    """Requests are served from 512-byte size classes."""
    assert [round_size(n) for n in (0, 1, 512, 513, 4096)] == [512, 512, 512, 1024, 4096]
    with pytest.raises(ValueError, match="cannot allocate -1 bytes"):
        round_size(-1)


def test_freed_block_is_reused_without_a_driver_call():
    """A freed block goes to the free list and serves the next request of its size class."""
    raw, pool = make_pool()
    a = pool.alloc(1000)
    ptr = a.ptr
    a.free()
    a.free()  # idempotent
    b = pool.alloc(900)
    assert b.ptr == ptr and b.nbytes == 900
    assert pool.stats().driver_mallocs == 1


def test_stats_account_for_every_byte():
    """bytes_reserved = in use + free + scratch, and the counters follow the calls."""
    raw, pool = make_pool()
    a = pool.alloc(1000)
    b = pool.alloc(100)
    b.free()
    pool.reserve_scratch(4096)
    st = pool.stats()
    assert (st.bytes_in_use, st.free_bytes, st.scratch_bytes) == (1024, 512, 4096)
    assert st.bytes_reserved == 1024 + 512 + 4096 == sum(raw.live.values())
    assert (st.driver_mallocs, st.mallocs_during_capture, st.captures) == (3, 0, 0)
    del a


def test_garbage_collected_buffer_returns_to_the_pool():
    """The finalizer backstop frees a buffer nobody freed."""
    raw, pool = make_pool()
    pool.alloc(2048)  # dropped at once
    gc.collect()
    st = pool.stats()
    assert (st.bytes_in_use, st.free_bytes) == (0, 2048)


def test_reserve_leaves_count_free_blocks_that_serve_retained_requests_in_capture():
    """reserve(n, count) pre-grows exactly enough for `count` retained requests in a capture."""
    raw, pool = make_pool()
    pool.reserve(1000, count=3)
    pool.reserve(1000, count=2)  # already satisfied: no new block
    assert pool.stats().free_bytes == 3 * 1024 and pool.stats().driver_mallocs == 3
    with pool.capturing("S=8 slot=0"):
        kept = [pool.alloc_retained(1000) for _ in range(3)]
        with pytest.raises(CaptureAllocationError, match=r"capture 'S=8 slot=0' needs a retained "
                                                         r"block of 1000 bytes") as info:
            pool.alloc_retained(1000)
    assert (info.value.requested, info.value.free, info.value.capture) == (1000, 0, "S=8 slot=0")
    assert "pool state" in str(info.value)
    assert pool.stats().mallocs_during_capture == 0 and len(kept) == 3


def test_pool_never_calls_the_driver_while_capturing():
    """Every raw call happens outside capture, whatever is requested inside it."""
    raw, pool = make_pool()
    pool.reserve(4096, 2)
    pool.reserve_scratch(8192)
    outside = pool.alloc(512)
    with pool.capturing("g"):
        pool.alloc(4000)
        pool.alloc_retained(4096)
        outside.free()
        for request in (lambda: pool.alloc(1 << 20), lambda: pool.alloc_retained(1 << 20)):
            with pytest.raises(CaptureAllocationError, match="capture 'g' needs a"):
                request()
    assert all(capture is None for _, _, capture in raw.calls)
    assert pool.stats().mallocs_during_capture == 0
    assert pool.capture_counts == (1, 0)


def test_scratch_arena_restarts_at_each_capture_and_is_shared():
    """All captures bump through the same arena from offset 0; scratch free() is a no-op."""
    raw, pool = make_pool()
    pool.reserve_scratch(3 * 512)
    layouts = []
    for name in ("a", "b"):
        with pool.capturing(name):
            bufs = [pool.alloc(n) for n in (100, 600)]
            for buf in bufs:
                buf.free()
            layouts.append([(b.block_ptr, b.offset) for b in bufs])
    assert layouts[0] == layouts[1] and [off for _, off in layouts[0]] == [0, 512]
    assert pool.stats().captures == 2 and pool.stats().bytes_in_use == 0


def test_scratch_request_beyond_the_arena_raises_with_the_free_scratch_bytes():
    """A capture whose scratch exceeds the arena fails naming requested and free bytes."""
    raw, pool = make_pool()
    pool.reserve_scratch(1024)
    with pool.capturing("S=32"):
        pool.alloc(512)
        with pytest.raises(CaptureAllocationError, match=r"scratch block of 2000 bytes.*512 bytes "
                                                         r"of scratch memory free") as info:
            pool.alloc(2000)
    assert (info.value.requested, info.value.free) == (2000, 512)


def test_alloc_outside_capture_never_touches_the_arena():
    """Outside capture alloc() uses the cached blocks; the arena stays as reserved."""
    raw, pool = make_pool()
    pool.reserve_scratch(4096)
    buf = pool.alloc(1024)
    assert not buf.scratch and pool.stats().scratch_bytes == 4096 and buf.block_ptr == buf.ptr


def test_scratch_warmup_sizes_the_arena_for_the_capture():
    """The eager warm-up records its request sizes; the same requests then fit in the capture."""
    raw, pool = make_pool()
    with pool.scratch_warmup("S=4"):
        temps = [pool.alloc(n) for n in (1000, 3000, 10)]
    assert pool.stats().scratch_bytes == 1024 + 3072 + 512
    mallocs = pool.stats().driver_mallocs
    with pool.capturing("S=4"):
        for n in (1000, 3000, 10):
            pool.alloc(n)
    assert pool.stats().driver_mallocs == mallocs and pool.stats().mallocs_during_capture == 0
    del temps


def test_arena_growth_retires_but_keeps_the_old_arena():
    """Graphs captured against an old arena keep valid addresses: growth never frees it."""
    raw, pool = make_pool()
    pool.reserve_scratch(1024)
    pool.reserve_scratch(4096)
    pool.reserve_scratch(2048)  # already big enough
    assert pool.stats().scratch_bytes == 1024 + 4096 and len(raw.live) == 2


def test_growth_is_refused_during_capture():
    """reserve / reserve_scratch inside a capture would call the driver: RuntimeError."""
    raw, pool = make_pool()
    with pool.capturing("g"):
        with pytest.raises(RuntimeError, match=r"reserve\(\) during capture 'g'"):
            pool.reserve(512)
        with pytest.raises(RuntimeError, match=r"reserve_scratch\(\) during capture 'g'"):
            pool.reserve_scratch(512)


def test_one_capture_at_a_time():
    """A second capture (or a warm-up) while capturing is refused, naming the open one."""
    raw, pool = make_pool()
    with pool.capturing("first"):
        with pytest.raises(RuntimeError, match="pool is busy with 'first'"):
            with pool.capturing("second"):
                pass
        with pytest.raises(RuntimeError, match="cannot warm up 'w'"):
            with pool.scratch_warmup("w"):
                pass
    with pool.capturing("third"):
        pass


def test_capture_state_ends_when_the_block_raises():
    """An exception inside capturing() still leaves capture state."""
    raw, pool = make_pool()
    with pytest.raises(KeyError):
        with pool.capturing("g"):
            raise KeyError("boom")
    assert pool.capture_name is None
    pool.reserve(512)


def test_debug_mode_gives_each_buffer_its_own_allocation_of_its_exact_size():
    """debug=True: one raw allocation of the exact size per buffer, cached by exact size."""
    raw, pool = make_pool(debug=True)
    a, b = pool.alloc(100), pool.alloc(100)
    assert raw.live[a.ptr] == 100 and raw.live[b.ptr] == 100 and a.ptr != b.ptr
    assert pool.size_class(100) == 100 and pool.stats().bytes_in_use == 200
    ptr = a.ptr
    a.free()
    assert ptr in raw.live and pool.stats().free_bytes == 100
    assert pool.alloc(101).ptr != ptr, "a different exact size is a different class"
    assert pool.alloc(100).ptr == ptr and pool.stats().driver_mallocs == 3


def test_debug_mode_keeps_reserve_and_retained_blocks_served_in_capture():
    """debug=True still pre-grows: reserved and freed blocks serve retained requests in a capture."""
    raw, pool = make_pool(debug=True)
    pool.reserve(4000, count=2)
    pool.alloc_retained(3000).free()
    with pool.capturing("g"):
        first, second, third = (pool.alloc_retained(4000), pool.alloc_retained(4000),
                                pool.alloc_retained(3000))
        with pytest.raises(CaptureAllocationError, match="retained block of 4000 bytes"):
            pool.alloc_retained(4000)
    assert raw.live[first.ptr] == raw.live[second.ptr] == 4000 and raw.live[third.ptr] == 3000
    assert pool.stats().mallocs_during_capture == 0


def test_debug_scratch_serves_one_block_per_request_index():
    """debug=True: the warm-up grows one exact-size block per request index; the capture uses them in order."""
    raw, pool = make_pool(debug=True)
    with pool.scratch_warmup("S=2"):
        pool.alloc(1000)
        pool.alloc(3000)
    with pool.capturing("S=2"):
        first, second = pool.alloc(1000), pool.alloc(3000)
    assert (first.offset, second.offset) == (0, 0)
    assert raw.live[first.ptr] == 1000 and raw.live[second.ptr] == 3000
    with pool.capturing("S=2 bigger"):
        pool.alloc(1000)
        with pytest.raises(CaptureAllocationError, match="scratch block of 5000 bytes"):
            pool.alloc(5000)


def test_frees_during_capture_return_to_the_cache_without_a_driver_call():
    """Freeing inside a capture (either mode) calls no driver function: the block is cached."""
    for debug in (False, True):
        raw, pool = make_pool(debug=debug)
        buf = pool.alloc(512)
        with pool.capturing("g"):
            buf.free()
        assert buf.ptr in raw.live and pool.stats().free_bytes == 512
        assert all(capture is None for _, _, capture in raw.calls)


def test_close_frees_everything_and_refuses_further_use():
    """close() returns every block to the driver, is idempotent, and later use raises."""
    raw, pool = make_pool()
    kept = pool.alloc(512)
    pool.alloc(1024).free()
    pool.reserve_scratch(2048)
    with pool.capturing("g"):
        pass
    pool.close()
    pool.close()
    assert raw.live == {}
    assert pool.capture_counts == (1, 0)   # still readable: the suite checks closed pools too
    kept.free()  # a buffer outliving its pool is harmless
    with pytest.raises(ClosedError, match="DevicePool is closed"):
        pool.alloc(512)


def test_concurrent_alloc_and_free_keep_the_books_balanced():
    """Allocations and frees from many threads (CuPy frees from any thread) stay consistent."""
    raw, pool = make_pool()

    def churn(seed):
        rng = np.random.default_rng(seed)
        for _ in range(300):
            bufs = [pool.alloc(int(n)) for n in rng.integers(1, 5000, 4)]
            for buf in bufs:
                buf.free()

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    st = pool.stats()
    assert st.bytes_in_use == 0 and st.free_bytes == st.bytes_reserved == sum(raw.live.values())


def test_backend_pool_makes_no_driver_call_during_capture(backend):
    """On a real backend, a pre-grown capture (scratch + retained arrays) mallocs nothing."""
    s = backend.stream()
    backend.pool.reserve(4096 * 4, count=1)
    backend.pool.reserve_scratch(8192)
    before = backend.pool.stats()
    with backend.capture(s, name="pre-grown"):
        out = backend.empty((4096,), np.float32, retained=True)
        tmp = backend.empty((1024,), np.float32)
        backend.copy_d2d(tmp, out[:1024], s)
    after = backend.pool.stats()
    assert after.mallocs_during_capture == 0
    assert after.driver_mallocs == before.driver_mallocs
    assert after.captures == before.captures + 1


def test_backend_device_array_returns_its_block_when_it_dies(backend):
    """A device array owns its pool buffer: dropping the array frees the block."""
    arr = backend.empty((1000,), np.int32)
    in_use = backend.pool.stats().bytes_in_use
    assert in_use >= 4000
    del arr
    gc.collect()
    assert backend.pool.stats().bytes_in_use == in_use - backend.pool.size_class(4000)
