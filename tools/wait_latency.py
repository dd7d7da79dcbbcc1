"""Wake-up latency of a blocking-sync event wait against a query-poll, at D µs of device work.

    python3 tools/wait_latency.py [--backend cuda] [--device-us 0 25 50 100 200 400] [--iters 300]

Per iteration: queue D µs of device work (be.busy_wait), record a blocking-sync event, wait
for it with the policy under test. Reported per policy and D: host µs per iteration (launch to
return), minus the device span of the same work (timing events): the latency the wait adds;
and the CPU µs the host burned per iteration (process time). Policies: block (synchronize at
once), poll (query until done), and poll for P µs then block (vt.backend.waits.wait_event).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vt.backend import get_backend   # noqa: E402
from vt.backend.waits import wait_event      # noqa: E402

POLICIES = {"block": 0.0, "poll 20us": 20e-6, "poll 50us": 50e-6, "poll 200us": 200e-6,
            "poll forever": 1.0}


def measure(be, stream, d_us: float, poll_s: float, iters: int) -> tuple[float, float, float]:
    done = be.event(blocking_sync=True)
    t_start, t_end = (be.event(blocking_sync=True, timing_enabled=True) for _ in range(2))
    wall = cpu = dev = 0.0
    for i in range(iters + 10):
        w0, c0 = time.perf_counter(), time.process_time()
        t_start.record(stream)
        if d_us:
            be.busy_wait(stream, d_us * 1e-6)
        t_end.record(stream)
        done.record(stream)
        wait_event(done, poll_s)
        w1, c1 = time.perf_counter(), time.process_time()
        if i >= 10:
            wall += w1 - w0
            cpu += c1 - c0
            dev += t_end.elapsed_ms(t_start) * 1e-3
    for ev in (done, t_start, t_end):
        ev.close()
    return wall / iters * 1e6, (wall - dev) / iters * 1e6, cpu / iters * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    ap.add_argument("--device-us", type=float, nargs="+", default=[0, 25, 50, 100, 200, 400])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    be = get_backend(args.backend)
    stream = be.stream(name="wait-latency")
    rows = []
    print(f"{'D us':>6} {'policy':>13} {'wall us/it':>11} {'added us':>9} {'cpu us/it':>10}")
    for d in args.device_us:
        for name, poll_s in POLICIES.items():
            wall, added, cpu = measure(be, stream, d, poll_s, args.iters)
            rows.append(dict(device_us=d, policy=name, wall_us=wall, added_us=added, cpu_us=cpu))
            print(f"{d:6.0f} {name:>13} {wall:11.1f} {added:9.1f} {cpu:10.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    stream.close()
    be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
