"""`vt bench`: the executor modes against a hand-written PyTorch CUDA-graph loop and the
device ceiling, at equal device work, in one run (docs/design.md, "Performance protocol")."""
from __future__ import annotations

import argparse
import math
import sys

DEFAULT_SPIN_US = (0, 25, 50, 100, 200, 400, 1000)
# Per backend: decode steps per cell and back-to-back replays per ceiling. The sim runs the
# same sweep with few steps (a CI check of every column in < 60 s, not a measurement).
_STEPS = {"cuda": 300, "sim": 12}
_REPLAYS = {"cuda": 200, "sim": 10}

EXAMPLES = """examples:
  vt bench --backend sim --workload synthetic --json bench.json
  vt bench --workload synthetic --device-us 0 100 400 --conc 32 --json s.json --png s.png
  vt bench --workload model --preset bench-small --conc 1 32 64 --json m.json --png m.png
  vt bench --from-json small.json dense.json moe.json --png presets.png
  vt bench --workload serve --preset bench-small --clients 16 32 --modes drain ring --json s.json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vt.knobs import MODES, SAFE_MODES
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    p.add_argument("--workload", default="synthetic", choices=["synthetic", "model", "serve"],
                   help="synthetic: a user forward spinning D us per step (+ the torch peer); "
                        "model: the bundled model at --preset; serve: the bundled model under "
                        "serving traffic through the online API (vt/cli/bench/serve.py)")
    p.add_argument("--device-us", dest="spin_us", type=float, nargs="+",
                   default=list(DEFAULT_SPIN_US), metavar="D",
                   help="synthetic: device us per step to sweep (default: %(default)s)")
    p.add_argument("--force", action="store_true",
                   help="run bench-* presets on the sim backend anyway (slow, gigabytes)")
    p.add_argument("--preset", nargs="+", default=None,
                   help="model: preset(s) (default: bench-small on cuda, tiny-dense on sim)")
    p.add_argument("--conc", type=int, nargs="+", default=None,
                   help="rows per decode step, S (default: 1 32; model: 1 32 64)")
    p.add_argument("--modes", nargs="+", default=list(SAFE_MODES), choices=list(MODES),
                   help="executor modes (default: %(default)s; no_dbuf only when named)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"decode steps per cell (default: {_STEPS['cuda']} on cuda, "
                        f"{_STEPS['sim']} on sim)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prompt tokens per request (default: 2 synthetic, 16 model)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per cell; the cell is the run with the median step time "
                        "(every run's step time is kept in step_us_runs; default: %(default)s)")
    p.add_argument("--ceiling-replays", type=int, default=None,
                   help=f"back-to-back replays per ceiling (default: {_REPLAYS['cuda']} on cuda, "
                        f"{_REPLAYS['sim']} on sim)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="seconds of device work queued before the first cell, so that it does not "
                        "run at idle clocks (default: 1 on cuda, 0 on sim)")
    p.add_argument("--profile", default="both", choices=["both", "off"],
                   help="both: each vt cell runs again on an engine with profile=True for the host "
                        "split and device time; off: throughput only")
    p.add_argument("--wait-poll-us", type=float, default=None,
                   help="vt's engines poll an event this long before blocking on it (default: "
                        "vt's own, vt/backend/waits.py); e.g. longer than a step keeps the host awake")
    p.add_argument("--no-torch", action="store_true", help="leave the torch peer out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sim-delay-ms", type=float, default=0.0,
                   help="sim only: device delay per op, so the host runs ahead")
    p.add_argument("--no-bar", action="store_true", help="plain progress lines, no tqdm bar")
    p.add_argument("--from-json", nargs="+", metavar="JSON",
                   help="measure nothing: print the tables of saved results (several runs of one "
                        "workload are merged, e.g. one per preset) and write --json/--png from them")
    p.add_argument("--json", help="write the results (every column of every cell) to this path")
    p.add_argument("--png", help="write the plot to this path (needs matplotlib: vt[bench])")
    from vt.cli.bench.serve_run import add_serve_arguments
    add_serve_arguments(p)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `vt bench` on the `vt` CLI's subparsers."""
    p = subparsers.add_parser("bench", help="executor modes vs a torch CUDA-graph loop and the "
                              "device ceiling, in one run", description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def _resolve(args: argparse.Namespace, error) -> None:
    """Fill the backend-dependent defaults and check every value before any work starts."""
    from vt.backend import available_backends
    from vt.model import PRESETS
    backend = args.backend if args.backend != "auto" else (
        "cuda" if "cuda" in available_backends() else "sim")
    model = args.workload in ("model", "serve")
    if args.workload == "serve":
        from vt.cli.bench.serve_run import resolve_serve
        resolve_serve(args, backend, error)
    if args.conc is None:
        args.conc = [1, 32, 64] if model else [1, 32]
    if args.steps is None:
        args.steps = _STEPS[backend]
    if args.prompt_len is None:   # synthetic: a short prefill (it spins D per prompt token)
        args.prompt_len = 16 if model else 2
    if args.ceiling_replays is None:
        args.ceiling_replays = _REPLAYS[backend]
    if args.warmup_s is None:
        args.warmup_s = 1.0 if backend == "cuda" else 0.0
    if args.warmup_s < 0:
        error(f"--warmup-s must be >= 0, got {args.warmup_s}")
    if args.preset is None:
        args.preset = ["bench-small" if backend == "cuda" else "tiny-dense"]
    for flag, vals in (("--conc", args.conc), ("--steps", [args.steps]),
                       ("--prompt-len", [args.prompt_len]),
                       ("--ceiling-replays", [args.ceiling_replays]), ("--repeats", [args.repeats])):
        if min(vals) < 1:
            error(f"{flag} must be positive integers, got {vals}")
    if not all(math.isfinite(d) and d >= 0 for d in args.spin_us):
        error(f"--device-us must be finite numbers >= 0, got {args.spin_us}")
    if not (math.isfinite(args.sim_delay_ms) and args.sim_delay_ms >= 0):
        error(f"--sim-delay-ms must be a finite number >= 0, got {args.sim_delay_ms}")
    if args.seed < 0:
        error(f"--seed must be >= 0, got {args.seed}")
    for flag, vals in (("--modes", args.modes), ("--conc", args.conc),
                       ("--device-us", args.spin_us), ("--preset", args.preset)):
        if len(set(vals)) != len(vals):
            error(f"{flag} must not repeat a value, got {vals}")
    unknown = [p for p in args.preset if p not in PRESETS]
    if model and unknown:
        error(f"unknown preset(s) {unknown}; choose from {', '.join(PRESETS)}")
    # Bench presets are sized for the GPU: on the sim they need gigabytes of host memory and
    # minutes per step, with nothing printed meanwhile (vt run refuses them the same way).
    big = [p for p in args.preset if p.startswith("bench-")]
    if model and backend == "sim" and big and not args.force:
        error(f"preset(s) {big} are GPU benchmark models; on the sim backend they need "
              f"gigabytes of host memory and minutes per step: use tiny-dense or tiny-moe, or "
              f"add --force to run them anyway")


def cmd_bench(args: argparse.Namespace, error=None) -> int:
    from vt.cli.bench import report
    from vt.cli.bench.progress import Progress
    from vt.cli.bench.run import run

    def fail(msg):
        from vt.cli.run import UsageError   # `vt` prints its one line and exits 2
        raise UsageError(f"vt bench: {msg}")
    if args.workload == "serve" and not args.from_json:
        return _cmd_serve(args, error or fail)
    if args.from_json:
        res = report.merge([report.read_json(path) for path in args.from_json])
    else:
        _resolve(args, error or fail)
        res = run(args, lambda total: Progress(total, bar=False if args.no_bar else None))
    print()
    print(report.table(res))
    if args.json:
        report.write_json(res, args.json)
        print(f"vt bench: wrote {args.json}")
    if args.png:
        why = report.write_png(res, args.png)
        print(f"vt bench: {'wrote ' + args.png if why is None else 'no PNG: ' + why}")
    bad = [c for c in res["cells"] if c["status"] == "ok" and c["mode"] != "no_dbuf"
           and (c["tokens_ok"] is False or c["identical_to_drain"] is False)]
    for c in bad:
        print(f"vt bench: WRONG TOKENS in {c['impl']} {c['mode']} S={c['conc']}", file=sys.stderr)
    return 1 if bad else 0


def _cmd_serve(args: argparse.Namespace, error) -> int:
    from vt.cli.bench import serve_report
    from vt.cli.bench.progress import Progress
    from vt.cli.bench.serve_run import run_serve
    _resolve(args, error)
    res = run_serve(args, lambda total: Progress(total, bar=False if args.no_bar else None))
    print()
    print(serve_report.table(res))
    if args.json:
        serve_report.write_json(res, args.json)
        print(f"vt bench: wrote {args.json}")
    if args.png:
        why = serve_report.write_png(res, args.png)
        print(f"vt bench: {'wrote ' + args.png if why is None else 'no PNG: ' + why}")
    bad = [c for c in res["cells"] if c["tokens_identical_to_drain"] is False]
    for c in bad:
        print(f"vt bench: WRONG TOKENS in serve {c['preset']} {c['mode']} {c['arrival']} "
              f"{c['load']:g}", file=sys.stderr)
    return 1 if bad else 0


def main(argv=None) -> int:
    """`python3 -m vt.cli.bench` / tools/bench.py: the same command outside the `vt` CLI."""
    p = argparse.ArgumentParser(prog="vt bench", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    return cmd_bench(args, p.error)
