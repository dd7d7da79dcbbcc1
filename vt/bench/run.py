"""The sweep: every cell of one `vt bench` run, measured in one process on one backend.

Each cell serves `conc` requests whose prompts all prefill in the first step, then decode
`steps` steps of exactly `conc` rows: the decode phase is `steps` graph steps at one padded
size, the prefill is one step, reported apart. Every vt cell's engine runs twice per repeat:
without profiling (steps/s: nothing added to the loop) and with it (Engine.set_profile: host
split, device time, GPU idle). Cells are interleaved (per conc and D, every mode in turn)
so that drift hits all modes alike; compare ratios, not absolute times across runs.

Synthetic: per conc one SyntheticModel, the engines of every mode captured once; D is a
device scalar, so the same graphs serve the whole D sweep. The torch peer (if it runs
here) does the same steps on the same prompts between them.
Model: per preset one model (seeded random weights); per conc, each mode's engines are made,
run and closed in turn.
"""
from __future__ import annotations

import math
import platform
import time

import numpy as np

from vt.bench import cells, torch_peer
from vt.bench.measure import done_line, make_engine, median_run, mode_cell, profiled, vt_cell
from vt.bench.synthetic import SyntheticModel, expected_tokens


def plan_total(args, torch_ok: bool) -> int:
    """Progress units: set-up, each engine (capture: one per mode, profiled or not), each cell."""
    if args.workload == "synthetic":
        peer = len(torch_peer.VARIANTS) if torch_ok else 0
        return 1 + len(args.conc) * (len(args.modes) + (1 if torch_ok else 0)
                                     + len(args.spin_us) * (len(args.modes) + peer))
    if args.workload == "torch":
        peer = len(torch_peer.VARIANTS) if torch_ok else 0
        return 2 + len(args.conc) * (len(args.modes) * 2 + peer)
    return 1 + len(args.preset) * (1 + len(args.conc) * len(args.modes) * 2)


def torch_absent_reason(be, args) -> str | None:
    """None when the torch peer runs in this bench, else why not."""
    if args.workload == "torch":
        from vt.bench.torch_workload import unavailable_reason
        return "--no-torch" if args.no_torch else unavailable_reason(be)
    if args.workload != "synthetic":
        return "the torch peer exists for the synthetic workload only"
    if args.no_torch:
        return "--no-torch"
    if be.name != "cuda":
        return f"the {be.name} backend: the peer needs a CUDA device"
    return torch_peer.unavailable_reason()


def run_synthetic(be, args, progress, reason: str | None) -> list[dict]:
    rows = []
    ctx = args.prompt_len + args.steps + 2
    for conc in args.conc:
        rng = np.random.default_rng(args.seed + conc)
        vocab = args.vocab[0]
        prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(conc)]
        expect = [expected_tokens(p, args.steps + 1, vocab) for p in prompts]
        model = SyntheticModel(be, max_seqs=conc, max_context=ctx, vocab=vocab)
        engines, peer = {}, None
        try:
            for mode in args.modes:
                engines[mode] = make_engine(be, model.model, mode, conc, profile=False,
                                            max_prefill_tokens=conc * args.prompt_len,
                                            wait_poll_us=args.wait_poll_us)
                progress.step(f"captured {mode} S={conc}")
            if reason is None:
                try:
                    peer = torch_peer.TorchPeer(conc, vocab)
                except Exception as exc:   # keep the vt cells; the peer's rows say why
                    reason = f"the torch peer failed to set up: {type(exc).__name__}: {exc}"
                    progress.log(f"vt bench: {reason}")
                progress.step(f"captured torch S={conc}" if peer else "torch peer absent")
            for d in args.spin_us:
                model.set_device_us(d)
                ident = dict(workload="synthetic", conc=conc, spin_us=d)
                for mode in args.modes:
                    rows.append(vt_cell(engines[mode], mode, ident, prompts, args.steps + 1, conc,
                                        args.ceiling_replays, expect, args.repeats,
                                        profiled(args)))
                    progress.step(done_line(rows[-1]))
                if peer is not None:
                    peer.set_device_us(d)
                    ceiling = peer.ceiling_us(args.ceiling_replays)
                    for variant in torch_peer.VARIANTS:
                        runs = [peer.run(variant, prompts, args.steps) for _ in range(args.repeats)]
                        res, times = median_run(runs, lambda r: r["wall_s"] / args.steps)
                        rows.append(cells.torch_row(dict(ident, mode=variant), res, conc=conc,
                                                    steps=args.steps, ceiling_us=ceiling,
                                                    tokens_ok=all(r["tokens"] == expect for r in runs)))
                        rows[-1]["step_us_runs"] = times
                        progress.step(done_line(rows[-1]))
                else:
                    rows += [cells.absent_row(reason, impl="torch", mode=v, **ident)
                             for v in torch_peer.VARIANTS]
        finally:
            for eng in engines.values():
                eng.close()
            if peer is not None:
                peer.close()
            model.close()
    return rows


