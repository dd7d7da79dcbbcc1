"""The serve sweep: per preset one model (a bundled preset, or a torch preset of
vt.bench.torch_workload: the vt.torch Llama decoder); per mode one engine (profile=True, so the GPU busy
fraction is measured the same way in every mode), all captured and warmed first, then every
(arrival, load) cell on the same requests, --repeats times, the modes taking turns in an order
that flips each repeat (engines over one model drive it one after the other); a cell reports
its median run, with each latency percentile the median over its runs (median_run). Where the model's
rows are batch-invariant (a bundled model always on the sim, and with VT_BATCH_INVARIANT=1 any
model on any backend) their tokens
must agree (tokens_identical_to_drain). Elsewhere a request's batch depends on when requests
arrive and steps end, which differs from mode to mode, and a row's logits bits depend on its
batch, so the tokens are not compared (None; the modes' tokens are checked by the tests, the
fuzz and the hazard reproducer)."""
from __future__ import annotations

import importlib.util
import platform
import statistics
import time

from vt.bench.serve import LATENCY_KEYS, draw_work, serve_cell, serve_loads

SERVE_DEFAULTS = {   # backend -> (clients, rate, requests per cell, output len, prompt len)
    "cuda": ([16, 32], [40.0], 96, [128, 256], [16, 64]),
    "sim": ([2, 4], [200.0], 8, [3, 8], [2, 6]),
}
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def resolve_serve(args, backend: str, error) -> None:
    """Fill the serve defaults and check them before anything runs."""
    clients, rate, requests, out_len, prompt_len = SERVE_DEFAULTS[backend]
    args.clients = args.clients or clients
    args.rate = args.rate or rate
    args.requests = requests if args.requests is None else args.requests   # 0 is refused below
    args.output_len = args.output_len or out_len
    args.prompt_range = args.prompt_range or prompt_len
    for flag in ("output_len", "prompt_range"):
        v = getattr(args, flag)
        if len(v) == 1:
            v = v * 2
        if len(v) != 2 or not 1 <= v[0] <= v[1]:
            error(f"--{flag.replace('_', '-')} must be N or MIN MAX with 1 <= MIN <= MAX, got {v}")
        setattr(args, flag, tuple(v))
    from vt.bench import limits as lim
    from vt.bench.serve import CELL_TIMEOUT_S
    problems = [lim.list_problem("--clients", args.clients), lim.list_problem("--rate", args.rate),
                lim.int_problem("--requests", args.requests, 1, lim.MAX_REQUESTS)]
    problems += [lim.int_problem("--clients", c, 1, lim.MAX_SERVING_CONC) for c in args.clients]
    problems += [lim.float_problem("--rate", r, lim.MIN_RATE, lim.MAX_RATE) for r in args.rate]
    problems += [lim.int_problem(f"--{flag.replace('_', '-')}", v, 1, lim.MAX_PROMPT_LEN)
                 for flag in ("output_len", "prompt_range") for v in getattr(args, flag)]
    why = next((p for p in problems if p), None)
    if why:
        error(why)
    if "poisson" in args.arrival and args.requests / min(args.rate) > CELL_TIMEOUT_S / 2:
        error(f"--requests {args.requests} at --rate {min(args.rate):g} arrive over "
              f"{args.requests / min(args.rate):g} s, more than half a cell's {CELL_TIMEOUT_S:g} s "
              f"deadline; raise the rate or lower the requests")
    if args.png and importlib.util.find_spec("matplotlib") is None:
        error("--png needs matplotlib, which is not installed (pip install matplotlib)")


def _serve_model(be, name: str, conc: int, context: int, seed: int, prompt_kernels: str):
    """(preset, vocab, step model, close(), whether every mode must give the same tokens,
    what its steps with prompt tokens run) for a bundled preset (None: its own prefill) or a
    torch preset (vt.torch.llama with seeded random weights, prefill "flat", its steps with
    prompt tokens on `prompt_kernels`, "auto" resolved). A torch model's rows are
    batch-invariant only with VT_BATCH_INVARIANT=1 (else its GEMMs' sums depend on the rows
    beside them), and only then are its tokens compared across modes."""
    from vt.bench import torch_workload
    if name in torch_workload.PRESETS:
        cfg = torch_workload.model_config(name)
        module, model = torch_workload.build(be, conc, context, seed, cfg=cfg,
                                             prompt_kernels=prompt_kernels)
        # Nothing to close: its tensors go when the last reference does (run_serve drops them).
        return (name, cfg.vocab, model, lambda: None, module.batch_invariant,
                module.prompt_kernels)
    from vt.bench.setup import build_model, resolve_preset
    preset, cfg = resolve_preset(be, name, context, "vt bench")
    model = build_model(be, cfg, max_seqs=conc, context=context, seed=seed)
    return (preset, cfg.vocab, model, model.close, be.name == "sim" or model.batch_invariant,
            None)


