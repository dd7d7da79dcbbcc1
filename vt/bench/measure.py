"""How one vt cell is measured, for every workload: engines per mode (a throughput one and a
profiled runs of the same engine), the median of --repeats timed runs, and the cell's row."""
from __future__ import annotations

from vt.bench import cells


def make_engine(be, model, mode: str, conc: int, *, profile: bool, max_prefill_tokens: int,
                wait_poll_us: float | None = None):
    """An engine of `mode` serving `conc` rows, one captured size (conc): the only one a
    decode step of this bench ever uses."""
    from vt.engine.engine import Engine
    from vt.config import ExecutorConfig
    config = ExecutorConfig(mode=mode, serving_conc=conc, capture_sizes=(conc,),
                                     wait_poll_us=wait_poll_us)
    return Engine(be, model, config, profile=profile, max_prefill_tokens=max_prefill_tokens)


def run_vt(engine, prompts, new_tokens: int) -> tuple[dict, list]:
    """One generate(); (the stats delta it made, its tokens per request)."""
    before = engine.stats()
    results = engine.generate(prompts, max_new_tokens=new_tokens)
    delta = cells.stats_delta(before, engine.stats())
    short = [r.index for r in results if len(r.tokens) != new_tokens]
    if short:
        raise RuntimeError(f"requests {short[:8]} ended before {new_tokens} tokens")
    return delta, [list(map(int, r.tokens)) for r in results]


def median_run(runs: list, step_s) -> tuple[object, list[float]]:
    """The run with the median step time (the lower middle of an even count) and every run's
    step time in µs, in run order. One run's time can be off by 1.5x on a busy host; the median
    of a few keeps the cell's columns from one consistent run."""
    times = [1e6 * step_s(r) for r in runs]
    order = sorted(range(len(runs)), key=times.__getitem__)
    return runs[order[(len(runs) - 1) // 2]], times


def _decode_step_s(delta: dict) -> float:
    dec = cells.phases(delta)[0]
    return dec["wall_s"] / max(dec["steps"], 1)


def vt_cell(eng, mode, ident, prompts, new_tokens, conc, replays, expect=None,
            repeats: int = 1, profiled: bool = False) -> dict:
    # With `profiled`, unprofiled and profiled runs alternate on the one engine
    # (Engine.set_profile), in pairs whose order flips each repeat (fast-profiled,
    # profiled-fast, ...), and each side keeps its median run for its columns. The profile's
    # cost is measured per pair (paired_host_ratio): the host drifts between runs by as much
    # as that cost, and two adjacent runs share most of the drift.
    runs, prof_runs = [], []
    for i in range(repeats):
        if profiled and i % 2:
            prof_runs.append(_profiled_run(eng, prompts, new_tokens))
        runs.append(run_vt(eng, prompts, new_tokens))
        if profiled and not i % 2:
            prof_runs.append(_profiled_run(eng, prompts, new_tokens))
    (d_fast, tokens), times = median_run(runs, lambda r: _decode_step_s(r[0]))
    d_prof = median_run(prof_runs, lambda r: _decode_step_s(r[0]))[0][0] if prof_runs else None
    ceiling = eng.device_ceiling_us(conc, replays=replays)
    if any(t != tokens for _, t in runs + prof_runs):
        raise RuntimeError(f"{mode} {ident}: the repeated runs of one cell (profiled or not) "
                           f"sampled different tokens")
    ok = None if expect is None else tokens == expect
    row = cells.vt_row(dict(ident, mode=mode), d_fast, d_prof, conc=conc, ceiling_us=ceiling,
                       tokens=tokens, tokens_ok=ok)
    row["step_us_runs"] = times
    if prof_runs:
        pairs = [_host_us(p[0]) / max(_host_us(f[0]), 1e-9) for f, p in zip(runs, prof_runs)]
        row["profiled_host_ratio_pairs"] = pairs
        row["profiled_host_ratio"] = sorted(pairs)[(len(pairs) - 1) // 2]
    return row


def _profiled_run(eng, prompts, new_tokens: int) -> tuple[dict, list]:
    eng.set_profile(True)
    try:
        return run_vt(eng, prompts, new_tokens)
    finally:
        eng.set_profile(False)


def _host_us(delta: dict) -> float:
    """Host time per decode step of a run: its wall time less its waits on the device."""
    dec = cells.phases(delta)[0]
    return 1e6 * (dec["wall_s"] - dec["wait_s"]) / max(dec["steps"], 1)


def profiled(args) -> bool:
    """Whether each vt cell also runs profiled (--profile both)."""
    return args.profile == "both"


def done_line(row: dict) -> str:
    where = f"D={row['spin_us']:g}us" if row["spin_us"] is not None else row["preset"]
    return (f"{row['mode']:<16} S={row['conc']:<3} {where:<11} {row['steps_per_s']:9.1f} steps/s "
            f"{row['step_us']:8.1f} us/step")


def mode_cell(be, model, mode: str, conc: int, ident: dict, prompts, args, progress,
              label: str) -> dict:
    """One vt cell of a model workload: the mode's engine, the cell's median run (profiled
    runs too with --profile both), the engine closed again (the next mode captures its own)."""
    eng = make_engine(be, model, mode, conc, profile=False,
                      max_prefill_tokens=conc * args.prompt_len, wait_poll_us=args.wait_poll_us)
    try:
        progress.step(f"captured {label}{mode} S={conc}")
        row = vt_cell(eng, mode, ident, prompts, args.steps + 1, conc, args.ceiling_replays,
                      repeats=args.repeats, profiled=profiled(args))
        progress.step(done_line(row))
        return row
    finally:
        eng.close()
