"""One cell of the bench (implementation x mode x conc x D or preset): its columns and how each
is computed from engine.stats() (vt) or the peer's timings (torch).

Every row carries every column (None where a column does not apply or was not measured), so
the JSON always has the same shape; a peer that could not run gets rows with status "absent"
and its reason.
"""
from __future__ import annotations

import hashlib
import json

HOST_PARTS = ("plan", "refresh", "acquire", "launch", "collect")

COLUMNS = (
    # what the cell is
    "workload", "impl", "mode", "conc", "spin_us", "preset", "status", "absent_reason",
    # the decode phase (pure decode steps), throughput from the run without profiling
    "decode_steps", "decode_tokens", "decode_wall_s", "steps_per_s", "tokens_per_s", "step_us",
    # prefill steps (mixed included), reported apart
    "prefill_steps", "prefill_tokens", "prefill_wall_s",
    # host µs per decode step (vt: from the profiled run); machinery = refresh + acquire +
    # launch (the launch includes the done-event record); host_busy from the run without
    # profiling: its wall time minus its waits on the device
    *(f"host_{p}_us" for p in HOST_PARTS), "host_drain_us", "host_other_us", "host_us", "wait_us",
    "host_machinery_us", "host_busy_us",
    # the profile's own cost: the median over repeats of a profiled run's host time per step
    # over the host time of the unprofiled run beside it (vt/bench/measure.py vt_cell)
    "profiled_host_ratio", "profiled_host_ratio_pairs",
    # device µs per decode step, and the GPU's idle time between the steps
    "device_us", "gpu_idle_us",
    # device-bound ceiling: the same graph replayed back to back, no host work
    "ceiling_us", "ceiling_steps_per_s", "fraction_of_ceiling",
    # comparisons within the same (workload, preset, conc, D)
    "ratio_to_drain", "ratio_to_torch_async", "overlap_efficiency", "overlap_efficiency_hd",
    "overlap_h_us", "overlap_d_us",
    # checks
    "tokens_ok", "identical_to_drain", "tokens_sha1", "driver_mallocs_since_warm_up",
    "profiled_steps_per_s",
    # every timed run's µs per step (--repeats); the row's columns are its median run's
    "step_us_runs",
)


def blank_row(**ident) -> dict:
    unknown = set(ident) - set(COLUMNS)
    if unknown:
        raise KeyError(f"not a bench column: {sorted(unknown)}")
    row = dict.fromkeys(COLUMNS)
    row.update(status="ok", **ident)
    return row


def absent_row(reason: str, **ident) -> dict:
    return dict(blank_row(**ident), status="absent", absent_reason=reason)


def tokens_sha1(tokens) -> str:
    return hashlib.sha1(json.dumps(tokens).encode()).hexdigest()


