"""A model of vt's host/device loop: µs per step of a depth-2 loop, with and without
prepare-ahead, from the host's work per step h, the device's d and the launch latency L.

    python3 tools/pipeline_sim.py [--h 14.8] [--d 14.7] [--latency 4] [--ahead 11.8]

Per step the host launches step N, then (prepare-ahead) spends `ahead` µs of its h on step
N+1's plan and refresh, waits for step N-1 to finish, then does the rest of h and launches
N+1. The device runs a step d µs, starting L µs after its launch or when the previous step
ends, whichever is later. Without prepare-ahead (ahead = 0) the whole h lies between the
wait and the next launch. docs/design.md and docs/benchmarks.md (run 17) use its numbers.
"""
from __future__ import annotations

import argparse
import sys


def step_us(h: float, d: float, latency: float, ahead: float = 0.0, steps: int = 4000) -> float:
    """Mean µs per step of the loop above in steady state."""
    if not 0 <= ahead <= h:
        raise ValueError(f"ahead must lie in [0, h={h}], got {ahead}")
    t = device_free = 0.0
    ends = []
    for i in range(steps):
        start = max(t + latency, device_free)          # launch of step i at time t
        device_free = start + d
        ends.append(device_free)
        t += ahead                                     # step i+1's plan and refresh
        if i >= 1:
            t = max(t, ends[i - 1])                    # wait for step i-1
        t += h - ahead                                 # the rest, then the next launch
    return t / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--h", type=float, default=14.8, help="host µs per step")
    ap.add_argument("--d", type=float, default=14.7, help="device µs per step")
    ap.add_argument("--latency", type=float, default=4.0, help="launch-to-start µs")
    ap.add_argument("--ahead", type=float, default=11.8,
                    help="µs of h done between launching step N and waiting for step N-1")
    a = ap.parse_args(argv)
    base = step_us(a.h, a.d, a.latency)
    ahead = step_us(a.h, a.d, a.latency, a.ahead)
    best = max(a.h, a.d)
    print(f"h={a.h} d={a.d} L={a.latency}: depth 2 {base:.1f} us/step ({best / base:.2f} of "
          f"max(h, d)); prepare-ahead ({a.ahead} us ahead) {ahead:.1f} ({best / ahead:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
