"""Device time of one captured decode step, and weight bytes read over copy bandwidth.

    python3 tools/bench_step.py --preset bench-dense --batch 1 8 32 [--breakdown] [--json F]

For each batch size: capture decode + sample once (after an eager warm-up), replay it
back to back, time the replays with events (median over repeats). The bandwidth reference is
a device-to-device copy measured in the same run (bytes read + written, as docs/design.md counts it).
ratio = weight bytes / step time / copy bandwidth; `ratio_all` also counts the GDN state
(read + written) and the KV cache read at --context tokens per sequence.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout

from vt.backend import get_backend                                           # noqa: E402
from vt.step.contract import kv_slot                                              # noqa: E402
from vt.backend.timing import timed_ms                                          # noqa: E402
from vt.model import PRESETS, HybridModel, init_weights, upload_decode_inputs   # noqa: E402


def copy_bandwidth(be, s, nbytes=1 << 30):
    """Bytes read + written per second by a device-to-device copy of `nbytes`."""
    src, dst = be.empty((nbytes,), np.uint8), be.empty((nbytes,), np.uint8)
    be.copy_d2d(dst, src, s)
    ms = timed_ms(be, s, lambda: be.copy_d2d(dst, src, s), 5, 5)
    return 2 * nbytes / (ms * 1e-3)


class _Breakdown:
    """A backend proxy that times every launch with events (eager only)."""

    def __init__(self, be):
        self._be, self.pairs = be, []

    def __getattr__(self, k):
        return getattr(self._be, k)

    def launch(self, s, kernel, *args, **params):
        a, b = self._be.event(timing_enabled=True), self._be.event(timing_enabled=True)
        a.record(s)
        self._be.launch(s, kernel, *args, **params)
        b.record(s)
        shape = "x".join(map(str, args[1].shape)) if getattr(kernel, "name", "") == "gemm" else ""
        self.pairs.append((f"{kernel.name} {shape}".strip(), a, b))

    def report(self):
        tot = defaultdict(float)
        for name, a, b in self.pairs:
            b.synchronize()
            tot[name] += b.elapsed_ms(a)
        return dict(sorted(tot.items(), key=lambda kv: -kv[1]))


def bench_inputs(be, s, m, S, context):
    bs, mb = m.cfg.kv_block_size, m.cfg.max_blocks_per_seq
    per = -(-(context + 1) // bs)
    bt = np.full((S, mb), m.scratch_block, np.int32)
    for r in range(S):
        bt[r, :per] = np.arange(r * per, (r + 1) * per)
    pos = np.full(S, context, np.int32)
    return upload_decode_inputs(be, s, token_rows=np.arange(S), positions=pos, seq_lens=pos + 1,
                               slot_mapping=kv_slot(bt, pos, bs),
                               block_tables=bt, state_idx=np.arange(S))


def warmed_step(be, s, m, S, context, name):
    """One decode + sample step of S rows at `context` (bench_inputs), run once inside a scratch
    warm-up so that capturing it allocates nothing: (step, its inputs, its logits)."""
    inp = bench_inputs(be, s, m, S, context)
    logits = be.empty((S, m.cfg.vocab), np.float32, retained=True)
    toks = be.empty((S,), np.int32, retained=True)

    def step():
        m.decode(s, inp, logits)
        m.sample(s, logits, inp, toks)
    with be.pool.scratch_warmup(name):
        step()
        s.synchronize()
    return step, inp, logits


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench-dense", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=512, help="tokens already in each sequence")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--breakdown", action="store_true", help="per-kernel eager times at the largest batch")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    cfg = PRESETS[a.preset]
    if not 0 <= a.context < cfg.max_context:
        ap.error(f"--context {a.context} must be in [0, {cfg.max_context}) for {a.preset}")
    be = get_backend(a.backend)
    s = be.stream(name="bench")
    t0 = time.perf_counter()
    w = init_weights(cfg, seed=0)
    S_max = max(a.batch)
    m = HybridModel(be, cfg, w, max_seqs=S_max, num_kv_blocks=S_max * (-(-(a.context + 1) // cfg.kv_block_size)))
    del w
    print(f"{a.preset}: {m.weight_bytes / 1e9:.3f} GB of weights, set-up {time.perf_counter() - t0:.1f} s, "
          f"{be.info().get('device', '')}")
    bw = copy_bandwidth(be, s)
    print(f"device-to-device copy: {bw / 1e12:.3f} TB/s (read + written)")
    st_bytes = len(cfg.gdn_layers) * cfg.gdn_heads * cfg.gdn_dk * cfg.gdn_dv * 4 * 2
    kv_bytes = len(cfg.attn_layers) * cfg.kv_heads * cfg.head_dim * 2 * 2 * (a.context + 1)
    rows = []
    for S in a.batch:
        step, inp, logits = warmed_step(be, s, m, S, a.context, f"bench S={S}")
        eager_ms = timed_ms(be, s, step, 3, 3)
        with be.capture(s, name=f"bench decode S={S}") as cap:
            step()
        g = cap.graph
        g.upload(s)
        ms = timed_ms(be, s, lambda: g.launch(s), a.iters, a.repeats)
        wb = m.weight_bytes_read(S)   # a routed MoE step reads only the picked experts
        ab = wb + S * (st_bytes + kv_bytes)
        rows.append(dict(preset=a.preset, batch=S, step_ms=ms, eager_ms=eager_ms, weight_bytes=wb,
                         all_bytes=ab, copy_bw=bw, ratio=wb / (ms * 1e-3) / bw,
                         ratio_all=ab / (ms * 1e-3) / bw,
                         mallocs_during_capture=be.pool.stats().mallocs_during_capture))
        print(f"S={S:3d}  graph {ms:7.3f} ms/step  (eager {eager_ms:7.3f})  weights read "
              f"{wb / 1e9:.3f} GB {wb / (ms * 1e-3) / 1e12:5.2f} TB/s  ratio {rows[-1]['ratio']:.3f}  "
              f"ratio_all {rows[-1]['ratio_all']:.3f}  mallocs_during_capture "
              f"{rows[-1]['mallocs_during_capture']}")
        g.close()
    if a.breakdown:
        prox = _Breakdown(be)
        m.be = prox
        m.decode(s, inp, logits)
        m.be = be
        print(f"per-kernel eager device ms at S={S}:")
        for name, t in list(prox.report().items())[:25]:
            print(f"  {t:8.4f}  {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    m.close()
    be.close()


if __name__ == "__main__":
    main()
