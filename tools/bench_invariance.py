"""The cost of HybridModel(batch_invariant=True), and a check of it at the bench presets' sizes.

    python3 tools/bench_invariance.py --preset bench-dense bench-moe --batch 1 32 [--json F]

Cost: the device time of one captured decode + sample step (graph replays timed with events,
median over repeats, as tools/bench_step.py), default model against batch_invariant=True,
same weights, --context tokens per sequence.

Check (both models; batch_invariant=True must give 0): random tokens, GDN states and KV cache; a reference decode of
all max_seqs rows at random context lengths; then --trials decodes of random row subsets
(random count, random order), each from the same states; every row's logits must match its
reference bytes. Prints and records the mismatching rows (0 expected).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout

from tools.bench_step import warmed_step                                 # noqa: E402
from vt.backend import get_backend                                       # noqa: E402
from vt.model import PRESETS, HybridModel, init_weights, upload_decode_inputs   # noqa: E402
from vt.model.kernels._common import to_storage                         # noqa: E402
from vt.step import kv_slot                                              # noqa: E402
from vt.backend.timing import timed_ms                                          # noqa: E402


def step_ms(be, s, m, S, context, iters, repeats):
    step, _, _ = warmed_step(be, s, m, S, context, f"invariance S={S}")
    with be.capture(s, name=f"invariance S={S}") as cap:
        step()
    g = cap.graph
    g.upload(s)
    ms = timed_ms(be, s, lambda: g.launch(s), iters, repeats, warmup=3)
    g.close()
    return ms


def _put(be, s, dst, host):
    pinned = be.pinned_empty(host.shape, host.dtype)
    pinned[...] = host
    be.copy_h2d(dst, pinned, s)
    s.synchronize()


def check(be, s, m, trials, rng):
    """Rows alone or in random subsets vs all rows at once: (rows compared, mismatching rows)."""
    cfg, R = m.cfg, m.max_seqs
    _put(be, s, m.token_table, rng.integers(0, cfg.vocab, R + 1).astype(np.int32))
    for c in (*m.k_cache.values(), *m.v_cache.values()):
        _put(be, s, c, to_storage(rng.standard_normal(c.shape), cfg.storage_dtype))
    states = {i: (rng.standard_normal(a.shape) * 0.3).astype(np.float32) for i, a in m.states.items()}
    bs, mb = cfg.kv_block_size, cfg.max_blocks_per_seq
    per = m.num_kv_blocks // R
    bt = np.full((R, mb), m.scratch_block, np.int32)
    for r in range(R):
        bt[r, :per] = np.arange(r * per, (r + 1) * per)
    pos = rng.integers(0, per * bs - 1, R).astype(np.int32)

    def decode(rows):
        for i, a in m.states.items():   # every decode starts from the same states
            _put(be, s, a, states[i])
        inp = upload_decode_inputs(be, s, token_rows=rows, positions=pos[rows], seq_lens=pos[rows] + 1,
                                   slot_mapping=kv_slot(bt[rows], pos[rows], bs), block_tables=bt[rows],
                                   state_idx=rows)
        out = be.empty((len(rows), cfg.vocab), np.float32)
        m.decode(s, inp, out)
        host = be.pinned_empty(out.shape, out.dtype)
        be.copy_d2h(host, out, s)
        s.synchronize()
        return np.array(host)

    ref = decode(np.arange(R, dtype=np.int32))
    compared = bad = 0
    for t in range(trials):
        S = 1 if t < 4 else int(rng.integers(1, R + 1))
        rows = rng.permutation(R)[:S].astype(np.int32)
        got = decode(rows)
        compared += S
        bad += sum(got[j].tobytes() != ref[r].tobytes() for j, r in enumerate(rows))
    return compared, bad


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", nargs="+", default=["bench-dense", "bench-moe"], choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--trials", type=int, default=24, help="row subsets checked per preset")
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    be = get_backend(a.backend)
    s = be.stream(name="invariance")
    out = {"device": be.info().get("device", ""), "context": a.context, "presets": {}}
    for preset in a.preset:
        cfg = PRESETS[preset]
        t0 = time.perf_counter()
        w = init_weights(cfg, seed=0)
        res = {"batch": {}}
        for inv in (False, True):
            m = HybridModel(be, cfg, w, max_seqs=a.max_seqs, batch_invariant=inv,
                            num_kv_blocks=a.max_seqs * -(-(a.context + 1) // cfg.kv_block_size))
            for S in a.batch:
                ms = step_ms(be, s, m, S, a.context, a.iters, a.repeats)
                res["batch"].setdefault(str(S), {})["invariant_ms" if inv else "default_ms"] = ms
            compared, bad = check(be, s, m, a.trials, np.random.default_rng(0))
            res["check_invariant" if inv else "check_default"] = {
                "rows_compared": compared, "mismatching_rows": bad, "trials": a.trials}
            m.close()
            del m
        for S, r in res["batch"].items():
            r["cost_pct"] = 100 * (r["invariant_ms"] / r["default_ms"] - 1)
            print(f"{preset} S={S:>3}: default {r['default_ms']:.4f} ms  invariant "
                  f"{r['invariant_ms']:.4f} ms  cost {r['cost_pct']:+.1f}%", flush=True)
        print(f"{preset}: rows differing from the all-rows run: default {res['check_default']}, "
              f"batch_invariant {res['check_invariant']}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        out["presets"][preset] = res
        del w
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    be.close()


if __name__ == "__main__":
    main()