def stats_delta(before: dict, after: dict) -> dict:
    """after - before for every number (recursively); stats accumulate over generate() calls."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, dict) and isinstance(b, dict):
            out[k] = stats_delta(b, v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(b, (int, float)):
            out[k] = v - b
        else:
            out[k] = v
    return out


def phases(delta: dict) -> tuple[dict, dict]:
    """(decode, prefill) phase dicts of a stats delta (engine contract: stats()["phases"])."""
    ph = delta["phases"]
    return ph["decode"], ph["prefill"]


def vt_row(ident: dict, fast: dict, prof: dict | None, *, conc: int, ceiling_us: float | None,
           tokens, tokens_ok: bool | None) -> dict:
    """A vt cell from the stats deltas of its throughput run (`fast`, profile off) and its
    profiled run (`prof`, profile on: host split and device time), and its ceiling."""
    row = blank_row(impl="vt", **ident)
    dec, pre = phases(fast)
    steps = dec["steps"]
    if steps < 1 or dec["wall_s"] <= 0:
        raise RuntimeError(f"{ident}: no decode step was measured ({dec})")
    row.update(decode_steps=steps, decode_wall_s=dec["wall_s"], steps_per_s=steps / dec["wall_s"],
               step_us=1e6 * dec["wall_s"] / steps, decode_tokens=steps * conc,
               tokens_per_s=steps * conc / dec["wall_s"],
               prefill_steps=pre["steps"], prefill_wall_s=pre["wall_s"],
               prefill_tokens=fast["tokens"] - steps * conc,
               tokens_ok=tokens_ok, tokens_sha1=tokens_sha1(tokens),
               driver_mallocs_since_warm_up=fast.get("driver_mallocs_since_warm_up"),
               host_busy_us=1e6 * (dec["wall_s"] - dec["wait_s"]) / steps)
    if prof is not None:
        pdec, _ = phases(prof)
        n = max(pdec["steps"], 1)
        timed = max(pdec["timed_steps"], 1)   # the split is timed on a sample of the steps
        per = {p: 1e6 * pdec[f"{p}_s"] / timed for p in (*HOST_PARTS, "drain")}
        wall_us = 1e6 * pdec["wall_s"] / n
        device_us = 1e3 * pdec["device_ms"] / max(pdec["device_steps"], 1)   # sampled steps
        wait_us = 1e6 * pdec["wait_s"] / n     # blocked on the device: drains and token waits
        row.update({f"host_{p}_us": per[p] for p in HOST_PARTS},
                   host_machinery_us=per["refresh"] + per["acquire"] + per["launch"],
                   host_drain_us=per["drain"],
                   host_other_us=wall_us - sum(per.values()),
                   host_us=wall_us - wait_us,
                   wait_us=wait_us,
                   device_us=device_us, gpu_idle_us=max(0.0, wall_us - device_us),
                   profiled_steps_per_s=pdec["steps"] / pdec["wall_s"] if pdec["wall_s"] else None)
    _ceiling(row, ceiling_us)
    return row


def torch_row(ident: dict, result: dict, *, conc: int, steps: int, ceiling_us: float,
              tokens_ok: bool | None) -> dict:
    """A torch peer cell. Its device time per step is its graph's back-to-back replay time
    (the ceiling): the loop has no timing events of its own, so as not to slow it down."""
    row = blank_row(impl="torch", **ident)
    wall = result["wall_s"]
    host_us = 1e6 * (wall - result["wait_s"]) / steps   # the loop has no other split
    row.update(decode_steps=steps, decode_wall_s=wall, steps_per_s=steps / wall,
               step_us=1e6 * wall / steps, decode_tokens=steps * conc,
               tokens_per_s=steps * conc / wall, prefill_steps=1, prefill_tokens=conc,
               host_us=host_us, host_busy_us=host_us,
               wait_us=1e6 * result["wait_s"] / steps, device_us=ceiling_us,
               gpu_idle_us=max(0.0, 1e6 * wall / steps - ceiling_us),
               tokens_ok=tokens_ok, tokens_sha1=tokens_sha1(result["tokens"]))
    _ceiling(row, ceiling_us)
    return row


def _ceiling(row: dict, ceiling_us: float | None) -> None:
    if ceiling_us:
        row.update(ceiling_us=ceiling_us, ceiling_steps_per_s=1e6 / ceiling_us,
                   fraction_of_ceiling=row["steps_per_s"] * ceiling_us / 1e6)


def add_comparisons(rows: list[dict]) -> None:
    """ratio_to_drain, ratio_to_torch_async, identical_to_drain and the overlap efficiencies
    within each group of rows that share (workload, preset, conc, D).

    The drain run does the host's work (h µs per step) and the device's (d) one after the
    other; perfect overlap would take max(h, d) per step. Two ways to score a mode by it:

    overlap_efficiency = (steps/s / drain's) / (T_drain / max(h, d)) = max(h, d) / T_mode:
      the share of the best possible speed-up over drain that the mode gets. h is drain's
      busy host time per step without profiling (its step time minus its waits), d the
      device's time per step (the ceiling: the graph replayed back to back), T the measured
      step times.
    overlap_efficiency_hd = (steps/s / drain's) / ((h + d) / max(h, d)), h and d from drain's
      profiled run: the formula read literally. It takes drain's step to cost h + d, but a
      graph launch returns before the device finishes, so drain already overlaps part of
      both (e.g. h + d = 65 µs against a 34 µs drain step): where h and d are close the ideal
      it divides by is out of reach of any loop.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["preset"], r["conc"], r["spin_us"]), []).append(r)
    for group in groups.values():
        by = {r["mode"]: r for r in group if r["status"] == "ok"}
        drain, peer = by.get("drain"), by.get("torch_async")
        ideal = literal = h = d = None
        if drain is not None and drain["host_busy_us"] is not None and drain["ceiling_us"]:
            h, d = max(drain["host_busy_us"], 0.0), drain["ceiling_us"]
            ideal = drain["step_us"] / max(h, d)
        if drain is not None and drain["host_us"] is not None and drain["device_us"]:
            hp, dp = max(drain["host_us"], 0.0), drain["device_us"]
            literal = (hp + dp) / max(hp, dp)
        for r in group:
            if r["status"] != "ok":
                continue
            if drain is not None:
                r["ratio_to_drain"] = r["steps_per_s"] / drain["steps_per_s"]
                r["identical_to_drain"] = r["tokens_sha1"] == drain["tokens_sha1"]
                if r["impl"] == "vt":
                    r["overlap_h_us"], r["overlap_d_us"] = h, d
                    if ideal is not None:
                        r["overlap_efficiency"] = r["ratio_to_drain"] / ideal
                    if literal is not None:
                        r["overlap_efficiency_hd"] = r["ratio_to_drain"] / literal
            if peer is not None:
                r["ratio_to_torch_async"] = r["steps_per_s"] / peer["steps_per_s"]
