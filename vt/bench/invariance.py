"""`vt bench --workload invariance`: the cost of LlamaDecoder(batch_invariant=True) on CUDA at
Llama-3-8B's shape, and a check of it, in one run on one GPU (random bf16 weights, every part
against the default decoder in the same run).

The parts (linear, attention, step) are
described in vt/bench/invariance_parts.py, which imports PyTorch; this module does not, so that
`vt bench --workload invariance --help` and its refusals work without it."""
from __future__ import annotations

import json

MAX_TOKENS = 2048   # a row's live or prompt tokens: the width of invariance_parts' block tables
PARTS = ("linear", "attention", "step")


def add_arguments(p) -> None:
    """The workload's flags."""
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                   help="what to time (default: all three)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32],
                   help="rows of the attention and step parts' decode steps")
    p.add_argument("--live", type=int, nargs="+", default=[256, 2048],
                   help=f"live tokens per row in the attention and step parts, 1 to {MAX_TOKENS}")
    p.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 512, 2048],
                   help="rows of x in the linear part")
    p.add_argument("--spans", type=int, nargs="*", default=[64, 256],
                   help="span lengths timed beside triton_invariant.SPAN")
    p.add_argument("--prompts", type=int, nargs="*", default=[128, 512, 2048],
                   help=f"prompt lengths of the attention and step parts, 1 to {MAX_TOKENS}")
    p.add_argument("--json", help="write the results here")


def check_arguments(args, error) -> None:
    """Each value checked before any work; error(message) refuses one."""
    bad = [n for n in args.live + args.prompts if not 1 <= n <= MAX_TOKENS]
    if bad:
        error(f"--live and --prompts must be 1..{MAX_TOKENS} tokens, got {bad[0]}")
    bad = [n for n in args.rows + args.m + args.spans if n < 1]
    if bad:
        error(f"--rows, --m and --spans must be positive, got {bad[0]}")
    from vt.backend import available_backends
    if "cuda" not in available_backends():
        error("--workload invariance needs a CUDA GPU (it times vt.torch's CUDA kernels)")


def run_and_report(args) -> int:
    """Each part asked for, printed as it runs; the JSON when asked for."""
    from vt.bench import invariance_parts as parts
    out = parts.run(args.parts, args.rows, args.live, args.m, args.spans, args.prompts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
