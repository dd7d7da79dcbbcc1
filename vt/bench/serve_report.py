"""The serve bench's outputs: the printed table and the PNG (latency percentiles against load,
one line per mode). A cell's `via` says how its requests came: "engine" (Engine.submit in the
bench's process) or "http" (streamed completions against a running vt serve); an HTTP cell
has "-" where only the engine knows (device time, the prefill split, drain causes)."""
from __future__ import annotations

import json

from vt.bench.serve import LATENCY_METRICS


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(res: dict) -> str:
    tokens = ("tokens compared across modes (batch-invariant model)" if res.get("tokens_compared")
              else "tokens not compared across modes: the model is not batch-invariant here "
                   "(VT_BATCH_INVARIANT=1 makes it so)")
    profiled = "engines profiled (device timing events); " if res.get("profiled", True) else ""
    if res.get("url"):
        profiled = ""
        tokens = f"through HTTP against {res['url']} (vt serve); tokens not compared"
    lines = [f"serve: {res['requests']} requests per cell, output {res['output_len']}, prompt "
             f"{res['prompt_len']} tokens; {profiled}{tokens}",
             f"{'preset':<12} {'via':<6} {'arrival':<8} {'load':>5} {'mode':<7} {'tok/s':>8} {'x drain':>7} "
             f"{'req/s':>6} {'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'ITL p99':>8} "
             f"{'busy':>5} {'drained':>7} {'prefill dev/host ms':>19}  drains after"]
    for r in res["cells"]:
        lines.append(
            f"{r['preset']:<12} {r.get('via', 'engine'):<6} {r['arrival']:<8} {r['load']:>5g} {r['mode']:<7} "
            f"{r['output_tok_per_s']:8.1f} {_f(r['output_tok_per_s_to_drain'], '7.3f')} "
            f"{r['requests_per_s']:6.2f} "
            f"{_f(r['ttft_ms_p50'], '.1f'):>7}/{_f(r['ttft_ms_p99'], '.1f'):<8} "
            f"{_f(r['tpot_ms_p50'], '.2f'):>7}/{_f(r['tpot_ms_p99'], '.2f'):<8} "
            f"{_f(r['itl_ms_p99'], '8.2f')} {_f(r['gpu_busy'], '5.2f')} "
            f"{_f(r['drained_fraction'], '7.3f')} {_prefill_ms(r):>19}  {r['drains_after'] or '-'}"
            + ("" if r["tokens_identical_to_drain"] is not False else "  WRONG TOKENS"))
    paired = [r for r in res["cells"] if len(r.get("output_tok_per_s_to_drain_runs") or []) > 1
              and r["mode"] != "drain"]
    if paired:   # results saved before --repeats applied to serve have no runs
        lines.append("x drain per repeat (each run against drain's run of the same repeat; "
                     "TPOT and TTFT as drain's / this mode's, so > 1 is better too):")
        lines += [f"  {r['preset']} {r['arrival']} {r['load']:g} {r['mode']}: tok/s "
                  + _runs(r["output_tok_per_s_to_drain_runs"], invert=False)
                  + "  TPOT p50 " + _runs(r.get("tpot_ms_p50_to_drain_runs"), invert=True)
                  + "  TTFT p99 " + _runs(r.get("ttft_ms_p99_to_drain_runs"), invert=True)
                  for r in paired]
    return "\n".join(lines)


def _runs(ratios, *, invert: bool) -> str:
    """Per-repeat ratios to drain ("-" where absent: results saved before they were kept)."""
    if not ratios:
        return "-"
    return " ".join("-" if x is None else f"{(1 / x if invert and x else x):.3f}" for x in ratios)


