"""`vt bench`: the executor modes against a hand-written PyTorch CUDA-graph loop and the
device ceiling, at equal device work, in one run (docs/design.md, "Performance protocol").

This module is the front end: the flags, their checks before any work, the dispatch to the
workloads of vt.bench, the tables and output files. Workloads with options of their own
(STANDALONE) get a parser of their own: `vt bench --workload NAME --help`."""
from __future__ import annotations

import argparse
import os
import sys

DEFAULT_SPIN_US = (0, 25, 50, 100, 200, 400, 1000)
# Cells whose wrong tokens are the point: the unguarded test arm (no_dbuf in results written
# before it had that name).
_WRONG_ON_PURPOSE = ("unguarded", "no_dbuf")
# Per backend: decode steps per cell and back-to-back replays per ceiling. The sim runs the
# same sweep with few steps (a CI check of every column in < 60 s, not a measurement).
_STEPS = {"cuda": 300, "sim": 12}
_REPLAYS = {"cuda": 200, "sim": 10}

# Workloads with options of their own: name -> (their module in vt.bench, what they measure).
# Each module has add_arguments(parser), check_arguments(args, error) and run_and_report(args).
STANDALONE = {
    "torch-decode": ("torch_decode", "a Llama decoder's decode step served by vt against its "
                     "memory-bandwidth floor, the torch graph loop and transformers generate"),
    "torch-ttft": ("torch_ttft", "TTFT and TPOT of a Llama decoder served by vt against "
                   "transformers generate"),
    "prefix-cache": ("prefix_cache", "prefix caching on against off under multi-turn chat, a "
                     "shared system prompt, a long cached prefix and prompts that never hit, on a "
                     "Llama decoder"),
    "invariance": ("invariance", "the cost of LlamaDecoder(batch_invariant=True) at Llama-3-8B's "
                   "shape on one GPU, and a check of it"),
}

