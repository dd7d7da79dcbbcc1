"""vt's own host cost per decode step, with a backend whose device calls cost nothing.

    python3 tools/host_profile.py [--steps 400] [--profile]

The sim backend with every stream, event, copy, launch and capture replaced by no-ops: what
remains is the engine, the runner, the batch and the slot code, i.e. the Python a decode step
costs before CUDA's own calls (cudaGraphLaunch, event record/query: docs/benchmarks.md gives
their measured cost on the H200). --profile prints cProfile's top functions for ring at S=32.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vt.backend.sim import SimBackend      # noqa: E402
from vt.engine.engine import Engine               # noqa: E402
from vt.knobs import ExecutorConfig        # noqa: E402
from vt.forward.user import KVGeometry        # noqa: E402
from vt.forward.toy import ToyForward              # noqa: E402


class _Null:
    """A stream, event or graph whose every call returns at once (events are complete)."""
    name = "null"
    closed = False

    def record(self, stream=None, external=False):
        pass

    def query(self):
        return True

    def elapsed_ms(self, start):
        return 0.0

    def synchronize(self):
        pass

    def launch(self, stream):
        pass

    def upload(self, stream):
        pass

    def close(self):
        pass


class _Capture:
    graph = _Null()


class NullBackend(SimBackend):
    name = "null"

    def stream(self, name=""):
        return _Null()

    def event(self, blocking_sync=True, timing_enabled=False, name=""):
        return _Null()

    def empty(self, shape, dtype, retained: bool = False):
        # Zeroed (and pinned_empty's too): no kernel or copy ever writes these arrays here, and
        # a garbage sampled token (a negative one is an error row) would end its request.
        a = super().empty(shape, dtype, retained)
        a[...] = 0
        return a

    def pinned_empty(self, shape, dtype):
        a = super().pinned_empty(shape, dtype)
        a[...] = 0
        return a

    def copy_h2d(self, dst, src, stream):
        pass

    copy_d2h = copy_d2d = copy_h2d_mapped = copy_d2h_mapped = copy_h2d

    def launch(self, stream, kernel, *args, **params):
        pass

    def busy_wait(self, stream, seconds):
        pass

    @contextlib.contextmanager
    def capture(self, stream, name=""):
        with self.pool.capturing(name):
            yield _Capture()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--engine-profile", action="store_true",
                    help="also time each cell on an Engine(profile=True): the profile's own host cost")
    args = ap.parse_args(argv)
    be = NullBackend()
    geo = KVGeometry(max_seqs=64, num_kv_blocks=64 * 40, block_size=16, max_context=args.steps + 8)
    toy = ToyForward(be, vocab=256, geometry=geo)
    for S in (1, 32):
        for mode in ("drain", "ring"):
            config = ExecutorConfig.for_mode(mode, serving_conc=S, capture_sizes=(1, 32))
            with Engine(be, toy.step_model(), config) as eng:
                eng.generate([[1, 2]] * S, max_new_tokens=20)
                best = min(_timed(eng, S, args.steps) for _ in range(5))
                print(f"S={S:2d} {mode:5s}: {1e6 * best / args.steps:5.1f} us of vt host code per "
                      f"decode step (best of 5 runs of {args.steps} steps)")
            if args.engine_profile:
                with Engine(be, toy.step_model(), config, profile=True) as eng:
                    eng.generate([[1, 2]] * S, max_new_tokens=20)
                    best = min(_timed(eng, S, args.steps) for _ in range(5))
                print(f"S={S:2d} {mode:5s}: {1e6 * best / args.steps:5.1f} us with profile=True")
                if args.profile and S == 32 and mode == "ring":
                    pr = cProfile.Profile()
                    pr.enable()
                    eng.generate([[1, 2]] * S, max_new_tokens=args.steps)
                    pr.disable()
                    pstats.Stats(pr).sort_stats("tottime").print_stats(15)
    be.close()
    return 0


def _timed(eng, S: int, steps: int) -> float:
    t0 = time.perf_counter()
    eng.generate([[1, 2]] * S, max_new_tokens=steps)
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
