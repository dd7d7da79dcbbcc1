"""A/B of the executor modes across concurrency, in one run (DESIGN.md "Performance protocol").

    python3 tools/bench.py [--backend auto|cuda|sim] [--preset P] [--conc 1 4 16 32 64]
        [--modes drain ring ring_inputs_read staged no_dbuf] [--new-tokens N] [--prompt-len L]
        [--json F] [--png F]

One model (weights initialised once) serves every run: Engines run on it one after another
(each prefill resets its rows' GDN state and rewrites their KV, so a run never sees the
previous one's state; drain on a shared model is byte-identical to drain on a fresh one).
Runs are interleaved (for each conc, every mode) so drift hits all modes alike; compare
the ratios, never absolute times across runs. Each run: 2 x conc requests of random prompts
(the same prompts for every mode of a conc), greedy, `--new-tokens` each.

Per (mode, conc), from engine.stats():
- tokens/s: tokens / wall time of generate();
- host ms/step: refresh + launch + drain, ring and token waits (the runner's perf_counter spans);
- device ms/step: the runner's timing events around each step (graph or eager forward,
  sample, token copy);
- GPU idle ms/step: (wall - sum of device spans) / steps. The stream runs only inside the
  spans, so the rest of generate()'s wall time is device idle: between replays, plus the
  first launch's latency and the last collect's tail (one of each per run).
Per conc, the device-bound ceiling: the padded size's captured graph + the model's sample,
replayed back to back with no host work (vt.model.bench_step's event timer), measured on
the first graph-mode run of that conc (drain if it is in --modes), as conc tokens per step.

Out of scope: the PyTorch `torch.cuda.CUDAGraph` peer of the protocol (not built here).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout

from vt.engine import Engine                         # noqa: E402
from vt.knobs import DEFAULT_CAPTURE_SIZES, ExecutorConfig   # noqa: E402
from vt.demo import build_model, pick_backend, random_prompts, resolve_preset   # noqa: E402
from vt.model import PRESETS                          # noqa: E402
from vt.model.bench_step import timed_ms              # noqa: E402

MODES = {
    "drain": dict(async_executor=False),
    "ring": dict(async_executor=True),
    "ring_inputs_read": dict(async_executor=True, inputs_read_event=True),
    "staged": dict(async_executor=True, h2d="staged"),
    "no_dbuf": dict(no_dbuf=True),
}


def _log(msg: str) -> None:
    print(msg, flush=True)


def capture_sizes_for(conc: int) -> tuple[int, ...]:
    """The default sizes up to conc's padded size: every size a run of conc can hit, and no
    capture it never replays (25 Engines each capturing 9 sizes would dominate the bench)."""
    top = next((s for s in DEFAULT_CAPTURE_SIZES if s >= conc), None)
    return tuple(s for s in DEFAULT_CAPTURE_SIZES if top is not None and s <= top)


def run_cell(be, model, mode: str, conc: int, prompts, new_tokens: int) -> tuple[dict, list]:
    """One generate() of `prompts` in `mode`; its row of the table and its tokens."""
    config = ExecutorConfig(serving_conc=conc, capture_sizes=capture_sizes_for(conc), **MODES[mode])
    with Engine(be, model, config) as eng:
        results = eng.generate(prompts, max_new_tokens=new_tokens)
        st = eng.stats()
        ceiling = measure_ceiling(be, eng, conc) if config.h2d == "graph" else None
    errors = [str(r.error) for r in results if r.error is not None]
    if errors:
        raise RuntimeError(f"{mode} conc={conc}: {len(errors)} requests failed: {errors[0]}")
    tokens = [list(map(int, r.tokens)) for r in results]
    steps = max(st["steps"], 1)
    host_s = st["host_launch_s"] + st["drain_s"] + st["ring_wait_s"] + st["token_wait_s"]
    row = dict(mode=mode, conc=conc, engine_mode=st["mode"], tokens=st["tokens"], steps=st["steps"],
               graph_steps=st["graph_steps"], steps_by_size=st["steps_by_size"],
               wall_s=st["wall_s"], tokens_per_s=st["tokens_per_s"],
               host_ms_per_step=1e3 * host_s / steps,
               host_launch_ms_per_step=1e3 * st["host_launch_s"] / steps,
               drain_ms_per_step=1e3 * st["drain_s"] / steps,
               ring_wait_ms_per_step=1e3 * st["ring_wait_s"] / steps,
               token_wait_ms_per_step=1e3 * st["token_wait_s"] / steps,
               device_ms_per_step=st["device_ms"] / steps,
               gpu_idle_ms_per_step=max(0.0, 1e3 * st["wall_s"] - st["device_ms"]) / steps,
               driver_mallocs_since_warm_up=st["driver_mallocs_since_warm_up"],
               tokens_sha1=hashlib.sha1(json.dumps(tokens).encode()).hexdigest())
    return dict(row, ceiling=ceiling), tokens


def measure_ceiling(be, eng, conc: int, iters: int = 20, repeats: int = 5) -> dict | None:
    """Back-to-back replays of conc's padded graph + sample on the engine's stream, no host
    work between them. The graph re-reads the slot's last host vectors: rows of finished
    requests, which the next run's prefill overwrites."""
    driver, stream = eng.runner.driver, eng.runner.stream
    size = driver.padded_size(conc)
    if size is None:
        return None
    slot = driver.rings[size].peek()
    toks = be.empty((size,), np.int32)

    def step():
        slot.output.launch(stream)
        eng.model.sample(stream, slot.output.logits, slot.device, toks, None)
    step_ms = timed_ms(be, stream, step, iters, repeats)
    return dict(conc=conc, size=size, step_ms=step_ms, tokens_per_s=conc / (step_ms * 1e-3),
                iters=iters, repeats=repeats)


