"""A bare depth-2 loop over vt's ring slots (launch step N, wait for step N-1) with X µs of host
busy-work per step, placed after the wait (where ring's plan and refresh sit) or before it
(where prepare-ahead puts them). It showed on the H200 that a step takes max(d, X + ~9 µs)
wherever the work sits (docs/design.md, docs/benchmarks.md run 20).

    python3 tools/depth2_probe.py [--backend cuda|sim] [--steps 2000]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vt.cli.bench.run import make_engine            # noqa: E402
from vt.cli.bench.synthetic import SyntheticModel   # noqa: E402
from vt.cli.run import pick_backend                # noqa: E402
from vt.backend.waits import DEFAULT_POLL_US, wait_event  # noqa: E402

clock = time.perf_counter


def busy(seconds: float) -> None:
    end = clock() + seconds
    while clock() < end:
        pass


def loop_us(stream, slots, conc: int, steps: int, work_s: float, before: bool) -> float:
    """µs per step of `steps` launches, each followed by the wait for the previous one."""
    prev = None
    stream.synchronize()
    t0 = clock()
    for j in range(steps):
        s = slots[j % len(slots)]
        s.launch(stream, conc)
        if before:
            busy(work_s)
        if prev is not None:
            wait_event(prev.done, DEFAULT_POLL_US * 1e-6)
        if not before:
            busy(work_s)
        prev = s
    stream.synchronize()
    return (clock() - t0) / steps * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda", choices=["cuda", "sim"])
    ap.add_argument("--steps", type=int, default=2000)
    a = ap.parse_args(argv)
    be = pick_backend(a.backend, 0)
    for conc in (1, 32):
        model = SyntheticModel(be, max_seqs=conc, max_context=64)
        eng = make_engine(be, model.model, "ring", conc, profile=False, max_prefill_tokens=conc * 8)
        try:
            eng.generate([[1, 2]] * conc, max_new_tokens=8)   # the slots hold a real step
            slots = eng.runner.driver.rings[conc].slots
            print(f"S={conc} ceiling {eng.device_ceiling_us(conc, replays=2000):.1f} us", flush=True)
            for x_us in (0, 4, 8, 12, 16, 20, 24):
                out = []
                for before in (False, True):
                    ts = [loop_us(eng.runner.stream, slots, conc, a.steps, x_us * 1e-6, before)
                          for _ in range(3)]
                    out.append(f"{'before' if before else 'after'} {min(ts):5.1f}/"
                               f"{statistics.median(ts):5.1f}")
                print(f"  X={x_us:2d}: " + "   ".join(out), flush=True)
        finally:
            eng.close()
            model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