def run_serve(args, progress_factory) -> dict:
    from vt.bench.setup import pick_backend
    from vt.engine.engine import Engine
    from vt.config import ExecutorConfig
    t0, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S")
    be = pick_backend(args.backend, args.sim_delay_ms)
    loads = serve_loads(args)
    conc = max(args.clients)
    context = args.prompt_range[1] + args.output_len[1]
    cells, invariant, prompt_kernels = [], [], {}
    steps = len(args.preset) * len(args.modes) * (1 + len(loads) * args.repeats)
    try:
        with progress_factory(steps) as progress:
            for name in args.preset:
                preset, vocab, model, close_model, same_tokens, kernels = _serve_model(
                    be, name, conc, context, args.seed, args.prompt_kernels)
                prompt_kernels[preset] = kernels
                invariant.append(same_tokens)
                work, warm = draw_work(args.seed, loads, args.requests, vocab,
                                       args.prompt_range, args.output_len, conc)
                engines = {}
                try:
                    for mode in args.modes:
                        config = ExecutorConfig(
                            mode=mode, serving_conc=conc, wait_poll_us=args.wait_poll_us,
                            capture_sizes=tuple(s for s in CAPTURE_SIZES if s <= conc))
                        engines[mode] = Engine(be, model, config, profile=True)
                        serve_cell(engines[mode], warm, "closed", conc, args.seed)
                        progress.step(f"{preset} {mode}: captured and warmed")
                    # Repeats interleave the modes: a host that slows down mid-call slows both
                    # sides of a ratio alike; and their order flips each repeat (drain, ring;
                    # ring, drain; ...), so neither mode always runs right after the other
                    # (after its garbage, its GPU clocks, its thread going idle).
                    runs, order = {}, list(engines.items())
                    for rep in range(args.repeats):
                        for arrival, load in loads:
                            for mode, eng in (order[::-1] if rep % 2 else order):
                                row, tokens = serve_cell(eng, work[arrival, load], arrival, load,
                                                         args.seed)
                                row.update(preset=preset, mode=mode, arrival=arrival, load=load,
                                           via="engine")
                                row["token_ids"] = tokens
                                runs.setdefault((arrival, load, mode), []).append(row)
                                progress.step(_line(row))
                    cells += [median_run(rows) for rows in runs.values()]
                finally:
                    for eng in engines.values():
                        eng.close()
                    close_model()
                    # The next preset's weights need the memory: no engine or name keeps this one.
                    engines.clear()
                    model = close_model = None
        info = be.info()
    finally:
        be.close()
    compare_to_drain(cells, compare_tokens=all(invariant))
    from vt.bench.run import vt_commit
    return dict(format="vt-bench-serve/1", workload="serve", backend=be.name, vt_commit=vt_commit(),
                device=str(info.get("device", "")), host=platform.node(),
                python=platform.python_version(), started=started,
                wall_s=time.perf_counter() - t0, presets=list(args.preset), modes=list(args.modes),
                arrivals=list(args.arrival), clients=list(args.clients), rates=list(args.rate),
                requests=args.requests, output_len=list(args.output_len),
                prompt_len=list(args.prompt_range), seed=args.seed, serving_conc=conc,
                prompt_kernels=prompt_kernels,
                tokens_compared=all(invariant), cells=cells)


# The per-run values paired with drain's run of the same repeat (KEY_to_drain_runs, printed).
PER_RUN = ("output_tok_per_s", "tpot_ms_p50", "ttft_ms_p99")


def median_run(rows: list[dict]) -> dict:
    """The run with the median output tokens/s stands for the cell (its step counts, phases,
    busy fraction). Each latency percentile is instead the median over the runs: one run's
    tail is a handful of requests (the p99 of 384 is the 4th slowest), and the median run by
    tokens/s need not be a typical run by its tail. Every run's tokens/s and latency
    percentiles are kept (KEY_runs, in repeat order)."""
    row = dict(sorted(rows, key=lambda r: r["output_tok_per_s"])[(len(rows) - 1) // 2])
    for k in ("output_tok_per_s", *LATENCY_KEYS):
        runs = [r.get(k) for r in rows]
        row[f"{k}_runs"] = runs
        if k in LATENCY_KEYS and None not in runs:
            row[k] = statistics.median(runs)
    return row


def compare_to_drain(cells: list[dict], compare_tokens: bool) -> None:
    """Per (preset, arrival, load): ratios to drain, and the token check where the model is
    batch-invariant (else None); tokens dropped."""
    for row in cells:
        drain = next((c for c in cells if c["mode"] == "drain" and
                      (c["preset"], c["arrival"], c["load"], c.get("via")) ==
                      (row["preset"], row["arrival"], row["load"], row.get("via"))), None)
        row["tokens_identical_to_drain"] = (None if drain is None or not compare_tokens else
                                            row["token_ids"] == drain["token_ids"])
        for k in PER_RUN:
            row[f"{k}_to_drain"] = (row[k] / drain[k] if drain is not None and drain[k] and
                                    row[k] is not None else None)
        # Paired by repeat: run i of this mode against run i of drain, served side by side.
        for k in PER_RUN:
            row[f"{k}_to_drain_runs"] = (
                None if drain is None else
                [a / b if a is not None and b else None
                 for a, b in zip(row[f"{k}_runs"], drain[f"{k}_runs"])])
    for row in cells:
        row.pop("token_ids")


def _line(r: dict) -> str:
    return (f"{r['preset']} {r['mode']:<7} {r['arrival']} {r['load']:g}: "
            f"{r['output_tok_per_s']:8.1f} tok/s, TPOT p50 {r['tpot_ms_p50'] or 0:.2f} ms")