def run_model(be, args, progress, reason: str | None = None) -> list[dict]:
    from vt.bench.setup import build_model, random_prompts, resolve_preset
    rows = []
    ctx = args.prompt_len + args.steps + 1
    for name in args.preset:
        preset, cfg = resolve_preset(be, name, ctx, "vt bench")
        t0 = time.perf_counter()
        model = build_model(be, cfg, max_seqs=max(args.conc), context=ctx, seed=args.seed)
        progress.step(f"{preset}: model set up in {time.perf_counter() - t0:.1f} s")
        try:
            for conc in args.conc:
                rng = np.random.default_rng(args.seed + conc)
                prompts = random_prompts(rng, cfg.vocab, conc, args.prompt_len)
                ident = dict(workload="model", preset=preset, conc=conc)
                for mode in args.modes:
                    rows.append(mode_cell(be, model, mode, conc, ident, prompts, args, progress,
                                          f"{preset} "))
        finally:
            model.close()
    return rows


def run(args, progress_factory) -> dict:
    """The whole bench: returns the result dict (report.py prints and writes it)."""
    from vt.bench.setup import pick_backend
    t0, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S")
    be = pick_backend(args.backend, args.sim_delay_ms)
    try:
        reason = torch_absent_reason(be, args)
        with progress_factory(plan_total(args, reason is None)) as progress:
            progress.step(f"backend {be.name} {be.info().get('device', '')}".strip())
            warm_up_device(be, args.warmup_s)
            prompt_kernels = None
            if args.workload == "torch":
                from vt.bench.torch_workload import run_torch
                prompt_kernels = {}
                rows = run_torch(be, args, progress, reason, prompt_kernels)
            else:
                work = run_synthetic if args.workload == "synthetic" else run_model
                rows = work(be, args, progress, reason)
        info = be.info()
    finally:
        be.close()
    cells.add_comparisons(rows)
    peer_rows = [r for r in rows if r["impl"] == "torch"]
    if reason is None:   # the peer may have failed to set up here (its rows say why)
        reason = next((r["absent_reason"] for r in peer_rows if r["status"] != "ok"), None)
    return dict(
        format="vt-bench/1", workload=args.workload, backend=be.name,
        device=str(info.get("device", "")), host=platform.node(), python=platform.python_version(),
        vt_commit=vt_commit(), started=started,
        wall_s=time.perf_counter() - t0,
        spin_us=list(args.spin_us) if args.workload == "synthetic" else None,
        vocab=args.vocab[0] if args.workload == "synthetic" else None,
        presets=list(args.preset) if args.workload != "synthetic" else None,
        prompt_kernels=prompt_kernels,
        concs=list(args.conc), modes=list(args.modes), steps=args.steps, repeats=args.repeats,
        prompt_len=args.prompt_len, seed=args.seed, ceiling_replays=args.ceiling_replays,
        warmup_s=args.warmup_s,
        wait_poll_us=args.wait_poll_us,
        profile=args.profile,
        torch=dict(available=reason is None, version=torch_peer.torch_version(), absent_reason=reason),
        columns=list(cells.COLUMNS), cells=rows)


def warm_up_device(be, seconds: float) -> None:
    """Keep the device busy for `seconds` before anything is timed: the first cells of a cold
    call otherwise run at idle clocks (an H200 measured a 30 µs ceiling for a 15 µs step)."""
    if seconds > 0:
        stream = be.stream(name="vt-bench-warmup")
        try:
            kernels = math.ceil(seconds / 0.05)   # kernels of at most 50 ms, not one long one
            for _ in range(kernels):
                be.busy_wait(stream, seconds / kernels)
            stream.synchronize()
        finally:
            stream.close()


def vt_commit() -> str | None:
    """VT_COMMIT when set (a copied tree's .git can lag its files), else git's HEAD."""
    import subprocess
    from pathlib import Path

    from vt import env
    if env.get("VT_COMMIT"):
        return env.get("VT_COMMIT")
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except Exception:
        return None
