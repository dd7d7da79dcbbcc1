"""The one replay timer: Engine.device_ceiling_us and vt bench time back-to-back device work
with it."""
from __future__ import annotations

import statistics


def timed_ms(be, stream, fn, iters: int, repeats: int, warmup: int = 0) -> float:
    """Median over `repeats` of the mean device ms of one fn() among `iters` back-to-back calls.

    fn only queues work on `stream` (a graph launch, kernels); two timing events around each
    group measure the device time with no host gap between the calls' work other than what
    the host's queueing cannot hide. `be` is anything whose `event(timing_enabled=True)`
    returns an event with record(stream), synchronize() and elapsed_ms(start) (a vt backend,
    or torch_peer.TorchEvents). `warmup` untimed calls go first (graph upload, caches).
    """
    if iters < 1 or repeats < 1:
        raise ValueError(f"timed_ms: iters ({iters}) and repeats ({repeats}) must be >= 1")
    a, b = be.event(timing_enabled=True), be.event(timing_enabled=True)
    try:
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(repeats):
            a.record(stream)
            for _ in range(iters):
                fn()
            b.record(stream)
            b.synchronize()
            out.append(b.elapsed_ms(a) / iters)
        return statistics.median(out)
    finally:
        for ev in (a, b):
            close = getattr(ev, "close", None)   # vt's events own a handle; torch's do not
            if close is not None:
                close()