EXAMPLES = """examples:
  vt bench --backend sim --workload synthetic --json bench.json
  vt bench --workload synthetic --device-us 0 100 400 --conc 32 --json s.json --png s.png
  vt bench --workload model --preset bench-small --conc 1 32 64 --json m.json --png m.png
  vt bench --workload torch --conc 1 32 --json t.json
  vt bench --from-json small.json dense.json moe.json --png presets.png
  vt bench --workload serve --preset bench-small --clients 16 32 --modes drain ring --json s.json
  vt bench --workload serve --url http://127.0.0.1:8000 --clients 16 32 --json http.json
  vt bench --workload torch-decode --rows 1 8 32 --live 256 2048 --json decode.json
  vt bench --workload torch-ttft --conc 32 --prompt-len 512 --context 640 --json ttft.json
  vt bench --workload invariance --parts linear step --json invariance.json
  vt bench --workload prefix-cache --clients 16 --json prefix.json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag, with its bound (vt/bench/limits.py); list flags take at most MAX_LIST_VALUES."""
    from vt.bench import limits as lim
    from vt.config import MODES, SAFE_MODES
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    p.add_argument("--workload", default="synthetic",
                   choices=["synthetic", "model", "torch", "sampler", "serve", *STANDALONE],
                   help="synthetic: a user forward spinning D us per step (+ the torch peer); "
                        "model: the bundled model at --preset; torch: the vt.torch Llama decoder "
                        "(bf16, random weights) + the same module in a torch CUDA-graph loop; "
                        "sampler: vt's sampler against torch's over [S, V] logits (GPU); serve: the bundled "
                        "model under serving traffic through the online API (vt/bench/serve.py). "
                        "With options of their own (vt bench --workload NAME --help lists them): "
                        + "; ".join(f"{name}: {what}" for name, (_, what) in STANDALONE.items()))
    p.add_argument("--vocab", type=int, nargs="+", default=None, metavar="V",
                   help=f"synthetic: the forward's vocabulary, one value, 2 to {lim.MAX_VOCAB} "
                        f"(default: 32000); sampler: the vocabularies to sweep (default: 32000 "
                        f"128256 151936)")
    p.add_argument("--sampling", nargs="+", default=None,
                   choices=["greedy", "top_k", "top_p", "temperature"],
                   help="sampler: what to sample (default: all four; top_k 50, top_p 0.9, "
                        "temperature 1)")
    p.add_argument("--device-us", dest="spin_us", type=float, nargs="+",
                   default=list(DEFAULT_SPIN_US), metavar="D",
                   help=f"synthetic: device us per step to sweep, each 0 to {lim.MAX_DEVICE_US:g} "
                        f"(default: %(default)s)")
    p.add_argument("--force", action="store_true",
                   help="run bench-* presets on the sim backend anyway (slow, gigabytes)")
    p.add_argument("--preset", nargs="+", default=None,
                   help="model: preset(s) (default: bench-small on cuda, tiny-dense on sim); torch: "
                        "torch-llama-10x2048 (default), torch-llama3-8b; serve: either kind")
    p.add_argument("--prompt-kernels", default="auto", choices=["auto", "torch", "vt"],
                   help="torch and serve with a vt.torch preset: the decoder's ops in steps with "
                        "prompt tokens: auto (the default: vt's where decode steps use them, on "
                        "cuda), torch, or vt (the decode step's fused ops; cuda only)")
    p.add_argument("--conc", type=int, nargs="+", default=None,
                   help=f"rows per decode step, S, each 1 to {lim.MAX_SERVING_CONC} (default: 1 32; "
                        f"model: 1 32 64)")
    p.add_argument("--modes", nargs="+", default=None, choices=list(MODES),
                   help=f"executor modes (default: {' '.join(SAFE_MODES)}; torch: sync drain ring; "
                        f"unguarded only when named)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"decode steps per cell, at most {lim.MAX_STEPS} (default: {_STEPS['cuda']} on "
                        f"cuda, {_STEPS['sim']} on sim)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help=f"prompt tokens per request, at most {lim.MAX_PROMPT_LEN} and the preset's "
                        f"context (default: 2 synthetic, 16 model)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed runs per cell, at most {lim.MAX_REPEATS}; the cell is the run with the median step time "
                        "(every run's step time is kept in step_us_runs; default: 3), for serve the median "
                        "output tokens/s (latency percentiles: the median over the runs), the modes taking turns, "
                        "their order flipped each repeat (default: 1)")
    p.add_argument("--ceiling-replays", type=int, default=None,
                   help=f"back-to-back replays per ceiling, at most {lim.MAX_CEILING_REPLAYS} (default: {_REPLAYS['cuda']} on cuda, "
                        f"{_REPLAYS['sim']} on sim)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help=f"seconds of device work queued before the first cell, so that it does not "
                        f"run at idle clocks, at most {lim.MAX_WARMUP_S:g} (default: 1 on cuda, 0 on sim)")
    p.add_argument("--profile", default="both", choices=["both", "off"],
                   help="both: each vt cell's engine runs again profiled (Engine.set_profile) for the "
                        "host split and device time; off: throughput only")
    p.add_argument("--wait-poll-us", type=float, default=None,
                   help=f"vt's engines poll an event this long before blocking on it, 0 to below "
                        f"{lim.MAX_WAIT_POLL_US:g} (default: vt's own, vt/backend/waits.py); e.g. longer "
                        f"than a step keeps the host awake")
    p.add_argument("--no-torch", action="store_true", help="leave the torch peer out")
    p.add_argument("--seed", type=int, default=0, help="0 to 2**63 - 1 (default: 0)")
    p.add_argument("--sim-delay-ms", type=float, default=0.0,
                   help=f"sim only: device delay per op, so the host runs ahead, 0 to "
                        f"{lim.MAX_SIM_DELAY_MS:g} ms")
    p.add_argument("--no-bar", action="store_true", help="plain progress lines, no tqdm bar")
    p.add_argument("--from-json", nargs="+", metavar="JSON",
                   help="measure nothing: print the tables of saved results (several runs of one "
                        "workload are merged, e.g. one per preset; sampler results one at a time) and write "
                        "--json/--png from them")
    p.add_argument("--json", help="write the results (every column of every cell) to this path (checked before "
                        "the run, written whole or not at all)")
    p.add_argument("--png", help="write the plot to this path, a name ending in .png (needs matplotlib: "
                        "the bench extra; both checked before the run)")
    _add_serve_arguments(p)


def _add_serve_arguments(p) -> None:
    g = p.add_argument_group("--workload serve")
    g.add_argument("--arrival", nargs="+", default=["closed"], choices=["closed", "poisson"],
                   help="closed: --clients concurrent clients; poisson: open loop at --rate")
    g.add_argument("--clients", type=int, nargs="+", default=None,
                   help="closed-loop concurrent clients (default: 16 32 on cuda, 2 4 on sim)")
    g.add_argument("--rate", type=float, nargs="+", default=None,
                   help="open-loop arrivals per second (default: 40 on cuda, 200 on sim)")
    g.add_argument("--requests", type=int, default=None,
                   help="requests per cell (default: 96 on cuda, 8 on sim)")
    g.add_argument("--output-len", type=int, nargs="+", default=None, metavar="N",
                   help="max_new_tokens: N, or MIN MAX drawn uniformly with --seed "
                        "(default: 128 256 on cuda, 3 8 on sim)")
    g.add_argument("--url", default=None,
                   help="drive a running `vt serve` at this address (http://HOST:PORT) through "
                        "streamed /v1/completions instead of an engine in this process: the same "
                        "requests, its model and mode (vt/bench/serve_http.py)")
    g.add_argument("--request-fields", default=None, metavar="JSON",
                   help="with --url: more fields of every request's body, e.g. "
                        "'{\"logprobs\": 5}' (the cost of what a request asks for)")
    g.add_argument("--request-fields-share", type=float, default=1.0, metavar="F",
                   help="with --url: the share of the requests that carry --request-fields "
                        "(0.5: every other one; each half's latencies are reported apart)")
    g.add_argument("--prompt-range", type=int, nargs="+", default=None, metavar="N",
                   help="prompt tokens: N, or MIN MAX (default: 16 64 on cuda, 2 6 on sim)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `vt bench` on the `vt` CLI's subparsers."""
    p = subparsers.add_parser("bench", help="executor modes vs a torch CUDA-graph loop and the "
                              "device ceiling, in one run", description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def _resolve(args: argparse.Namespace, error) -> None:
    """Fill the backend-dependent defaults and check every value, each within its bound
    (vt/bench/limits.py), before any work starts."""
    from vt.bench import limits as lim
    from vt.backend import available_backends
    from vt.cli.common import pick_preset
    from vt.bundled import PRESETS
    backend = args.backend if args.backend != "auto" else (
        "cuda" if "cuda" in available_backends() else "sim")
    model = args.workload in ("model", "serve")
    if args.workload == "serve":
        from vt.bench.serve_run import resolve_serve
        resolve_serve(args, backend, error)
    else:
        given = [flag for flag, v in (("--clients", args.clients), ("--rate", args.rate),
                                      ("--requests", args.requests), ("--output-len", args.output_len),
                                      ("--prompt-range", args.prompt_range), ("--url", args.url),
                                      ("--request-fields", args.request_fields),
                                      ("--request-fields-share",
                                       None if args.request_fields_share == 1 else args.request_fields_share),
                                      ("--arrival", None if args.arrival == ["closed"] else args.arrival))
                 if v is not None]
        if given:
            error(f"{given[0]} applies to --workload serve only")
    if args.workload == "torch":
        from vt.bench import torch_workload
        args.preset = torch_workload.checked_presets(args.preset, error)
        if backend != "cuda":
            error("--workload torch needs a CUDA GPU (a bf16 Llama decoder of 0.6B parameters)")
    if args.modes is None:
        from vt.config import SAFE_MODES
        args.modes = list(torch_workload.DEFAULT_MODES if args.workload == "torch" else SAFE_MODES)
    sampler = args.workload == "sampler"
    if sampler and backend != "cuda":
        error("--workload sampler needs a CUDA GPU (it times CUDA graphs of vt's and torch's samplers)")
    if args.vocab is None:
        args.vocab = [32000, 128256, 151936] if sampler else [32000]
    if args.workload == "synthetic" and len(args.vocab) != 1:
        error(f"--vocab takes one value with the synthetic workload, got {args.vocab}; run once "
              f"per vocabulary")
    if args.sampling is None:
        args.sampling = ["greedy", "top_k", "top_p", "temperature"]
    if args.conc is None:
        args.conc = [1, 32, 64] if model else [1, 8, 32, 128, 256] if sampler else [1, 32]
    if args.repeats is None:
        args.repeats = 1 if args.workload == "serve" else 3
    if args.steps is None:
        args.steps = _STEPS[backend]
    if args.prompt_len is None:   # synthetic: a short prefill (it spins D per prompt token)
        args.prompt_len = 2 if args.workload == "synthetic" else 16
    if args.ceiling_replays is None:
        args.ceiling_replays = _REPLAYS[backend]
    if args.warmup_s is None:
        args.warmup_s = 1.0 if backend == "cuda" else 0.0
    if args.preset is None:
        args.preset = ["bench-small" if backend == "cuda" else "tiny-dense"]
    for flag, vals in (("--conc", args.conc), ("--steps", [args.steps]),
                       ("--prompt-len", [args.prompt_len]),
                       ("--ceiling-replays", [args.ceiling_replays]), ("--repeats", [args.repeats])):
        if min(vals) < 1:
            error(f"{flag} must be positive integers, got {vals}")
    problems = [lim.list_problem(flag, vals) for flag, vals in (
        ("--modes", args.modes), ("--conc", args.conc), ("--device-us", args.spin_us),
        ("--preset", args.preset))]
    problems += [lim.int_problem("--conc", c, 1, lim.MAX_SERVING_CONC) for c in args.conc]
    problems += [lim.float_problem("--device-us", d, 0, lim.MAX_DEVICE_US) for d in args.spin_us]
    problems += [lim.list_problem("--vocab", args.vocab)]
    problems += [lim.int_problem("--vocab", v, 2, lim.MAX_VOCAB) for v in args.vocab]
    problems += [
        lim.int_problem("--steps", args.steps, 1, lim.MAX_STEPS),
        lim.int_problem("--prompt-len", args.prompt_len, 1, lim.MAX_PROMPT_LEN),
        lim.int_problem("--repeats", args.repeats, 1, lim.MAX_REPEATS),
        lim.int_problem("--ceiling-replays", args.ceiling_replays, 1, lim.MAX_CEILING_REPLAYS),
        lim.int_problem("--seed", args.seed, 0, lim.MAX_SEED),
        lim.float_problem("--warmup-s", args.warmup_s, 0, lim.MAX_WARMUP_S),
        lim.float_problem("--sim-delay-ms", args.sim_delay_ms, 0, lim.MAX_SIM_DELAY_MS),
        lim.float_problem("--wait-poll-us", args.wait_poll_us, 0, lim.MAX_WAIT_POLL_US,
                          hi_open=True)]
    why = next((p for p in problems if p), None)
    if why:
        error(why)
    if backend == "cuda" and args.sim_delay_ms:
        error("--sim-delay-ms applies to the sim backend only and this run uses cuda; drop it "
              "or add --backend sim")
    from vt.bench.torch_workload import PRESETS as TORCH_PRESETS
    torch_ok = args.workload == "serve"   # serve runs a torch preset too
    unknown = [p for p in args.preset if p not in PRESETS and args.workload != "torch"
               and not (torch_ok and p in TORCH_PRESETS)]
    if unknown:   # a typo is refused with either workload, not ignored by the synthetic one
        names = list(PRESETS) + (list(TORCH_PRESETS) if torch_ok else [])
        error(f"unknown preset(s) {unknown}; choose from {', '.join(names)}")
    if args.prompt_kernels != "auto":
        if not (args.workload == "torch" or torch_ok) or not all(p in TORCH_PRESETS
                                                                   for p in args.preset):
            error("--prompt-kernels applies to vt.torch presets only (--workload torch, or "
                  "serve with a torch-* preset)")
        if args.prompt_kernels == "vt" and backend != "cuda":
            error("--prompt-kernels vt runs vt's kernels, which need the cuda backend")
    if torch_ok and any(p in TORCH_PRESETS for p in args.preset):
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            error("a torch preset needs PyTorch, which is not installed (pip install torch)")
    # Bench presets are sized for the GPU: on the sim they need gigabytes of host memory and
    # minutes per step, with nothing printed meanwhile (vt run refuses them the same way).
    big = [p for p in args.preset if p.startswith("bench-")]
    if model and backend == "sim" and big and not args.force:
        error(f"preset(s) {big} are GPU benchmark models; on the sim backend they need "
              f"gigabytes of host memory and minutes per step: use tiny-dense or tiny-moe, or "
              f"add --force to run them anyway")
    if model:   # every preset's context, now: not after the presets before it were measured
        for name in args.preset:
            if name in TORCH_PRESETS:   # its geometry is made for the requests' context
                continue
            pick_preset(backend, name, args.prompt_len + args.steps + 1, "vt bench", force=True)


def check_outputs(args: argparse.Namespace, error) -> None:
    """--json and --png can be written (and --png is a .png that matplotlib can draw), checked
    before the measurement so that a bad path does not lose it."""
    from vt.bench import limits as lim
    from vt.atomic_file import output_path_problem
    for flag, path in (("--json", args.json), ("--png", args.png)):
        why = None if path is None else output_path_problem(path)
        if why:
            error(f"{flag} {path!r} {why}")
    if args.json is not None and args.png is not None and (
            os.path.abspath(args.json) == os.path.abspath(args.png)):
        error(f"--json and --png name the same file {args.json!r}; give two paths")
    if args.png is not None and (why := lim.png_problem(args.png)):
        error(why)


def cmd_bench(args: argparse.Namespace, error=None) -> int:
    from vt.bench import report, serve_report
    from vt.bench.progress import ProgressBar
    from vt.bench.run import run

    def fail(msg):
        from vt.cli.common import UsageError   # `vt` prints its one line and exits 2
        raise UsageError(f"vt bench: {msg}")
    error = error or fail
    check_outputs(args, error)
    if args.workload == "serve" and not args.from_json:
        return _cmd_serve(args, error)
    if args.from_json:
        try:
            loaded = [report.load_json(path) for path in args.from_json]
            if any(isinstance(r, dict) and r.get("format") == serve_report.FORMAT for r in loaded):
                res = serve_report.read_results(args.from_json, loaded)
                return _emit_serve(res, serve_report.table(res), args)   # a damaged cell: here
            if len(loaded) == 1 and isinstance(loaded[0], dict) and loaded[0].get("workload") == "sampler":
                from vt.bench import sampler
                return _print_and_write(loaded[0], sampler.table(loaded[0]), args, sampler) or 0
            res = report.merge([report.read_json(p, r) for p, r in zip(args.from_json, loaded)])
            text = report.table(res)
        except report.BadResultFile as e:
            error(f"--from-json: {e}")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            error(f"--from-json: a cell of {args.from_json} is damaged ({type(e).__name__}: {e})")
    else:
        _resolve(args, error)
        if args.workload == "sampler":
            return _cmd_sampler(args)
        res = run(args, lambda total: ProgressBar(total, bar=False if args.no_bar else None))
        text = report.table(res)
    _print_and_write(res, text, args, report)
    bad = [c for c in res["cells"] if c["status"] == "ok" and c["mode"] not in _WRONG_ON_PURPOSE
           and (c["tokens_ok"] is False or c["identical_to_drain"] is False)]
    for c in bad:
        print(f"vt bench: WRONG TOKENS in {c['impl']} {c['mode']} S={c['conc']}", file=sys.stderr)
    return 1 if bad else 0


def _print_and_write(res: dict, text: str, args: argparse.Namespace, out) -> None:
    """The table, then the JSON and the PNG when asked for, written by `out` (the workload's
    report module: write_json, and write_png returning None or why it could not)."""
    from vt.cli.common import write_output   # an OSError (a full disk): one line, after the table
    print(f"\n{text}", flush=True)
    if args.json:
        write_output("vt bench", "--json", args.json, lambda: out.write_json(res, args.json))
        print(f"vt bench: wrote {args.json}")
    if args.png:
        why = write_output("vt bench", "--png", args.png, lambda: out.write_png(res, args.png))
        print(f"vt bench: {'wrote ' + args.png if why is None else 'no PNG: ' + why}")


def _cmd_sampler(args: argparse.Namespace) -> int:
    """--workload sampler: the table, and the JSON and PNG when asked for."""
    from vt.bench import sampler
    res = sampler.run(args.conc, args.vocab, args.sampling, seed=args.seed)
    _print_and_write(res, sampler.table(res), args, sampler)
    return 0


def _cmd_serve(args: argparse.Namespace, error) -> int:
    from vt.bench import serve_report
    from vt.bench.progress import ProgressBar
    from vt.bench.serve_run import run_serve
    progress = lambda total: ProgressBar(total, bar=False if args.no_bar else None)  # noqa: E731
    if args.url is None and (args.request_fields is not None or args.request_fields_share != 1):
        error("--request-fields and --request-fields-share need --url (they shape HTTP requests)")
    if args.url is not None:
        from vt.bench.serve_http import resolve_http, run_serve_http
        resolve_http(args, error)
        res = run_serve_http(args, progress)
    else:
        _resolve(args, error)
        res = run_serve(args, progress)
    return _emit_serve(res, serve_report.table(res), args)


def _emit_serve(res: dict, text: str, args: argparse.Namespace) -> int:
    """The serve table `text`, the JSON and PNG when asked for; exit 1 if a mode's tokens
    differed."""
    from vt.bench import serve_report
    _print_and_write(res, text, args, serve_report)
    bad = [c for c in res["cells"] if c["tokens_identical_to_drain"] is False]
    for c in bad:
        print(f"vt bench: WRONG TOKENS in serve {c['preset']} {c['mode']} {c['arrival']} "
              f"{c['load']:g}", file=sys.stderr)
    return 1 if bad else 0


def standalone_workload(argv: list[str]) -> str | None:
    """The workload of `vt bench` arguments `argv` when it is one with options of its own."""
    for i, arg in enumerate(argv):
        if arg == "--workload" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--workload="):
            value = arg.split("=", 1)[1]
        else:
            continue
        return value if value in STANDALONE else None
    return None


def standalone_parser(name: str) -> argparse.ArgumentParser:
    """`vt bench --workload NAME`'s parser, for a workload with options of its own: its flags
    (its module's add_arguments), checked (check_arguments) before it runs."""
    import importlib

    from vt.cli.common import OneLineParser, UsageError
    module = importlib.import_module(f"vt.bench.{STANDALONE[name][0]}")
    prog = f"vt bench --workload {name}"
    p = OneLineParser(prog=prog, description=(module.__doc__ or "").split("\n\n")[0])
    p.add_argument("--workload", choices=[name], default=name, help=argparse.SUPPRESS)
    module.add_arguments(p)

    def fail(msg):
        raise UsageError(f"{prog}: {msg}")

    def cmd(args: argparse.Namespace) -> int:
        module.check_arguments(args, fail)
        return module.run_and_report(args)
    p.set_defaults(func=cmd)
    return p


def add_arguments_to_parser(prog: str) -> argparse.ArgumentParser:
    """A parser of `vt bench`'s own flags alone, named `prog`."""
    from vt.cli.common import OneLineParser
    p = OneLineParser(prog=prog, description=__doc__, epilog=EXAMPLES,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p
