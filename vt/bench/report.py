"""The bench's outputs: the printed tables, the JSON and the PNG (matplotlib: the bench extra)."""
from __future__ import annotations

import json
from pathlib import Path

from vt.atomic_file import atomic_open, write_text_atomic
from vt.bench.cells import HOST_PARTS
from vt.errors import VtError


def _f(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def _impls(res: dict) -> list[str]:
    """Column order: vt's modes, then the torch variants that were measured or marked absent."""
    seen = []
    for r in res["cells"]:
        if r["mode"] not in seen:
            seen.append(r["mode"])
    return [m for m in res["modes"] if m in seen] + [m for m in seen if m not in res["modes"]]


def _groups(res: dict):
    """(title, key of the rows' axis, [(axis value, {mode: row})]) per conc (synthetic) or preset."""
    out = []
    if res["workload"] == "synthetic":
        for conc in res["concs"]:
            rows = [r for r in res["cells"] if r["conc"] == conc]
            axis = sorted({r["spin_us"] for r in rows})
            out.append((f"S={conc}", "D us", [(d, {r["mode"]: r for r in rows if r["spin_us"] == d})
                                               for d in axis]))
    else:
        for preset in res["presets"]:
            rows = [r for r in res["cells"] if r["preset"] == preset]
            out.append((preset, "conc", [(c, {r["mode"]: r for r in rows if r["conc"] == c})
                                         for c in res["concs"]]))
    return out


def _ratios(r: dict | None, mode: str) -> str:
    """"to drain|to torch_async", and " e<overlap efficiency>" for vt's async modes."""
    if r is None or r["status"] != "ok":
        return "absent"
    s = f"{_f(r['ratio_to_drain'], '.2f')}|{_f(r['ratio_to_torch_async'], '.2f')}"
    if r["overlap_efficiency"] is not None and mode != "drain":
        s += f" e{r['overlap_efficiency']:.2f}"
    return s


def table(res: dict) -> str:
    impls = _impls(res)
    w = max(14, *(len(m) + 2 for m in impls))
    lines = []
    for title, axis, groups in _groups(res):
        lines += [f"{title}: us per decode step (fraction of its ceiling: its own graph replayed back "
                  f"to back); the ceiling column is drain's",
                  f"{axis:>6} " + "".join(f"{m:>{w}}" for m in impls) + f"{'ceiling':>{w}}"]
        for value, by in groups:
            cols = []
            for m in impls:
                r = by.get(m)
                cols.append(("absent" if r is None or r["status"] != "ok" else
                             f"{r['step_us']:.0f} ({_f(r['fraction_of_ceiling'], '.2f')})").rjust(w))
            ce = by.get("drain", {}).get("ceiling_us")
            lines.append(f"{value:>6g} " + "".join(cols) + _f(ce, ".0f").rjust(w))
        lines += ["", f"{title}: steps/s ratio to drain | to torch_async; e = overlap efficiency "
                      f"max(h, d) / T (vt; vt/bench/cells.py)",
                  None]
        ratios = [(value, [_ratios(by.get(m), m) for m in impls]) for value, by in groups]
        wr = max(w, *(len(s) + 2 for _, cols in ratios for s in cols))   # "1.56|1.47 e1.21"
        lines[-1] = f"{axis:>6} " + "".join(f"{m:>{wr}}" for m in impls)
        lines += [f"{value:>6g} " + "".join(s.rjust(wr) for s in cols) for value, cols in ratios]
        lines.append("")
    names = [*HOST_PARTS, "drain", "other", "host", "device", "idle", "machin.", "busy"]
    keys = [*(f"host_{p}_us" for p in HOST_PARTS), "host_drain_us", "host_other_us", "host_us",
            "device_us", "gpu_idle_us", "host_machinery_us", "host_busy_us"]
    lines += ["per cell, us per decode step: the host split of the profiled run (drain = drain "
              "waits; other = the rest of the loop), host = all but the waits, device, GPU idle, "
              "machinery = refresh + acquire + launch; busy = host time of the run without "
              "profiling, its waits excluded; prof/b = the profile's own cost, the median over repeats "
              "of a profiled run's host time over the unprofiled run's beside it; "
              "tokens right",
              f"{'cell':<32}" + "".join(f"{n:>9}" for n in names) + f"{'prof/b':>8}  ok"]
    for r in res["cells"]:
        if r["status"] != "ok":
            continue
        where = f"D={r['spin_us']:g}" if r["spin_us"] is not None else r["preset"]
        ok = r["tokens_ok"] if r["tokens_ok"] is not None else r["identical_to_drain"]
        lines.append(f"{r['mode'] + ' S=' + str(r['conc']) + ' ' + where:<32}"
                     + "".join(_f(r[k], ".1f").rjust(9) for k in keys)
                     + _f(r.get("profiled_host_ratio"), ".2f").rjust(8)   # absent before it existed
                     + f"  {'-' if ok is None else 'yes' if ok else 'NO'}")
    if not res["torch"]["available"]:
        lines.append(f"torch peer absent: {res['torch']['absent_reason']}")
    return "\n".join(lines)


def write_json(res: dict, path: str) -> None:
    write_text_atomic(path, json.dumps(res, indent=1))


def print_and_save(table_text: str, res: dict, json_path: str | None) -> None:
    """A workload's report: its table printed, its result written to json_path when given."""
    print(table_text)
    if json_path:
        write_json(res, json_path)


class BadResultFile(VtError, ValueError):
    """A --from-json file that is not a readable vt bench result (the CLI's usage error)."""


_NEEDED = {"format": str, "workload": str, "cells": list, "concs": list, "modes": list,
           "backend": str, "device": str, "torch": dict}


def load_json(path: str):
    """The parsed file, or BadResultFile saying why it cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise BadResultFile(f"{path!r} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    except json.JSONDecodeError as e:
        raise BadResultFile(f"{path!r} is not JSON ({e.msg} at line {e.lineno})") from None


def read_json(path: str, res=None) -> dict:
    """A saved result (`res`: already loaded from `path`), checked enough that printing and
    plotting it cannot fail half-way."""
    res = load_json(path) if res is None else res
    if not isinstance(res, dict) or res.get("format") != "vt-bench/1":
        got = res.get("format") if isinstance(res, dict) else type(res).__name__
        raise BadResultFile(f"{path!r} is not a vt bench result (format {got!r}, expected "
                            f"'vt-bench/1')")
    bad = [k for k, t in _NEEDED.items() if not isinstance(res.get(k), t)]
    if bad or res["workload"] not in ("synthetic", "model"):
        raise BadResultFile(f"{path!r} is a damaged vt bench result (field(s) "
                            f"{bad or ['workload']} missing or of the wrong type)")
    return res


def merge(results: list[dict]) -> dict:
    """Several runs of one workload as one result (e.g. one run per preset): cells, presets,
    concs, modes and D values united; the rest is the first run's."""
    first = dict(results[0])
    if any(r["workload"] != first["workload"] for r in results):
        raise BadResultFile("the --from-json results must all be of one workload")
    if len(results) == 1:
        return first
    first["cells"] = [c for r in results for c in r["cells"]]
    first["concs"] = sorted({c for r in results for c in r["concs"]})
    first["modes"] = list(dict.fromkeys(m for r in results for m in r["modes"]))
    for key in ("presets", "spin_us"):
        if first.get(key) is not None:
            first[key] = list(dict.fromkeys(v for r in results for v in r[key]))
    first["merged_from"] = [dict(vt_commit=r.get("vt_commit"), started=r.get("started"),
                                 presets=r.get("presets"), concs=r["concs"]) for r in results]
    return first


def write_png(res: dict, path: str) -> str | None:
    """Writes the figure; returns None, or why it could not (matplotlib missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    groups = _groups(res)
    synthetic = res["workload"] == "synthetic"
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.6), squeeze=False)
    for ax, (title, axis, rows) in zip(axes[0], groups):
        xs = [v for v, _ in rows]
        for m in _impls(res):
            pts = [(v, by[m]) for v, by in rows if m in by and by[m]["status"] == "ok"]
            if pts:
                key = "steps_per_s" if synthetic else "tokens_per_s"
                ax.plot([v for v, _ in pts], [r[key] for _, r in pts], marker="o",
                        linestyle="--" if m.startswith("torch") else "-", label=m)
        ceil = [(v, by["drain"]["ceiling_steps_per_s"]) for v, by in rows
                if "drain" in by and by["drain"]["ceiling_steps_per_s"]]
        if ceil:
            ax.plot([v for v, _ in ceil], [c * (1 if synthetic else v) for v, c in ceil], "k:",
                    linewidth=2, label="ceiling (drain's graph back to back)")
        if synthetic:
            ax.set_xscale("symlog", linthresh=25)
            ax.set(yscale="log", xlabel="D: device us per step (spin)",
                   ylabel="decode steps/s", title=f"synthetic, {title}")
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.xaxis.set_tick_params(which="minor", bottom=False)
        else:
            ax.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="decode tokens/s",
                   title=title)
            ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"vt bench on {res['backend']} {res['device']} ({res.get('vt_commit') or ''})")
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
    return None
