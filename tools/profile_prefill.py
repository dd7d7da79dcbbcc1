"""Where a step that prefills spends its time: the host enqueueing it, or the device running it.

    python3 tools/profile_prefill.py --preset bench-small --seqs 1 4 --prompt-len 16 40 64

Serving's steps that prefill cost the bundled model many decode steps each (docs/benchmarks.md,
section 7), and their measured device time moved with the host's speed between two calls. For
each (seqs, prompt length) this prefills `seqs` prompts through the bundled model's step model,
padded as serving pads them (max_seqs + 1 sequences, a power-of-two token bucket), and reports
in ms per prefill:
- host: the host's time to enqueue one (HybridStepModel.prefill returning, the device still
  running): building the padded inputs, their uploads and every kernel launch;
- eager: prefills enqueued back to back, timing events around them (what the engine's profile
  reports for such a step): the device's work plus every gap the host leaves;
- graph: the same prefill captured once as a CUDA graph and replayed back to back: the
  device's work alone.
eager well above graph: the step is bound by its launches, which a captured prefill would
remove. graph near eager: the device's work sets it (the GDN kernel walks a prompt's tokens one
by one; a chunked GDN prefill would cut it).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # vt, from a checkout

from vt.backend import get_backend                             # noqa: E402
from vt.backend.timing import timed_ms                         # noqa: E402
from vt.graphs import capture_warmed                           # noqa: E402
from vt.forward.hybrid import HybridStepModel                  # noqa: E402
from vt.model import PRESETS, HybridModel, init_weights        # noqa: E402
from vt.step.contract import PrefillSeq                        # noqa: E402


def prompts(rng, m, n: int, length: int) -> list[PrefillSeq]:
    """n prompts of `length` tokens on rows 0..n-1, each row its own run of KV blocks."""
    mb = m.cfg.max_blocks_per_seq
    return [PrefillSeq(row=i, tokens=rng.integers(0, m.cfg.vocab, length).astype(np.int32),
                       block_table=np.arange(i * mb, (i + 1) * mb, dtype=np.int32), state_idx=i)
            for i in range(n)]


def profile(be, s, sm, seqs, iters: int, repeats: int) -> dict:
    logits = be.empty((len(seqs), sm.vocab), np.float32, retained=True)

    def prefill():
        sm.prefill(s, seqs, logits)

    host = []
    for _ in range(repeats):
        s.synchronize()
        t0 = time.perf_counter()
        prefill()
        host.append(1e3 * (time.perf_counter() - t0))
    s.synchronize()
    eager = timed_ms(be, s, prefill, iters, repeats, warmup=1)
    g = capture_warmed(be, s, prefill, f"prefill {len(seqs)}x{len(seqs[0].tokens)}")
    try:
        graph = timed_ms(be, s, lambda: g.launch(s), iters, repeats, warmup=1)
    finally:
        g.close()
    return dict(host_ms=statistics.median(host), eager_ms=eager, graph_ms=graph)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cuda", choices=["cuda", "sim"])
    ap.add_argument("--preset", default="bench-small", choices=sorted(PRESETS))
    ap.add_argument("--max-seqs", type=int, default=64, help="the model's rows (serving pads to this + 1)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[16, 40, 64])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    cfg = PRESETS[a.preset]
    if max(a.seqs) > a.max_seqs or max(a.prompt_len) > cfg.max_context:
        ap.error(f"--seqs must be <= --max-seqs ({a.max_seqs}) and --prompt-len <= the preset's "
                 f"max_context ({cfg.max_context})")
    be = get_backend(a.backend)
    rng = np.random.default_rng(0)
    m = HybridModel(be, cfg, init_weights(cfg, seed=0), max_seqs=a.max_seqs,
                    num_kv_blocks=a.max_seqs * cfg.max_blocks_per_seq)
    sm, s = HybridStepModel(be, m), be.stream(name="profile-prefill")
    rows = []
    print(f"{a.preset} on {be.name}, max_seqs={a.max_seqs}: ms per prefill")
    print(f"{'seqs':>4} {'len':>4} {'host':>8} {'eager':>8} {'graph':>8}")
    for n in a.seqs:
        for length in a.prompt_len:
            row = dict(seqs=n, prompt_len=length, **profile(be, s, sm, prompts(rng, m, n, length),
                                                            a.iters, a.repeats))
            rows.append(row)
            print(f"{n:>4} {length:>4} {row['host_ms']:8.3f} {row['eager_ms']:8.3f} {row['graph_ms']:8.3f}",
                  flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(preset=a.preset, backend=be.name, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