def _prefill_ms(r: dict) -> str:
    """A step that prefills: its mean device time and the host's time to enqueue it, both
    over every such step (results saved before eager_launch_s averaged the timed iterations
    only, which a call's first wave dominates; older ones show '-')."""
    ph = r.get("phases", {}).get("prefill", {})
    dev = ph["device_ms"] / ph["device_steps"] if ph.get("device_steps") else None
    n = (r.get("mixed_steps") or 0) + (r.get("prefill_steps") or 0)   # None: through HTTP
    if r.get("eager_launch_s") is not None and n and not r.get("eager_steps"):
        host = 1e3 * r["eager_launch_s"] / n
    else:
        host = 1e3 * ph["launch_s"] / ph["timed_steps"] if ph.get("timed_steps") else None
    return f"{_f(dev, '.2f')}/{_f(host, '.2f')}"


def write_json(res: dict, path: str) -> None:
    from vt.atomic_file import write_text_atomic
    write_text_atomic(path, json.dumps(res, indent=1))


def write_png(res: dict, path: str) -> str | None:
    """Per (preset, arrival): TTFT, TPOT and ITL at p50 (solid) and p99 (dashed) against the
    load, one colour per mode. Returns None, or why it could not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    groups = sorted({(r["preset"], r["arrival"]) for r in res["cells"]})
    fig, axes = plt.subplots(len(groups), 3, figsize=(15, 4 * len(groups)), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row_axes, (preset, arrival) in zip(axes, groups):
        rows = [r for r in res["cells"] if (r["preset"], r["arrival"]) == (preset, arrival)]
        for ax, metric in zip(row_axes, LATENCY_METRICS):
            for k, mode in enumerate(res["modes"]):
                pts = sorted((r["load"], r) for r in rows if r["mode"] == mode)
                for p, style in ((50, "-"), (99, "--")):
                    ys = [r[f"{metric}_p{p}"] for _, r in pts]
                    if pts and None not in ys:
                        ax.plot([x for x, _ in pts], ys, style, marker="o",
                                color=colours[k % len(colours)],
                                label=f"{mode} p{p}")
            ax.set(xlabel="concurrent clients" if arrival == "closed" else "arrivals per s",
                   ylabel=f"{metric.split('_')[0].upper()} ms",
                   title=f"{preset}, {arrival}: {metric.split('_')[0].upper()}")
            ax.grid(alpha=0.3)
        row_axes[0].legend(fontsize=7)
    fig.tight_layout()
    from vt.atomic_file import atomic_open
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return None


FORMAT = "vt-bench-serve/1"
_NEEDED = {"cells": list, "modes": list, "presets": list, "requests": int, "output_len": list,
           "prompt_len": list}


def read_results(paths: list[str], loaded: list) -> dict:
    """Saved serve results (`loaded`: the files parsed) as one: cells and modes united, tokens
    compared only if every run compared them. BadResultFile names the first bad file."""
    from vt.bench.report import BadResultFile
    for path, res in zip(paths, loaded):
        if not isinstance(res, dict) or res.get("format") != FORMAT:
            got = res.get("format") if isinstance(res, dict) else type(res).__name__
            raise BadResultFile(f"{path!r} is not a vt bench serve result (format {got!r}); "
                                f"--from-json takes results of one workload")
        bad = [k for k, t in _NEEDED.items() if not isinstance(res.get(k), t)]
        if bad:
            raise BadResultFile(f"{path!r} is a damaged vt bench serve result (field(s) {bad} "
                                f"missing or of the wrong type)")
    merged = dict(loaded[0])
    if len(loaded) > 1:
        merged["cells"] = [c for r in loaded for c in r["cells"]]
        merged["modes"] = list(dict.fromkeys(m for r in loaded for m in r["modes"]))
        merged["presets"] = list(dict.fromkeys(p for r in loaded for p in r["presets"]))
        merged["tokens_compared"] = all(r.get("tokens_compared") for r in loaded)
        merged["merged_from"] = [dict(vt_commit=r.get("vt_commit"), started=r.get("started"),
                                      presets=r["presets"]) for r in loaded]
    return merged
