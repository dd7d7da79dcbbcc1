"""What the profile costs, against how much two identical runs differ: `vt bench --profile both`
with parts of the profile switched off in the profiled runs.

    python3 tools/profile_overhead.py VARIANT BENCH-ARGS...
    python3 tools/profile_overhead.py control --workload synthetic --device-us 0 \
        --conc 1 32 --modes drain ring --no-torch --repeats 9 --vocab 32000 --steps 3000

VARIANT: default (the profile as it ships); control (the "profiled" runs stay unprofiled: its
prof/b column is the noise floor of the comparison, identical runs of one engine); noevents
(no device timing events); nosplit (no timed iterations); sample16 (the first 16 iterations
of a busy period timed, then one in 16); sample64 (the first 64, then one in 64). prof/b is
the median over repeats of a profiled run against the unprofiled run beside it
(vt/cli/bench/measure.py). The variants patch vt's internals in this process only; vt itself
has no switch for them.
"""
import sys


def _patch(variant: str) -> None:
    if variant == "noevents":
        import vt.executor.timers as timers
        timers.SampledTimer._start = lambda self: None   # no device timing events
        timers.SampledTimer._end = lambda self, handle, pair: None
    elif variant == "nosplit":
        import vt.engine.profile as profile
        profile.LoopProfile.begin = lambda self: False
    elif variant in ("sample16", "sample64"):
        import vt.engine.profile as profile
        profile.EVERY = int(variant[6:])
        profile.FIRST = 16 if variant == "sample16" else 64
    elif variant == "control":
        import vt.engine.engine as engine
        engine.Engine.set_profile = lambda self, on: None   # the "profiled" runs stay unprofiled
    elif variant != "default":
        sys.exit(f"profile_overhead: unknown variant {variant!r} "
                 f"(default, control, noevents, nosplit, sample16, sample64)")


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        sys.exit(__doc__)
    _patch(argv[0])
    rest = argv[1:]
    from vt.cli.main import main as vt_main
    return vt_main(["bench", "--profile", "both", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
