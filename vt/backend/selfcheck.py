"""A tiny capture/replay self-check that runs on any backend (only the Backend contract).

Captures H2D copy -> elementwise kernel -> D2H copy, then replays the graph three times with
new host input each time: the baked H2D must re-read the pinned host vector at every replay.
`vt info` prints its result; it is what a user runs first when something looks wrong.
"""
from __future__ import annotations

import traceback

import numpy as np

_N = 4096
_SCALE, _OFFSET = 3, 7
_POISON = -12345


class AffineKernel:
    """out = x * scale + offset, elementwise, int32, in place into `out` (no temporaries)."""

    def run_numpy(self, x, out, scale: int, offset: int) -> None:
        np.multiply(x, scale, out=out)
        np.add(out, offset, out=out)

    def run_cupy(self, stream_handle: int, x, out, scale: int, offset: int) -> None:
        import cupy
        cupy.multiply(x, scale, out=out)
        cupy.add(out, offset, out=out)


def run_selfcheck(be, replays: int = 3, seed: int = 0) -> tuple[bool, str]:
    """(ok, message): capture H2D + kernel + D2H once, replay `replays` times with new input."""
    stream = graph = None
    try:
        rng = np.random.default_rng(seed)
        stream = be.stream(name="selfcheck")
        host_in = be.pinned_empty((_N,), np.int32)
        host_out = be.pinned_empty((_N,), np.int32)
        dev_in = be.empty((_N,), np.int32)
        dev_out = be.empty((_N,), np.int32)
        kernel = AffineKernel()

        def step():
            be.copy_h2d(dev_in, host_in, stream)
            be.launch(stream, kernel, dev_in, dev_out, scale=_SCALE, offset=_OFFSET)
            be.copy_d2h(host_out, dev_out, stream)

        host_in[:] = rng.integers(-1000, 1000, _N, dtype=np.int32)
        step()  # eager warm-up: compiles the kernel outside the capture
        stream.synchronize()
        with be.capture(stream, name="selfcheck") as cap:
            step()
        graph = cap.graph
        for i in range(replays):
            host_in[:] = rng.integers(-1000, 1000, _N, dtype=np.int32)
            host_out[:] = _POISON
            graph.launch(stream)
            stream.synchronize()
            want = host_in * _SCALE + _OFFSET
            bad = np.count_nonzero(host_out != want)
            if bad:
                return False, f"replay {i}: {bad} of {_N} values wrong (first: got {host_out[host_out != want][0]})"
        return True, f"{replays} replays of one captured graph each read their new host input"
    except Exception as exc:  # noqa: BLE001 (the self-check reports any failure as a FAIL line)
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return False, f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})"
    finally:
        for obj in (graph, stream):
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # noqa: BLE001 (teardown after a reported failure)
                    pass