def run(args) -> dict:
    be = pick_backend(args.backend, args.sim_delay_ms)
    context = args.prompt_len + args.new_tokens
    max_conc = max(args.conc)
    cells, ceilings, out_tokens = [], {}, {}
    try:
        preset, cfg = resolve_preset(be, args.preset, context, "bench")
        t0 = time.perf_counter()
        model = build_model(be, cfg, max_seqs=max_conc, context=context, seed=args.seed)
        info = be.info()
        _log(f"bench: backend={be.name} device={info.get('device', '')!r} preset={preset} "
             f"prompt_len={args.prompt_len} new_tokens={args.new_tokens}; one shared model, "
             f"set up in {time.perf_counter() - t0:.1f} s")
        total, i = len(args.conc) * len(args.modes), 0
        try:
            for conc in args.conc:
                rng = np.random.default_rng(args.seed + conc)
                prompts = random_prompts(rng, cfg.vocab, 2 * conc, args.prompt_len)
                for mode in args.modes:
                    i += 1
                    _log(f"[{i}/{total}] conc={conc} mode={mode}: {len(prompts)} requests ...")
                    row, tokens = run_cell(be, model, mode, conc, prompts, args.new_tokens)
                    ceiling = row.pop("ceiling")
                    if ceiling is not None and conc not in ceilings:
                        ceilings[conc] = dict(ceiling, measured_in=mode)
                    out_tokens[mode, conc] = tokens
                    cells.append(row)
                    _log(f"    {row['tokens_per_s']:10.1f} tok/s  host {row['host_ms_per_step']:.3f} ms/step  "
                         f"device {row['device_ms_per_step']:.3f}  idle {row['gpu_idle_ms_per_step']:.3f}  "
                         f"({row['steps']} steps, {row['graph_steps']} graph)")
        finally:
            model.close()
        info = be.info()
    finally:
        be.close()
    base = "drain" if "drain" in args.modes else args.modes[0]
    by = {(c["mode"], c["conc"]): c for c in cells}
    for c in cells:
        ref = by[base, c["conc"]]
        c["ratio_to_" + base] = c["tokens_per_s"] / ref["tokens_per_s"]
        c["identical_to_" + base] = out_tokens[c["mode"], c["conc"]] == out_tokens[base, c["conc"]]
        ceil = ceilings.get(c["conc"])
        c["fraction_of_ceiling"] = c["tokens_per_s"] / ceil["tokens_per_s"] if ceil else None
    return dict(backend=be.name, device=info.get("device", ""), preset=preset,
                prompt_len=args.prompt_len, new_tokens=args.new_tokens, seed=args.seed,
                requests_per_run="2 x conc", model_shared=True, baseline=base,
                modes=list(args.modes), concs=list(args.conc), cells=cells,
                ceilings=[ceilings[c] for c in args.conc if c in ceilings])


