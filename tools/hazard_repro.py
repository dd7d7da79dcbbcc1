"""Reproduce the host-overwrite hazard and show the ring prevents it: the same workload in
four arms.

  DRAIN              mode drain (single slot per size, drain): the reference
  RING+POISON        mode ring (slot ring, drain skipped for graph steps), host vectors
                     poisoned as early as the ring lets the host write them: must match DRAIN
  UNGUARDED+POISON   mode unguarded (single slot, drain skipped), poison right after each
                     launch: mismatches
  UNGUARDED          the same without poison (on a delayed sim; on a GPU only if the host wins)

Each decode is preceded by --device-work-ms of queued device time (be.busy_wait,
vt.hooks.with_device_work), so the host runs ahead of the device on any backend. Prints the
mismatch counts (requests whose tokens or logits bytes differ from DRAIN) and exits 1 if a
safe mode mismatched or the unsafe arm was not detected.

  python tools/hazard_repro.py --backend sim --model toy
  python tools/hazard_repro.py --backend cuda --model tiny-moe --conc 32 --runs 5
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
from vt.backend import get_backend
from vt.engine.engine import Engine
from vt.config import ExecutorConfig
from vt.hooks import NULL_HOOKS, Poison, with_device_work

ARMS = {   # arm -> (mode, poison)
    "DRAIN": ("drain", False),
    "RING+POISON": ("ring", True),
    "UNGUARDED+POISON": ("unguarded", True),
    "UNGUARDED": ("unguarded", False),
}


def build_step_model(be, name: str, device_work_s: float):
    if name == "toy":
        from vt.forward.toy import ToyForward
        return with_device_work(ToyForward(be).step_model(), device_work_s), None
    from vt.forward.hybrid import HybridStepModel
    from vt.bundled import PRESETS, HybridModel, init_weights
    cfg = PRESETS[name]
    model = HybridModel(be, cfg, init_weights(cfg, seed=0), max_seqs=64, num_kv_blocks=512)
    return with_device_work(HybridStepModel(be, model), device_work_s), model


def run_arm(args, arm: str, prompts, budgets):
    sim_delay = args.sim_delay_ms / 1e3 if args.backend == "sim" else 0.0
    be = get_backend(args.backend, device_delay_s=sim_delay)
    mode, poison = ARMS[arm]
    try:
        step, model = build_step_model(be, args.model,
                                       0.0 if arm == "DRAIN" else args.device_work_ms / 1e3)
        config = ExecutorConfig(mode=mode, serving_conc=args.conc)
        with Engine(be, step, config, hooks=Poison() if poison else NULL_HOOKS,
                    record_logits=True) as eng:
            results = eng.generate(prompts, max_new_tokens=budgets)
            stats = eng.stats()
        if model is not None:
            model.close()
        return results, stats
    finally:
        be.close()


def mismatches(ref, got) -> int:
    return sum(a.tokens != b.tokens or a.logits.tobytes() != b.logits.tobytes()
               for a, b in zip(ref, got))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="auto", choices=["auto", "sim", "cuda"])
    p.add_argument("--model", default="toy", help="toy | tiny-dense | tiny-moe | bench-dense | bench-moe")
    p.add_argument("--conc", type=int, default=32)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-new", type=int, default=12)
    p.add_argument("--runs", type=int, default=1, help="repeat every unsafe/safe arm this often")
    p.add_argument("--device-work-ms", type=float, default=2.0)
    p.add_argument("--sim-delay-ms", type=float, default=1.0, help="sim only: delay per device op")
    p.add_argument("--json", help="also write the counts here")
    args = p.parse_args(argv)
    if args.backend == "auto":
        from vt.backend import available_backends
        args.backend = "cuda" if "cuda" in available_backends() else "sim"

    if args.model == "toy":
        from vt.forward.toy import ToyForward
        vocab = ToyForward.DEFAULT_VOCAB
    else:
        from vt.bundled import PRESETS
        vocab = PRESETS[args.model].vocab
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, size=int(rng.integers(1, 9))) for _ in range(args.requests)]
    budgets = [int(b) for b in rng.integers(args.max_new // 2, args.max_new + 1, size=args.requests)]

    ref, _ = run_arm(args, "DRAIN", prompts, budgets)
    counts = {}
    print(f"backend={args.backend} model={args.model} conc={args.conc} requests={args.requests} "
          f"device_work={args.device_work_ms} ms" +
          (f" sim_delay={args.sim_delay_ms} ms/op" if args.backend == "sim" else ""))
    for arm in ARMS:
        if arm == "DRAIN":
            continue
        counts[arm] = []
        for _ in range(args.runs):
            got, st = run_arm(args, arm, prompts, budgets)
            counts[arm].append(mismatches(ref, got))
        print(f"  {arm:<17} mismatched requests per run: {counts[arm]} of {args.requests}  "
              f"(graph steps {st['graph_steps']}, drains {st['drains']}, ring waits {st['ring_waits']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(vars(args), counts=counts), f, indent=1)
    safe_ok = not any(counts["RING+POISON"])
    detected = all(c > 0 for c in counts["UNGUARDED+POISON"])
    print(f"ring safe: {safe_ok}; unsafe arm detected every run: {detected}")
    return 0 if safe_ok and detected else 1


if __name__ == "__main__":
    sys.exit(main())
