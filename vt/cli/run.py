"""`vt run`: a batch of requests through the decode executor, with progress and step timings.

The default is what a new user should see first: the default backend (cuda when a GPU is
present, else sim), a preset that suits it, the executor mode from the environment
(VT_ASYNC_EXECUTOR, VT_ASYNC_EXECUTOR_NO_DBUF; default drain), greedy decoding of random
prompts. Every flag and
VT_* variable is checked before a backend is opened or a model built (check_run): a bad one
is a one-line UsageError, which `vt` turns into exit code 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from vt.cli.common import (OutputError, UsageError, what_to_do, backend_name, build_model, check_output_path,  # noqa: F401
                           pick_backend, pick_preset, random_prompts)

# Printed to stderr by every run in the unguarded mode (it needs --unsafe-unguarded to start).
_UNSAFE_WARNING = ("vt run: WARNING: mode unguarded skips the drain without the slot ring: the "
                   "host overwrites inputs the device has not read yet, so the tokens below are "
                   "WRONG on purpose (the host-overwrite hazard's test arm)")


def _log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- checks before any work
def check_run_args(args: argparse.Namespace) -> None:
    """The flags that need no backend: sizes, seed, delay, each within its bound
    (vt/bench/limits.py). Raises UsageError."""
    from vt.bench import limits as lim
    for flag, value in (("--steps", args.steps), ("--prompt-len", args.prompt_len),
                        ("--concurrency", args.concurrency), ("--requests", args.requests)):
        if value is not None and value < 1:
            raise UsageError(f"vt run: {flag} must be a positive integer, got {value}")
    why = (lim.int_problem("--concurrency", args.concurrency, 1, lim.MAX_SERVING_CONC)
           or lim.int_problem("--requests", args.requests, 1, lim.MAX_REQUESTS)
           or lim.int_problem("--seed", args.seed, 0, lim.MAX_SEED)
           or lim.float_problem("--sim-delay-ms", args.sim_delay_ms, 0, lim.MAX_SIM_DELAY_MS))
    if why:
        raise UsageError(f"vt run: {why}")


def _config(args: argparse.Namespace):
    """The executor config and test hooks: VT_* variables, then the flags (a --mode replaces
    the mode variables). Raises UsageError on bad values."""
    from vt.config import ExecutorConfig
    from vt.hooks import hooks_from_env

    overrides = {}
    if args.concurrency is not None:
        overrides["serving_conc"] = args.concurrency
    if args.mode is not None:
        overrides["mode"] = args.mode
    if args.trace is not None:
        overrides["trace"] = args.trace
    try:
        return ExecutorConfig.from_env(**overrides), hooks_from_env()
    except ValueError as e:
        raise UsageError(f"vt run: {e}; {what_to_do(e, 'vt run')}") from None


def check_unsafe_opt_in(config, args: argparse.Namespace) -> None:
    """The unguarded arm produces wrong tokens by design: it runs only when asked for twice."""
    if config.safe or args.unsafe_unguarded:
        return
    source = "--mode unguarded" if args.mode == "unguarded" else "VT_ASYNC_EXECUTOR_NO_DBUF=1"
    raise UsageError(f"vt run: {source} is the unsafe test arm (it skips the drain without the "
                     f"slot ring, so the tokens are wrong: the host-overwrite hazard); add "
                     f"--unsafe-unguarded to run it anyway, or pick a safe --mode")


def check_trace_path(path: str | None, source: str) -> None:
    """Fail now, not after the whole run, when the trace file cannot be written."""
    if path is None:
        return
    if os.path.isdir(path):
        raise UsageError(f"vt run: {source} {path!r} is a directory; give a file path such as "
                         f"{os.path.join(path, 'trace.json')!r}")
    check_output_path("vt run", source, path)


def check_capture_sizes(config) -> None:
    """The bundled model's graphs hold at most max_batch rows: the larger of its default
    max_batch and the concurrency (vt.bundled.HybridModel), checked before it is built."""
    import inspect
    from vt.bundled import HybridModel
    default = inspect.signature(HybridModel).parameters["max_batch"].default
    limit = max(default, config.serving_conc)
    over = [s for s in config.capture_sizes if s > limit]
    if over:
        raise UsageError(f"vt run: VT_CAPTURE_SIZES has {over}, above the model's max batch {limit} "
                         f"(the larger of {default} and --concurrency); use sizes of at most {limit}")


# ---------------------------------------------------------------- the run
def check_run(args: argparse.Namespace):
    """Every check `vt run` can make before it opens a backend or builds a model:
    (config, test hooks, backend name, preset name, ModelConfig). Raises UsageError."""
    check_run_args(args)
    config, hooks = _config(args)
    check_capture_sizes(config)   # vt run sets no sizes itself: they come from VT_CAPTURE_SIZES
    check_unsafe_opt_in(config, args)
    check_trace_path(config.trace, "--trace" if args.trace is not None else "VT_ASYNC_EXECUTOR_TRACE")
    backend = backend_name(args.backend)
    if backend == "cuda" and args.sim_delay_ms:
        raise UsageError("vt run: --sim-delay-ms applies to the sim backend only and this run "
                         "uses cuda; drop it or add --backend sim")
    preset, cfg = pick_preset(backend, args.preset, args.prompt_len + args.steps, "vt run",
                              force=args.force)
    return config, hooks, backend, preset, cfg


def run_demo(args: argparse.Namespace) -> int:
    config, hooks, backend, preset, cfg = check_run(args)
    if not config.safe:
        print(_UNSAFE_WARNING, file=sys.stderr, flush=True)
    be = pick_backend(backend, args.sim_delay_ms, who="vt run")
    conc = config.serving_conc
    n_requests = 2 * conc if args.requests is None else args.requests
    try:
        _log(f"vt run: backend={be.name} preset={preset} mode={config.mode}{hooks.label} "
             f"({config.describe()}) conc={conc} requests={n_requests} "
             f"prompt_len={args.prompt_len} new_tokens={args.steps}")
        t0 = time.perf_counter()
        model = build_model(be, cfg, max_seqs=conc, context=args.prompt_len + args.steps,
                            seed=args.seed, log=_log)
        _log(f"  capturing decode graphs for sizes {list(config.capture_sizes)} "
             f"({config.slots_per_size} slot(s) per size) and warming the eager/prefill shapes ...")
        from vt.engine.engine import Engine   # here: a usage error or a refused preset needs none of it
        with Engine(be, model, config, hooks=hooks, profile=True) as engine:
            _log(f"  ready in {time.perf_counter() - t0:.1f} s; generating")
            prompts = random_prompts(np.random.default_rng(args.seed), cfg.vocab, n_requests,
                                     args.prompt_len)
            results = engine.generate(prompts, max_new_tokens=args.steps, progress=_progress_printer())
            stats = engine.stats()
            trace, trace_error = _close_writing_trace(engine, config.trace)
        model.close()
    finally:
        be.close()
    _report(results, stats, trace)
    if trace_error is not None:   # after the report: the run's numbers are not lost with it
        raise trace_error
    return 0


def _close_writing_trace(engine, path):
    """engine.close(), which writes the trace: (the path written, None), or (None, the
    OutputError) when the trace could not be written (a full disk); the engine is closed
    either way."""
    try:
        return engine.close(), None
    except OSError as e:
        return None, OutputError(f"vt run: could not write the trace {path!r}: {e.strerror or e}")


def _progress_printer():
    last = [0.0]

    def show(p) -> None:
        now = time.perf_counter()
        if p.finished == p.total or now - last[0] >= 0.5:
            last[0] = now
            _log(f"  step {p.step:5d}  finished {p.finished}/{p.total}  tokens {p.tokens}  "
                 f"{p.tokens / p.elapsed_s if p.elapsed_s else 0:.0f} tok/s")
    return show


def _report(results, stats: dict, trace: str | None) -> None:
    _log(f"done: {stats['tokens']} tokens in {stats['wall_s']:.2f} s = {stats['tokens_per_s']:.0f} tokens/s, "
         f"mode {stats['mode']}")
    _log(f"  steps {stats['steps']} (graph {stats['graph_steps']}, eager {stats['eager_steps']}, "
         f"mixed {stats['mixed_steps']}, prefill {stats['prefill_steps']})")
    dec = stats["phases"]["decode"]
    timed, n = max(dec["timed_steps"], 1), max(dec["steps"], 1)
    us = {k: 1e6 * dec[k] / timed for k in ("plan_s", "acquire_s", "refresh_s", "launch_s", "collect_s")}
    _log(f"  per decode step (µs; the split timed on {dec['sampled_steps']} of {dec['steps']} steps, "
         f"each weighted by the steps it stands for): "
         f"plan {us['plan_s']:.1f}, acquire {us['acquire_s']:.1f}, refresh {us['refresh_s']:.1f}, "
         f"launch {us['launch_s']:.1f}, collect {us['collect_s']:.1f}; host busy "
         f"{1e6 * (dec['wall_s'] - dec['wait_s']) / n:.1f}, waits {1e6 * dec['wait_s'] / n:.1f}, "
         f"device {1e3 * dec['device_ms'] / max(dec['device_steps'], 1):.1f}")
    _log(f"  pool: {stats['pool']['bytes_reserved'] / 2**20:.1f} MiB reserved, "
         f"mallocs during capture {stats['pool']['mallocs_during_capture']}, "
         f"driver mallocs since warm-up {stats['driver_mallocs_since_warm_up']}")
    if trace:
        _log(f"  trace written to {trace} (open it in https://ui.perfetto.dev)")
    reasons = {}
    for r in results:
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    _log(f"  finished: {', '.join(f'{n} {reason}' for reason, n in sorted(reasons.items()))}")
    if results:
        _log(f"  request 0: {results[0].tokens[:16]}{' ...' if len(results[0].tokens) > 16 else ''}")