def table(res: dict) -> str:
    """Modes as columns, conc as rows: tokens/s (ratio to the baseline), then the ceiling."""
    base, modes = res["baseline"], res["modes"]
    by = {(c["mode"], c["conc"]): c for c in res["cells"]}
    ceil = {c["conc"]: c for c in res["ceilings"]}
    w = max(18, *(len(m) + 2 for m in modes))
    lines = [f"tokens/s (x {base}); * = tokens differ from {base}",
             f"{'conc':>5} " + "".join(f"{m:>{w}}" for m in modes) + f"{'ceiling':>{w}}"]
    for conc in res["concs"]:
        cols = []
        for m in modes:
            c = by[m, conc]
            mark = "" if c["identical_to_" + base] else "*"
            cols.append(f"{c['tokens_per_s']:.0f} (x{c['ratio_to_' + base]:.2f}){mark}".rjust(w))
        ce = ceil.get(conc)
        cols.append((f"{ce['tokens_per_s']:.0f} S={ce['size']}" if ce else "-").rjust(w))
        lines.append(f"{conc:>5} " + "".join(cols))
    lines.append("")
    lines.append(f"host / device / GPU idle, ms per step")
    lines.append(f"{'conc':>5} " + "".join(f"{m:>{w}}" for m in modes))
    for conc in res["concs"]:
        lines.append(f"{conc:>5} " + "".join(
            f"{by[m, conc]['host_ms_per_step']:.2f}/{by[m, conc]['device_ms_per_step']:.2f}/"
            f"{by[m, conc]['gpu_idle_ms_per_step']:.2f}".rjust(w) for m in modes))
    return "\n".join(lines)


def write_png(res: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log(f"bench: matplotlib is not installed; skipping the PNG {path}")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in res["modes"]:
        cs = [c for c in res["cells"] if c["mode"] == m]
        ax.plot([c["conc"] for c in cs], [c["tokens_per_s"] for c in cs], marker="o", label=m)
    if res["ceilings"]:
        ax.plot([c["conc"] for c in res["ceilings"]], [c["tokens_per_s"] for c in res["ceilings"]],
                "k--", label="device-bound ceiling")
    ax.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="tokens/s",
           title=f"vt executor modes: {res['preset']} on {res['backend']} {res['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="default: bench-dense on cuda, tiny-dense on sim")
    ap.add_argument("--conc", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sim-delay-ms", type=float, default=0.0,
                    help="sim only: device delay per op, so the host runs ahead")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--png", help="tokens/s vs conc per mode (needs matplotlib)")
    args = ap.parse_args(argv)
    if min(args.conc) < 1 or args.new_tokens < 1 or args.prompt_len < 1:
        ap.error("--conc, --new-tokens and --prompt-len must be positive")
    if len(set(args.modes)) != len(args.modes) or len(set(args.conc)) != len(args.conc):
        ap.error("--modes and --conc must not repeat")
    res = run(args)
    _log("")
    _log(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
        _log(f"bench: wrote {args.json}")
    if args.png and write_png(res, args.png):
        _log(f"bench: wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
