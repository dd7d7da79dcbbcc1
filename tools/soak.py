"""Soak: thousands of decode steps with continuous admissions on one engine; every resource
flat after warm-up, every admitted request finished with its tokens.

One Engine serves chunk after chunk (one generate() each) of random requests: more requests
than rows, so requests are admitted whenever others finish (continuous batching); random
prompt lengths, budgets up to the context, greedy and seeded sampling, a stop token in some
chunks. The first chunk is the warm-up; after it, at every chunk boundary these must equal
their post-warm-up values:

  pool bytes (reserved, in use, free, capture scratch) and driver mallocs   be.pool.stats()
  live graphs, events and streams        the backend's own registry (be._owned; not closed)
  pinned host buffers and bytes          live PinnedBuffer (cuda) / sim pinned owners (gc)
  sim only: raw device blocks and threads (one worker thread per live stream)

Every request is checked (finish_reason "length" with all its tokens, or "stop" ending at the
stop token), and the first and last chunks are replayed on a fresh synchronous engine: same
tokens. Start and end figures are printed. Exit code 1 when anything drifted or differed.

  python3 tools/soak.py --backend sim --steps 10000                      # toy, ~1 min on a CPU
  python3 tools/soak.py --backend cuda --steps 10000 --model tiny-moe    # H200, < 1 min
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
from vt.backend import get_backend  # noqa: E402
from vt.engine.engine import Engine  # noqa: E402
from vt.config import SAFE_MODES, ExecutorConfig  # noqa: E402
from vt.hooks import NULL_HOOKS, Poison  # noqa: E402
from vt.step.contract import KVGeometry, SamplingParams  # noqa: E402

TOY_GEOMETRY = KVGeometry(max_seqs=16, num_kv_blocks=160, block_size=8, max_context=96)
FLAT = ("pool_bytes_reserved", "pool_bytes_in_use", "pool_free_bytes", "pool_scratch_bytes",
        "driver_mallocs", "graphs", "events", "streams", "pinned_buffers", "pinned_bytes",
        "raw_blocks", "threads")


def figures(be) -> dict:
    """The resource counts of backend `be` now (after a gc pass)."""
    gc.collect()
    pool = be.pool.stats()
    live = Counter(type(o).__name__ for o in list(be._owned) if not o.closed)
    pinned_n, pinned_b = _pinned(be)
    out = dict(pool_bytes_reserved=pool.bytes_reserved, pool_bytes_in_use=pool.bytes_in_use,
               pool_free_bytes=pool.free_bytes, pool_scratch_bytes=pool.scratch_bytes,
               driver_mallocs=pool.driver_mallocs,
               mallocs_during_capture=pool.mallocs_during_capture, graphs=live.get("Graph", 0),
               events=live.get("Event", 0), streams=live.get("Stream", 0),
               pinned_buffers=pinned_n, pinned_bytes=pinned_b, rss_mb=_rss_mb())
    if be.name == "sim":
        out.update(raw_blocks=be._raw.live_blocks, threads=threading.active_count())
    return out


def _pinned(be) -> tuple[int, int]:
    """Live pinned host buffers: there is no backend counter, so count the owner objects."""
    if be.name == "cuda":
        from vt.backend.cuda._memory import PinnedBuffer
        objs = [o for o in gc.get_objects() if isinstance(o, PinnedBuffer) and not o.closed]
        return len(objs), sum(o.nbytes for o in objs)
    from vt.backend.sim._memory import PinnedOwner
    objs = [o for o in gc.get_objects() if isinstance(o, PinnedOwner)]
    return len(objs), sum(o._mem.nbytes for o in objs)


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def chunk_workload(rng, geo: KVGeometry, vocab: int, conc: int, steps: int, max_prompt: int = 16):
    """Requests for about `steps` steps at concurrency `conc` (random lengths and budgets)."""
    prompts, budgets, sampling, total = [], [], [], 0
    while total < steps * conc:
        plen = int(rng.integers(1, max_prompt + 1))
        budget = int(rng.integers(1, geo.max_context - plen + 2))
        prompts.append(rng.integers(0, vocab, size=plen).astype(np.int32))
        budgets.append(budget)
        sampling.append(SamplingParams() if rng.integers(0, 3) == 0 else SamplingParams(
            temperature=float(rng.integers(2, 15)) / 10, top_k=int(rng.integers(0, 40)) or None,
            top_p=float(rng.integers(1, 11)) / 10, min_p=float(rng.integers(0, 5)) / 20,
            seed=int(rng.integers(0, 2**62))))
        total += budget
    stop = int(rng.integers(0, vocab)) if rng.integers(0, 2) else None
    return dict(prompts=prompts, max_new_tokens=budgets, sampling=sampling, stop_token=stop)


def check_results(work: dict, results) -> list[str]:
    """Every admitted request finished with its tokens."""
    problems, stop = [], work["stop_token"]
    if len(results) != len(work["prompts"]):
        problems.append(f"{len(results)} results for {len(work['prompts'])} requests")
    for res, budget in zip(results, work["max_new_tokens"]):
        toks = res.tokens
        ok = (res.finish_reason == "length" and len(toks) == budget and stop not in toks) or (
            res.finish_reason == "stop" and 0 < len(toks) <= budget and toks[-1] == stop
            and stop not in toks[:-1])
        if not ok:
            problems.append(f"request {res.index}: {res.finish_reason} with {len(toks)}/{budget} "
                            f"tokens (stop {stop})")
    return problems


class _Model:
    def __init__(self, be, name: str, max_seqs: int):
        self.be, self.name, self._hybrid = be, name, None
        if name == "toy":
            self.geometry, self.vocab = TOY_GEOMETRY, 64
        else:
            from vt.forward.hybrid import HybridStepModel
            from vt.bundled import PRESETS, HybridModel, init_weights
            cfg = PRESETS[name]
            self._hybrid = HybridModel(be, cfg, init_weights(cfg, seed=0), max_seqs=max_seqs,
                                       num_kv_blocks=max_seqs * 12)
            self.geometry = HybridStepModel(be, self._hybrid).geometry
            self.vocab = cfg.vocab

    def step_model(self):
        if self._hybrid is None:
            from vt.forward.toy import ToyForward
            return ToyForward(self.be, vocab=self.vocab, geometry=self.geometry).step_model()
        from vt.forward.hybrid import HybridStepModel
        return HybridStepModel(self.be, self._hybrid)

    def close(self):
        if self._hybrid is not None:
            self._hybrid.close()


def soak(be, *, model: str = "toy", steps: int = 10_000, mode: str = "ring", conc: int = 8,
         chunk_steps: int = 1000, seed: int = 0, capture_sizes=(1, 2, 4, 8, 16), log=print) -> dict:
    """Run the soak on backend `be`; returns the report (see the module docstring)."""
    rng = np.random.default_rng(seed)
    m = _Model(be, model, max_seqs=16)
    config = ExecutorConfig(mode=mode, serving_conc=conc, capture_sizes=capture_sizes)
    hooks = Poison() if config.guarded else NULL_HOOKS   # the ring modes poison
    t0 = time.perf_counter()
    report = dict(backend=be.name, model=model, mode=config.mode, conc=conc, seed=seed,
                  chunks=[], problems=[], drift={}, reference_mismatches=None)
    try:
        before_engine = figures(be)
        eng = Engine(be, m.step_model(), config, hooks=hooks)
        kept = []   # (workload, results) of the first measured chunk and the latest one
        with eng:
            total = 0
            start = None
            while total < steps:
                size = min(chunk_steps, max(1, steps - total)) if start is not None else \
                    min(200, steps)
                work = chunk_workload(rng, m.geometry, m.vocab, conc, size)
                s0 = eng.stats()["steps"]
                results = eng.generate(**work)
                st = eng.stats()
                n_steps = st["steps"] - s0
                total += n_steps
                probs = check_results(work, results)
                report["problems"] += probs
                fig = figures(be)
                row = dict(chunk=len(report["chunks"]), requests=len(results), steps=n_steps,
                           total_steps=total, graph_steps=st["graph_steps"],
                           mixed_steps=st["mixed_steps"], problems=len(probs), **fig)
                report["chunks"].append(row)
                if start is None:
                    start = fig
                    report["warm_up"] = row
                    log(f"warm-up chunk: {n_steps} steps, {len(results)} requests")
                else:
                    if len(kept) < 2:
                        kept.append((work, results))
                    else:
                        kept[1] = (work, results)
                    drift = {k: fig[k] - start[k] for k in FLAT if k in fig and fig[k] != start[k]}
                    for k, v in drift.items():
                        report["drift"].setdefault(k, []).append((row["chunk"], v))
                    log(f"chunk {row['chunk']}: {n_steps} steps ({total} total), "
                        f"{len(results)} requests, {'drift ' + str(drift) if drift else 'flat'}"
                        f"{', PROBLEMS ' + str(probs[:3]) if probs else ''}")
            report["end"] = figures(be)
            report["start"] = start
            st = eng.stats()
            report["stats"] = {k: st[k] for k in ("steps", "graph_steps", "eager_steps",
                                                  "mixed_steps", "prefill_steps", "drains",
                                                  "ring_waits", "tokens")}
            report["driver_mallocs_since_warm_up"] = st["driver_mallocs_since_warm_up"]
        report["before_engine"] = before_engine
        # The first measured chunk and the last one again, on a fresh synchronous engine.
        ref_config = ExecutorConfig(mode="sync", serving_conc=conc, capture_sizes=capture_sizes)
        bad = 0
        with Engine(be, m.step_model(), ref_config) as ref:
            for work, results in kept:
                again = ref.generate(**work)
                bad += sum((a.tokens, a.finish_reason) != (b.tokens, b.finish_reason)
                           for a, b in zip(again, results))
        report["reference_mismatches"] = bad
        report["reference_requests"] = sum(len(r) for _, r in kept)
    finally:
        m.close()
    report["elapsed_s"] = time.perf_counter() - t0
    report["steps"] = report["stats"]["steps"]
    report["flat"] = not report["drift"]
    report["ok"] = report["flat"] and not report["problems"] and report["reference_mismatches"] == 0
    return report


def print_report(rep: dict, log=print) -> None:
    s, e = rep["start"], rep["end"]
    log(f"\nsoak {rep['backend']} {rep['model']} mode={rep['mode']} conc={rep['conc']}: "
        f"{rep['stats']['steps']} steps ({rep['stats']['graph_steps']} graph, "
        f"{rep['stats']['mixed_steps']} mixed, {rep['stats']['eager_steps']} eager, "
        f"{rep['stats']['prefill_steps']} prefill), {rep['stats']['tokens']} tokens, "
        f"{sum(c['requests'] for c in rep['chunks'])} requests in {len(rep['chunks'])} chunks, "
        f"{rep['elapsed_s']:.1f}s")
    log(f"{'figure':<24} {'before engine':>14} {'after warm-up':>14} {'end':>14}")
    for k in list(FLAT) + ["mallocs_during_capture", "rss_mb"]:
        if k in e:
            b = rep["before_engine"].get(k, "")
            fmt = (lambda v: f"{v:.1f}") if k == "rss_mb" else str
            log(f"{k:<24} {fmt(b):>14} {fmt(s[k]):>14} {fmt(e[k]):>14}"
                f"{'   DRIFT' if k in rep['drift'] else ''}")
    log(f"flat after warm-up: {'yes' if rep['flat'] else 'NO ' + str(rep['drift'])}; broken "
        f"requests: {len(rep['problems'])}; first and last chunk vs a fresh sync engine: "
        f"{rep['reference_mismatches']} of {rep['reference_requests']} requests differ "
        f"(rss_mb is reported, not checked)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("sim", "cuda"), default="sim")
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--model", default=None, help="toy (default on sim), tiny-dense, tiny-moe "
                                                  "(default on cuda)")
    ap.add_argument("--mode", default="ring", choices=list(SAFE_MODES))
    ap.add_argument("--conc", type=int, default=8)
    ap.add_argument("--chunk-steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model = args.model or ("toy" if args.backend == "sim" else "tiny-moe")
    be = get_backend(args.backend)
    try:
        rep = soak(be, model=model, steps=args.steps, mode=args.mode, conc=args.conc,
                   chunk_steps=args.chunk_steps, seed=args.seed,
                   log=lambda s: print(s, flush=True))
    finally:
        be.close()
    print_report(rep)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
