"""`vt bench --workload serve`: the executor modes under serving traffic, through the online
API (Engine.submit), on the bundled model at a preset.

A cell is (preset, arrival, load, mode). Arrivals:
  closed-loop: `clients` concurrent clients, each submitting its next request when its
    previous one finishes (the 16/32 grid of the design);
  open-loop Poisson: requests arrive at `rate` per second (exponential gaps, seeded),
    whatever the engine's progress.
Every mode of a (preset, arrival, load) serves the SAME requests (prompts and lengths drawn
once, seeded: fixed, or uniform in [min, max]), so their tokens must agree (checked).

Clients are one driver thread per cell: a finished request's done callback (on the serving
thread) only puts it on a queue; the driver submits. Every wait of a cell has one deadline
(CELL_TIMEOUT_S): past it the bench fails with a line that says how many requests finished.
Token times are the engine's (when a step's tokens reached the host:
RequestResult.token_times), so no client thread has to wake per token for them. Per cell: TTFT (submit -> first token), TPOT (per request, (last - first)
/ (n - 1)), ITL (every gap between consecutive tokens) at p50/p90/p99; requests/s and output
tokens/s over the cell's wall time; the GPU busy fraction (device time of the steps, from
timing events: the engines run with profile=True, both modes alike); the fraction of steps
that drained and why (the kind of step each drain waited for), and the steps by kind.
"""
from __future__ import annotations

import queue
import time

import numpy as np

PCTS = (50, 90, 99)
LATENCY_METRICS = ("ttft_ms", "tpot_ms", "itl_ms")
LATENCY_KEYS = tuple(f"{m}_p{p}" for m in LATENCY_METRICS for p in PCTS)   # a cell's percentiles


def draw_requests(rng, n: int, vocab: int, prompt_len: tuple[int, int],
                  output_len: tuple[int, int]) -> list[tuple[list[int], int]]:
    """n (prompt, max_new_tokens), lengths uniform in each [min, max] (fixed when equal)."""
    out = []
    for _ in range(n):
        p = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        o = int(rng.integers(output_len[0], output_len[1] + 1))
        out.append((rng.integers(0, vocab, p).tolist(), o))
    return out


def serve_loads(args) -> list[tuple[str, float]]:
    """The (arrival, load) cells of the parsed flags: each --clients count closed-loop, then
    each --rate Poisson, for the arrivals asked for."""
    return ([("closed", c) for c in args.clients if "closed" in args.arrival]
            + [("poisson", r) for r in args.rate if "poisson" in args.arrival])


def draw_work(seed: int, loads, requests: int, vocab: int, prompt_len: tuple[int, int],
              output_len: tuple[int, int], conc: int) -> tuple[dict, list]:
    """({load: its requests}, the warm-up requests) of one model, seeded: the in-process and the
    HTTP bench (vt/bench/serve_http.py) draw the same ones from the same flags."""
    rng = np.random.default_rng(seed)
    work = {load: draw_requests(rng, requests, vocab, prompt_len, output_len) for load in loads}
    return work, draw_requests(rng, conc, vocab, prompt_len, (2, 4))


CELL_TIMEOUT_S = 600.0   # the longest a cell may take; every wait in it has this deadline


def closed_loop(engine, requests, clients: int, timeout_s: float):
    """Serve `requests` with `clients` concurrent clients; (handles in request order, wall)."""
    done_q: queue.Queue = queue.Queue()
    handles = [None] * len(requests)

    def submit(i):
        prompt, new = requests[i]
        handles[i] = engine.submit(prompt, max_new_tokens=new)
        # Runs at once when the request finished before this line: none is missed.
        handles[i].add_done_callback(lambda h, i=i: done_q.put(i))

    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    nxt = min(clients, len(requests))
    for i in range(nxt):
        submit(i)
    for finished in range(len(requests)):
        try:
            done_q.get(timeout=max(deadline - time.perf_counter(), 0.0))
        except queue.Empty:
            raise _late(f"closed loop of {clients} clients", finished, len(requests),
                        timeout_s) from None
        if nxt < len(requests):
            submit(nxt)
            nxt += 1
    return handles, time.perf_counter() - t0


