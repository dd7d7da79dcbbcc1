"""Per-kernel-family device time INSIDE a captured decode step, and each GEMM shape alone.

    python3 tools/profile_step.py --preset bench-dense --batch 1 32 [--mode remove double]

Eager per-launch event timing includes host launch gaps, so it misattributes small kernels.
Here every number comes from replays of captured graphs (events around `iters` back-to-back
replays, median over `repeats`, after a warm-up replay):
- `remove`: T(normal step) - T(step captured without that family's launches): the family's
  marginal device time in context (its own run time plus the per-node gap it adds);
- `double`: T(step with that family's launches issued twice in a row) - T(normal step). The
  second copy may find its inputs in L2, so it reads low for small operands;
- `gemm alone`: a graph of 20 back-to-back calls of one GEMM shape at this batch, cycling
  over enough weight copies (>= 3x the L2) that no call finds its weight in L2; TB/s is the
  weight bytes read per call / its time.
The normal step is re-timed between variants (alternating) so clock drift cancels. Removing
or doubling a family changes the numbers the step computes, not the work it does (sampling
always returns an index inside the vocabulary, so the next replay's embedding stays in range).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # vt and tools, from a checkout

from tools.bench_step import bench_inputs, copy_bandwidth      # noqa: E402
from vt.backend import get_backend                             # noqa: E402
from vt.backend.timing import timed_ms                            # noqa: E402
from vt.graphs import capture_warmed                              # noqa: E402
from vt.model import PRESETS, HybridModel, init_weights        # noqa: E402

_L2_BYTES = 50 << 20  # H100/H200 L2; the GEMM-alone weight copies cover at least 3x it
_GEMM_CALLS = 20


def family(kernel, args) -> str:
    """The family a launch belongs to: the kernel's name; GEMMs also by weight shape [N, K]."""
    if kernel.name == "gemm":
        return "gemm " + "x".join(map(str, args[1].shape))
    return kernel.name


class _Edit:
    """A backend proxy for the model that drops (repeat=0) or repeats the launches of one
    family, and records every launch (family, kernel, args, params) it sees."""

    def __init__(self, be, target: str | None = None, repeat: int = 1):
        self._be, self.target, self.repeat, self.seen = be, target, repeat, []

    def __getattr__(self, k):
        return getattr(self._be, k)

    def launch(self, s, kernel, *args, **params):
        fam = family(kernel, args)
        self.seen.append((fam, kernel, args, params))
        for _ in range(self.repeat if fam == self.target else 1):
            self._be.launch(s, kernel, *args, **params)


def _time_graph(be, s, g, iters, repeats) -> float:
    """Median over `repeats` of the mean device ms of one replay in `iters` back-to-back ones,
    after a warm-up replay."""
    return timed_ms(be, s, lambda: g.launch(s), iters, repeats, warmup=1)




def _step_graph(be, s, m, inp, logits, toks, name, target=None, repeat=1):
    ed = _Edit(be, target, repeat)

    def step():
        ed.seen.clear()
        m.be = ed
        try:
            m.decode(s, inp, logits)
            m.sample(s, logits, inp, toks)
        finally:
            m.be = be
    return capture_warmed(be, s, step, name), list(ed.seen)


def _gemm_alone(be, s, m, fam, kernel, args, params, iters, repeats):
    """ms per call and weight TB/s of one GEMM shape, cold-L2 weights (see module doc)."""
    x, w, out = args
    copies = [w]
    for _ in range(min(_GEMM_CALLS, math.ceil(3 * _L2_BYTES / w.nbytes)) - 1):
        c = be.empty(w.shape, w.dtype)
        be.copy_d2d(c, w, s)
        copies.append(c)

    def calls():
        for i in range(_GEMM_CALLS):
            be.launch(s, kernel, x, copies[i % len(copies)], out, **params)
    g = capture_warmed(be, s, calls, f"profile {fam} alone")
    ms = _time_graph(be, s, g, iters, repeats) / _GEMM_CALLS
    g.close()
    return ms, w.nbytes / (ms * 1e-3) / 1e12


