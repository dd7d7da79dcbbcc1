"""`vt run`: a batch of requests through the decode executor, with progress and step timings.

The default is what a new user should see first: the default backend (cuda when a GPU is
present, else sim), a preset that suits it, the executor mode from the environment
(VT_ASYNC_EXECUTOR*, default off), greedy decoding of random prompts.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _log(msg: str) -> None:
    print(msg, flush=True)


def _config(args: argparse.Namespace):
    from vt.knobs import ExecutorConfig

    overrides = {}
    if args.concurrency is not None:
        overrides["serving_conc"] = args.concurrency
    if args.mode is not None:
        overrides.update(async_executor=args.mode == "ring", no_dbuf=args.mode == "no_dbuf")
    if args.h2d is not None:
        overrides["h2d"] = args.h2d
    if args.trace is not None:
        overrides["trace"] = args.trace
    return ExecutorConfig.from_env(**overrides)


def pick_backend(name: str, sim_delay_ms: float = 0.0):
    """get_backend(name), with the sim-only per-op device delay when one is asked for."""
    from vt.backend import get_backend
    return get_backend(name, **({"device_delay_s": sim_delay_ms / 1e3} if sim_delay_ms else {}))


def resolve_preset(be, preset: str | None, context: int, who: str):
    """(name, ModelConfig): the given preset, or the default for the backend (bench-dense on
    cuda, tiny-dense on sim); exits with a clear message if it is unknown or `context` tokens
    (prompt + new tokens) do not fit its max_context."""
    from vt.model import PRESETS
    name = preset or ("bench-dense" if be.name == "cuda" else "tiny-dense")
    if name not in PRESETS:
        raise SystemExit(f"{who}: unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    if context > cfg.max_context:
        raise SystemExit(f"{who}: prompt + new tokens = {context} exceeds {name}'s max_context "
                         f"{cfg.max_context}")
    return name, cfg


def build_model(be, cfg, *, max_seqs: int, context: int, seed: int, log=lambda msg: None):
    """A HybridModel with seeded random weights and KV blocks for max_seqs sequences of
    `context` tokens each."""
    from vt.model import HybridModel, init_weights
    log(f"  initialising weights (seed {seed}) ...")
    weights = init_weights(cfg, seed=seed)
    log(f"  uploading the model and allocating KV cache for {max_seqs} sequences ...")
    return HybridModel(be, cfg, weights, max_seqs=max_seqs,
                       num_kv_blocks=max_seqs * -(-context // cfg.kv_block_size))


def random_prompts(rng, vocab: int, n: int, length: int) -> list[list[int]]:
    return [rng.integers(0, vocab, length).tolist() for _ in range(n)]


def run_demo(args: argparse.Namespace) -> int:
    from vt.engine import Engine

    config = _config(args)
    be = pick_backend(args.backend, args.sim_delay_ms)
    conc = config.serving_conc
    n_requests = args.requests or 2 * conc
    try:
        preset, cfg = resolve_preset(be, args.preset, args.prompt_len + args.steps, "vt run")
        _log(f"vt run: backend={be.name} preset={preset} mode={_mode_name(config)} conc={conc} "
             f"requests={n_requests} prompt_len={args.prompt_len} new_tokens={args.steps}")
        t0 = time.perf_counter()
        model = build_model(be, cfg, max_seqs=conc, context=args.prompt_len + args.steps,
                            seed=args.seed, log=_log)
        _log(f"  capturing decode graphs for sizes {list(config.capture_sizes)} "
             f"({config.slots_per_size} slot(s) per size) and warming the eager/prefill shapes ...")
        with Engine(be, model, config) as engine:
            _log(f"  ready in {time.perf_counter() - t0:.1f} s; generating")
            prompts = random_prompts(np.random.default_rng(args.seed), cfg.vocab, n_requests,
                                     args.prompt_len)
            results = engine.generate(prompts, max_new_tokens=args.steps, progress=_progress_printer())
            stats = engine.stats()
            trace = engine.close()
        model.close()
    finally:
        be.close()
    _report(results, stats, trace)
    return 0 if all(r.error is None for r in results) else 1


def _mode_name(config) -> str:
    return "ring" if config.async_executor else "no_dbuf" if config.no_dbuf else "off"


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
    failed = [r for r in results if r.error is not None]
    steps = max(stats["steps"], 1)
    _log(f"done: {stats['tokens']} tokens in {stats['wall_s']:.2f} s = {stats['tokens_per_s']:.0f} tokens/s, "
         f"mode {stats['mode']}")
    _log(f"  steps {stats['steps']} (graph {stats['graph_steps']}, eager {stats['eager_steps']}, "
         f"mixed {stats['mixed_steps']}, prefill {stats['prefill_steps']})")
    _log(f"  per step: host refresh+launch {1e3 * stats['host_launch_s'] / steps:.3f} ms, "
         f"device {stats['device_ms'] / steps:.3f} ms, drain waits {1e3 * stats['drain_s'] / steps:.3f} ms, "
         f"ring waits {1e3 * stats['ring_wait_s'] / steps:.3f} ms, "
         f"token waits {1e3 * stats['token_wait_s'] / steps:.3f} ms")
    _log(f"  pool: {stats['pool']['bytes_reserved'] / 2**20:.1f} MiB reserved, "
         f"mallocs during capture {stats['pool']['mallocs_during_capture']}, "
         f"driver mallocs since warm-up {stats['driver_mallocs_since_warm_up']}")
    if trace:
        _log(f"  trace written to {trace} (open it in https://ui.perfetto.dev)")
    for r in failed:
        print(f"  request {r.index} failed: {r.error}", file=sys.stderr)
    if results:
        _log(f"  request 0: {results[0].tokens[:16]}{' ...' if len(results[0].tokens) > 16 else ''}")