def open_loop(engine, requests, rate: float, rng, timeout_s: float):
    """Submit at Poisson arrivals of `rate` per second; (handles, wall)."""
    gaps = rng.exponential(1.0 / rate, len(requests))
    handles = []
    t0 = time.perf_counter()
    at, deadline = t0, t0 + timeout_s
    for (prompt, new), gap in zip(requests, gaps):
        at += gap
        delay = at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        handles.append(engine.submit(prompt, max_new_tokens=new))
    _wait_all(handles, deadline, f"open loop at {rate:g}/s", timeout_s)
    return handles, time.perf_counter() - t0


def serve_cell(engine, requests, arrival: str, load: float, seed: int,
               timeout_s: float = CELL_TIMEOUT_S) -> tuple[dict, list]:
    """One cell on a warm engine: its metrics and every request's tokens. CommandFailed if
    the cell's requests are not all served within timeout_s."""
    before = engine.stats()
    if arrival == "closed":
        handles, wall = closed_loop(engine, requests, int(load), timeout_s)
    else:
        handles, wall = open_loop(engine, requests, load, np.random.default_rng(seed), timeout_s)
    results = [h.result(timeout=0) for h in handles]   # each has finished: the loops waited
    after = engine.stats()
    return cell_metrics(handles, results, wall, before, after), [r.tokens for r in results]


def _wait_all(handles, deadline: float, what: str, timeout_s: float) -> None:
    for h in handles:
        try:
            h.result(timeout=max(deadline - time.perf_counter(), 0.0))
        except TimeoutError:
            raise _late(what, sum(h.done() for h in handles), len(handles), timeout_s) from None


def _late(what: str, finished: int, total: int, timeout_s: float):
    from vt.bench.errors import CommandFailed
    return CommandFailed(f"vt bench: serve cell ({what}) not served within its {timeout_s:g} s "
                         f"deadline: {finished} of {total} requests finished")


# The engine's counters a cell reports (their change over the cell).
ENGINE_COUNTS = ("steps", "graph_steps", "eager_steps", "mixed_steps", "prefill_steps", "drains",
                 "drain_s", "device_ms", "token_wait_s", "ring_waits", "eager_launch_s")


def cell_metrics(handles, results, wall: float, before: dict, after: dict) -> dict:
    tokens = sum(len(r.tokens) for r in results)
    d = {k: after[k] - before[k] for k in ENGINE_COUNTS}
    drains_after = {k: v - before["drains_after"].get(k, 0) for k, v in after["drains_after"].items()}
    phases = {}
    for name in ("decode", "prefill"):
        a, b = after["phases"][name], before["phases"][name]
        # The host split too (summed over timed_steps; the host time to enqueue every step
        # that prefills is eager_launch_s above, not a sample).
        phases[name] = {k: a[k] - b[k] for k in ("steps", "wall_s", "wait_s", "device_ms",
                                                 "device_steps", "timed_steps", "plan_s",
                                                 "launch_s", "collect_s", "drain_s")}
    # The profile times every step that prefills and a sample of the decode steps
    # (vt/engine/profile.py): each phase's device time is its timed steps' mean times its steps.
    busy_ms = sum(ph["device_ms"] / ph["device_steps"] * ph["steps"]
                  for ph in phases.values() if ph["device_steps"])
    out = dict(requests=len(results), tokens=tokens, wall_s=wall,
               requests_per_s=len(results) / wall, output_tok_per_s=tokens / wall,
               gpu_busy=busy_ms / 1e3 / wall if busy_ms else None,
               drained_fraction=d["drains"] / d["steps"] if d["steps"] else 0.0,
               drains_after=drains_after, phases=phases, **d)
    out.update(latency_metrics([h.submitted_at for h in handles],
                               [r.token_times for r in results]))
    return out


def latency_metrics(sent_at, token_times) -> dict:
    """TTFT, TPOT and ITL percentiles in ms (LATENCY_KEYS) of requests sent at `sent_at`
    whose tokens arrived at `token_times` (one array or list per request, seconds on the same
    clock): the in-process cells' (the engine's token times) and the HTTP cells' (the
    client's arrival times of the streamed tokens) by one formula."""
    ttft, tpot, itl = [], [], []
    for sent, times in zip(sent_at, token_times):
        if times is None or not len(times):
            continue
        ttft.append(times[0] - sent)
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl.extend(np.diff(times).tolist())
    out = {}
    for name, xs in zip(LATENCY_METRICS, (ttft, tpot, itl)):
        for p in PCTS:
            out[f"{name}_p{p}"] = float(np.percentile(xs, p) * 1e3) if xs else None
    return out