def profile_batch(be, s, m, S, context, modes, iters, repeats):
    cfg = m.cfg
    inp = bench_inputs(be, s, m, S, context)
    logits = be.empty((S, cfg.vocab), np.float32, retained=True)
    toks = be.empty((S,), np.int32, retained=True)
    base, seen = _step_graph(be, s, m, inp, logits, toks, f"profile S={S}")
    fams: dict[str, list] = {}
    for fam, kernel, args, params in seen:
        fams.setdefault(fam, []).append((kernel, args, params))
    t_base = _time_graph(be, s, base, iters, repeats)
    rows = []
    for fam, launches in fams.items():
        row = dict(family=fam, launches=len(launches))
        for mode in modes:
            g, _ = _step_graph(be, s, m, inp, logits, toks, f"profile S={S} {mode} {fam}",
                               target=fam, repeat=0 if mode == "remove" else 2)
            tb, tv = [], []
            for _ in range(repeats):  # alternate so that clock drift cancels
                tb.append(_time_graph(be, s, base, iters, 1))
                tv.append(_time_graph(be, s, g, iters, 1))
            g.close()
            d = statistics.median(tb) - statistics.median(tv)
            row[mode] = d if mode == "remove" else -d
        if fam.startswith("gemm"):
            kernel, args, params = launches[0]
            row["alone_ms"], row["alone_tbs"] = _gemm_alone(be, s, m, fam, kernel, args, params,
                                                             iters, repeats)
        rows.append(row)
    base.close()
    key = modes[0]
    rows.sort(key=lambda r: -r[key])
    return t_base, rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench-dense", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=512, help="tokens already in each sequence")
    ap.add_argument("--mode", nargs="+", default=["remove", "double"], choices=["remove", "double"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="cuda")
    a = ap.parse_args(argv)
    cfg = PRESETS[a.preset]
    if not 0 <= a.context < cfg.max_context:
        ap.error(f"--context {a.context} must be in [0, {cfg.max_context}) for {a.preset}")
    t0 = time.perf_counter()
    be = get_backend(a.backend)
    s = be.stream(name="profile")
    S_max = max(a.batch)
    m = HybridModel(be, cfg, init_weights(cfg, seed=0), max_seqs=S_max,
                    num_kv_blocks=S_max * (-(-(a.context + 1) // cfg.kv_block_size)))
    bw = copy_bandwidth(be, s)
    print(f"{a.preset}: {m.weight_bytes / 1e9:.3f} GB of weights; copy {bw / 1e12:.3f} TB/s "
          f"(read + written); context {a.context}; set-up {time.perf_counter() - t0:.1f} s")
    for S in a.batch:
        t_base, rows = profile_batch(be, s, m, S, a.context, a.mode, a.iters, a.repeats)
        print(f"\nS={S}: captured step {t_base:.3f} ms  (weights {m.weight_bytes_read(S) / (t_base * 1e-3) / 1e12:.2f}"
              f" TB/s, ratio {m.weight_bytes_read(S) / (t_base * 1e-3) / bw:.3f})")
        hdr = "".join(f"{md + ' ms':>11}" for md in a.mode)
        print(f"  {'family':<22}{'n':>4}{hdr}{'%step':>7}{'alone ms/call':>15}{'TB/s':>7}")
        for r in rows:
            vals = "".join(f"{r[md]:11.4f}" for md in a.mode)
            alone = f"{r['alone_ms']:15.4f}{r['alone_tbs']:7.2f}" if "alone_ms" in r else ""
            print(f"  {r['family']:<22}{r['launches']:4d}{vals}{100 * r[a.mode[0]] / t_base:7.1f}{alone}")
        tot = sum(r[a.mode[0]] for r in rows)
        print(f"  sum of {a.mode[0]} deltas {tot:.3f} ms of {t_base:.3f} "
              f"(rest: graph launch + overlap)")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    m.close()
    be.close()


if __name__ == "__main__":
    main()
