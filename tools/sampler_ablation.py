"""Where the sampler kernel's time goes for one mode: the kernel timed with one stage taken out
of its source (time variants that leave a stage out, and take differences). A variant's
tokens are wrong; only its time is read. Needs a GPU and PyTorch (the timing harness of
`vt bench --workload sampler`).

    python3 tools/sampler_ablation.py --mode temperature --S 32 128 --V 32000
    python3 tools/sampler_ablation.py --check      # every edit still applies (no GPU needed)

The variants edit the kernel source text (vt/sampling/kernels.py, device_code.py); each edit
must match exactly once, so a change to the kernel that moves a stage fails --check (a CPU
test runs it) instead of timing the wrong thing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # vt, from a checkout

from vt.sampling import kernels, sampler   # noqa: E402

_LOOP = ("  each_then<1>(x, c0, c1, [&](float v, int i) { race_add(r, __fmul_rn(v, inv_t), i, base); },\n"
         "            [&] { share_lo(r); });\n")
_FIRST_KEY = ("  race_add(r, __fmul_rn(unokey((u32)(best >> 32)), inv_t), "
              "(int)(0xffffffffu - (u32)best), base);\n" + _LOOP)
_PLAIN_REDUCE = _LOOP + "  return block_race(race_done(r, base));\n"
_SHARE = "  r.lo = unokey(__reduce_max_sync(__activemask(), okey(r.lo)));\n"
_MERGE = "const int won = plain ? merge_partials(w.pk + row * B, w.pi + row * B, B).i : 0;"
_FINE = "  if (__fadd_ru(z, race_bound(h1)) < r.lo) return;\n"
_HASH = "  return lowbias32(lowbias32((u32)i ^ (u32)key) + (u32)(key >> 32));\n"

# name -> [(text, replacement)]: what each variant leaves out of the plain-temperature path
VARIANTS = {
    "full": [],
    "no first key": [(_FIRST_KEY, _FIRST_KEY.split("\n", 1)[1])],   # the block max's exact key
    "no race loop": [(_LOOP, "")],                                    # the sweep over the chunk
    "no block reduce": [(_PLAIN_REDUCE, _LOOP + "  return race_done(r, base);\n")],   # the block's merge
    "no row merge": [(_MERGE, "const int won = 0;")],                 # the last block's merge
    "no fine bound": [(_FINE, "")],                                   # the crude bound only
    "no warp share": [(_SHARE, "")],                                  # each lane prunes alone
    "one hash round": [(_HASH, "  return lowbias32((u32)i ^ (u32)key ^ (u32)(key >> 32));\n")],
}


def edited(code: str, edits) -> str:
    for text, repl in edits:
        n = code.count(text)
        if n != 1:
            raise SystemExit(f"sampler_ablation: an edit matches {n} times in the kernel source "
                             f"(expected once); the kernel changed, update VARIANTS:\n{text}")
        code = code.replace(text, repl)
    return code


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="temperature", choices=["greedy", "top_k", "top_p", "temperature"])
    ap.add_argument("--S", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--V", type=int, nargs="+", default=[32000])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--check", action="store_true", help="only check that every edit applies")
    a = ap.parse_args(argv)
    codes = {name: edited(kernels.CODE, VARIANTS[name]) for name in a.variants}
    if a.check:
        print(f"sampler_ablation: {len(codes)} variants apply")
        return 0
    from vt.cli.bench.sampler import run_sampler_bench
    cells = [(V, S) for V in a.V for S in a.S]
    print(f"{a.mode}: us per call (vt bench's sampler harness), and the change from full")
    print(f"{'variant':<16} " + " ".join(f"{f'V={V} S={S}':>22}" for V, S in cells))
    full = None
    for name, code in codes.items():
        sampler.CODE = code   # the Sampler compiles what this names (cached per source text)
        rows = run_sampler_bench(a.S, a.V, [a.mode], log=lambda line: None)
        us = {(r["V"], r["S"]): r["vt_us"] for r in rows}
        full = full or (us if name == "full" else None)
        print(f"{name:<16} " + " ".join(
            f"{us[c]:>10.2f}" + (f" ({us[c] - full[c]:+7.2f})" if full else " " * 10).rjust(12)
            for c in cells), flush=True)
    sampler.CODE = kernels.CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
