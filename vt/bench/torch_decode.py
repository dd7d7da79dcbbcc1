"""`vt bench --workload torch-decode`: a torch Llama decoder's decode step served by vt,
against its memory-bandwidth floor, in one run, printed as one table.

A decode step of S rows must read every weight once and each row's live KV once, so

    floor = (weight bytes + S x live KV bytes) / the floor rate

with the floor rate the faster of two memory-bound kernels measured in the same run: a
device-to-device copy (bytes read + written per second) and a sum (bytes read per second). The weight bytes are every parameter but the embedding (of which a step reads S
rows), the head included; a tied head counts the embedding once.

Per rows S (--rows) and live context L (--live), one engine (--mode, default ring) on one
decoder of geometry max_context --max-context:
- vt TPOT: S requests with prompts of L - steps/2 tokens submitted together, --steps + 1 new
  tokens each, so that the mean live context of the timed steps is L. Prompts are prefilled
  in chunks of --prefill-chunk tokens while the first rows decode, and the earlier requests
  get as many more tokens as they start steps earlier, so that all end on one step. The time
  per output token counts only the steps every row runs (from the last first token to the
  first last token): per request, time over its tokens in that window, the median over the
  requests, then the median over --repeats;
- ceiling: the same captured graph of S rows replayed back to back (Engine.device_ceiling_us:
  the fullest of the size's last steps, which is the run's last, full step at the longest
  context);
- graph loop: the same module in the hand-written depth-2 torch.cuda.CUDAGraph loop of
  `vt bench --workload torch` (torch_workload.TorchLlamaPeer, argmax as its sampler), timed
  over the same positions. Its cache holds no prompt (a decode step's cost does not depend on
  the cached values), so it runs no prefill;
- transformers `generate` where it imports and --hf-rows has S: (generate of --steps + 1 new
  tokens - generate of 1) / steps after an L - steps/2 token prompt; eager (its dynamic
  cache) and with its static cache, which on a GPU compiles the decode forward into CUDA
  graphs (`--hf-cache`; the first, longest generate is the compile's warm-up).

`--speculative oracle|ngram|draft` compares speculative decoding with decoding without it
instead (vt/bench/speculative_decode.py; draft with `--draft-layers N`).

`--preset tiny` runs a small fp32 decoder anywhere (the sim too, with no floor): the tool's own
test. `--png` draws TPOT against rows with the floor for each live context.
"""
from __future__ import annotations

import gc
import statistics
import sys
import time


def add_arguments(p) -> None:
    """The workload's flags: the torch tools' shared ones and its own."""
    from vt.bench.torch_workload import add_precision_arguments, add_tool_arguments
    add_tool_arguments(p)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64], help="rows per step")
    p.add_argument("--live", type=int, nargs="+", default=[256, 2048],
                   help="mean live context of the timed steps, tokens per row")
    p.add_argument("--max-context", type=int, default=4096, help="the geometry's max_context")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per run (even)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-chunk", type=int, default=16384,
                   help="max_prefill_tokens of the engine (default 16384)")
    p.add_argument("--hf-rows", type=int, nargs="*", default=[1],
                   help="rows at which transformers' eager generate is timed (default 1; none: skip)")
    p.add_argument("--hf-cache", nargs="+", choices=["dynamic", "static"],
                   default=["dynamic", "static"],
                   help="transformers' caches to time: dynamic (eager) and static (compiled on "
                        "a GPU); default both")
    p.add_argument("--no-peer", action="store_true", help="leave the torch graph loop out")
    add_precision_arguments(p)
    from vt.bench import speculative_decode
    speculative_decode.add_arguments(p)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--png", default=None, help="also draw TPOT against rows here (matplotlib)")


def check_arguments(args, error) -> None:
    """Each value checked before any work; error(message) refuses one."""
    bad = [f"--rows {s}" for s in args.rows if s < 1] + [f"--live {n}" for n in args.live if n < 1]
    if bad:
        error(f"{', '.join(bad)}: rows and live context must be positive")
    if args.steps < 2 or args.steps % 2 or args.repeats < 1 or args.prefill_chunk < 1:
        error("--steps must be even and >= 2, --repeats and --prefill-chunk positive")
    for n in args.live:
        prompt = n - args.steps // 2
        longest = prompt + max(staggered_budgets(max(args.rows), max(prompt, 1),
                                                 args.prefill_chunk, args.steps))
        if prompt < 1 or longest > args.max_context:
            error(f"--live {n} with --steps {args.steps} needs prompts of {prompt} tokens and "
                  f"contexts up to {longest} within --max-context {args.max_context}")
    if args.png and not args.png.endswith(".png"):
        error(f"--png {args.png!r}: the name must end in .png")
    from vt.bench import speculative_decode
    speculative_decode.check_arguments(args, error)


def run_and_report(args) -> int:
    """Run, print the table, write the JSON (and the PNG) when asked for."""
    from vt.bench.report import print_and_save
    result = run(args)
    if args.speculative:
        from vt.bench.speculative_decode import format_table as speculative_table
        print_and_save(speculative_table(result), result, args.json)
        failed = result["speculative"]["failure"]
        if failed:   # after the table and the JSON, which show what went wrong
            print(failed, file=sys.stderr)
            return 1
    else:
        print_and_save(format_table(result), result, args.json)
    if args.png:
        write_png(result, args.png)
    return 0


def run(args) -> dict:
    import torch

    from vt.bench.torch_workload import tool_setup
    be, cfg, dtype, common = tool_setup(args.preset, args.backend)
    cuda = be.name == "cuda"
    out = dict(common, mode=args.mode, max_context=args.max_context, steps=args.steps,
               repeats=args.repeats, cells=[])
    try:
        rates = bandwidths() if cuda else {}
        out["copy_Bps"], out["read_Bps"] = rates.get("copy"), rates.get("read")
        # the floor: the faster of the two moves bytes at the rate the chip can surely reach
        out["floor_Bps"] = max(rates.values()) if rates else None
        if args.speculative:   # instead of the floor table (vt/bench/speculative_decode.py)
            from vt.bench import speculative_decode
            speculative_decode.run(be, cfg, dtype, args, out)
            return out
        _run_vt(be, cfg, dtype, args, out)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()   # the peer's weights need the memory
        out["hf"] = _run_hf(cfg, dtype, cuda, args) if args.hf_rows else {}
    finally:
        be.close()
    return out


def _run_vt(be, cfg, dtype, args, out) -> None:
    import torch

    from vt.bench.torch_ttft import seeded_prompts
    from vt.bench.torch_workload import TorchLlamaPeer, tool_decoder, whole_context_geometry
    from vt.engine import Engine
    from vt.config import ExecutorConfig
    from vt.torch import TorchForwardModel
    rows = sorted(set(args.rows))
    geo = whole_context_geometry(rows[-1], args.max_context)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    module = tool_decoder(cfg, geo, dtype, be, args, "torch_decode")
    out["kernels"], out["linear"] = module.kernels, module.linear
    out["prompt_kernels"] = module.prompt_kernels
    out["quantization"] = module.quantization
    out["weight_bytes"] = weight_bytes(module)
    out["dense_weight_bytes"] = weight_bytes(module, dense=True)
    out["kv_cache_dtype"] = module.kv_cache_dtype
    # K and V of every layer for one token, as the cache holds them (FP8: a byte an element)
    # and in the module's dtype (the dense floor's)
    out["kv_bytes_per_token"] = 2 * cfg.layers * cfg.kv_heads * cfg.head_dim * (
        module.k_cache.element_size())
    out["dense_kv_bytes_per_token"] = 2 * cfg.layers * cfg.kv_heads * cfg.head_dim * (
        dtype.itemsize)
    out["embed_row_bytes"] = cfg.hidden * dtype.itemsize
    model = TorchForwardModel(be, module, vocab=cfg.vocab, geometry=geo, prefill="flat")
    config = ExecutorConfig(mode=args.mode, serving_conc=rows[-1], capture_sizes=tuple(rows))
    peer_ok = be.name == "cuda" and not args.no_peer
    with Engine(be, model, config, max_prefill_tokens=args.prefill_chunk) as eng:
        out["setup_s"] = time.perf_counter() - t0
        print(f"torch_decode: {args.preset} set up in {out['setup_s']:.1f} s "
              f"(kernels {module.kernels}, mode {args.mode})", flush=True)
        for live in args.live:
            for S in rows:
                tc = time.perf_counter()
                prompts = seeded_prompts(cfg.vocab, S, live - args.steps // 2, S * 100003 + live)
                _decode_tpot(eng, prompts, args.steps, args.prefill_chunk)   # warm
                tpot = statistics.median(_decode_tpot(eng, prompts, args.steps, args.prefill_chunk)
                                         for _ in range(args.repeats))
                cell = dict(rows=S, live=live, tpot_s=tpot, ceiling_s=eng.device_ceiling_us(S) / 1e6)
                if peer_ok:
                    peer = TorchLlamaPeer(module, S)
                    try:
                        cell["graph_loop_s"] = statistics.median(
                            peer.time_decode("torch_async", live - args.steps // 2, args.steps)
                            for _ in range(args.repeats))
                    finally:
                        peer.close()
                        del peer
                out["cells"].append(cell)
                print(f"  S={S:3d} live={live:5d}: vt {1e3 * tpot:7.3f} ms"
                      + (f", graph loop {1e3 * cell['graph_loop_s']:7.3f} ms" if peer_ok else "")
                      + f" ({time.perf_counter() - tc:.1f} s)", flush=True)


def staggered_run(eng, prompts, steps: int, chunk: int) -> list:
    """Every prompt with its staggered budget, enqueued at once (Engine.generate: submitted
    one by one, the first requests would be planned alone while the others arrive, and end
    steps apart); each request's token_times."""
    budgets = staggered_budgets(len(prompts), len(prompts[0]), chunk, steps)
    return [r.token_times for r in eng.generate(prompts, max_new_tokens=budgets)]


def _decode_tpot(eng, prompts, steps: int, chunk: int) -> float:
    """Seconds per pure decode step of len(prompts) rows (the module docstring)."""
    times = staggered_run(eng, prompts, steps, chunk)
    # Only the steps that every row runs: from the last first token to the first last token.
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    per = []
    for t in times:
        window = [x for x in t if start <= x <= end]
        if len(window) > 1:
            per.append((window[-1] - window[0]) / (len(window) - 1))
    if not per:
        raise RuntimeError("torch_decode: no step ran with every row decoding")
    return statistics.median(per)


def staggered_budgets(n: int, prompt_len: int, chunk: int, steps: int) -> list[int]:
    """New tokens per request so that all n end on the same step: prompts prefill in
    submission order, `chunk` tokens a step, so request i's first token comes at step
    ((i + 1) * prompt_len - 1) // chunk when all are enqueued together (staggered_run); the
    earlier ones decode the more. The last step is then a full one, which
    Engine.device_ceiling_us replays."""
    first = [((i + 1) * prompt_len - 1) // chunk for i in range(n)]
    return [steps + 1 + first[-1] - f for f in first]


def weight_bytes(module, dense: bool = False) -> int:
    """Bytes a decode step reads of the weights (the state dict: FP8 codes and their scales
    too), the embedding aside (a step reads S of its rows; a tied head reads it whole).
    dense: what the same weights take in the module's dtype, without scales (an FP8
    decoder's bf16 floor)."""
    itemsize = module.embed.weight.element_size()
    total = 0
    for n, t in module.state_dict().items():
        if n.startswith("embed.") or dense and n.endswith(".weight_scale"):
            continue
        total += t.numel() * (itemsize if dense and n.endswith(".qweight") else t.element_size())
    if module.lm_head is None:
        total += module.embed.weight.numel() * module.embed.weight.element_size()
    return total


def _fp8(r: dict) -> bool:
    """FP8 weights or an FP8 KV cache: the run has a dense floor beside its own."""
    return bool(r.get("quantization")) or r.get("kv_cache_dtype") == "fp8"


def floor_s(r: dict, rows: int, live: int, dense: bool = False) -> float | None:
    """The decode step's floor in seconds (the module docstring); None without a copy rate.
    dense: with the weights and the KV cache in the module's dtype (an FP8 run's bf16
    floor)."""
    if not r.get("floor_Bps"):
        return None
    weights = r["dense_weight_bytes"] if dense else r["weight_bytes"]
    kv = r.get("dense_kv_bytes_per_token", r["kv_bytes_per_token"]) if dense else (
        r["kv_bytes_per_token"])
    read = weights + rows * (r["embed_row_bytes"] + live * kv)
    return read / r["floor_Bps"]


def bandwidths() -> dict:
    """Bytes per second of two memory-bound kernels on 2 GiB, eager, back to back, timed with
    events (the median of 10): `copy`, a device-to-device copy counting bytes read and
    written; `read`, a float32-accumulated sum, counting bytes read. (A copy captured in a
    graph becomes a copy-engine node, slower than either: it is not a floor.)"""
    import torch
    a = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    out = {}
    for name, fn, moved in (("copy", lambda: b.copy_(a), 2 * 2**31),
                            ("read", lambda: a.sum(dtype=torch.float32), 2**31)):
        fn()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[name] = moved / statistics.median(times)
    return out


def _run_hf(cfg, dtype, cuda: bool, args) -> dict:
    """transformers' eager generate per --hf-rows and live context: TPOT (or why not)."""
    from vt.bench.torch_ttft import hf_generate_s, hf_llama, seeded_prompts
    try:
        model, label = hf_llama(cfg, dtype, "cuda" if cuda else "cpu", args.max_context)
    except ImportError as exc:   # the peer is optional
        return dict(error=f"transformers does not import ({exc})")
    import torch
    out = dict(impl=label, cells=[])
    for cache in args.hf_cache:
        for live in args.live:
            for S in args.hf_rows:
                ids = torch.tensor(seeded_prompts(cfg.vocab, S, live - args.steps // 2, live),
                                   device=model.device)
                static = None if cache == "dynamic" else cache
                generate_s = lambda tokens: hf_generate_s(model, ids, tokens, static)   # noqa: E731
                generate_s(args.steps + 1)   # warm (the static cache's compile: longest first)
                one = statistics.median(generate_s(1) for _ in range(args.repeats))
                full = statistics.median(generate_s(args.steps + 1) for _ in range(args.repeats))
                out["cells"].append(dict(rows=S, live=live, cache=cache,
                                         tpot_s=(full - one) / args.steps))
                print(f"  transformers {cache} cache S={S} live={live}: "
                      f"{1e3 * out['cells'][-1]['tpot_s']:.2f} ms", flush=True)
    return out


def format_table(r: dict) -> str:
    rate = r.get("floor_Bps")
    lines = [f"{r['preset']} on {r['device']} ({r['backend']}), {r['dtype']}, kernels "
             f"{r.get('kernels')}, linear {r.get('linear', 'torch')}, vt mode {r['mode']}, "
             f"max_context {r['max_context']}; weights "
             f"{r['weight_bytes'] / 1e9:.2f} GB"
             + (f" ({r['quantization']}: codes and scales; "
                f"{r['dense_weight_bytes'] / 1e9:.2f} GB in {r['dtype']})"
                if r.get("quantization") else "")
             + f", KV {r['kv_bytes_per_token'] / 1024:.0f} KiB/token"
             + (" (fp8 cache)" if r.get("kv_cache_dtype") == "fp8" else "")
             + (f", floor rate {rate / 1e12:.2f} TB/s (copy {r['copy_Bps'] / 1e12:.2f}, read "
                f"{r['read_Bps'] / 1e12:.2f})" if rate else ", no floor on this backend"),
             f"{'S':>3} {'live':>5} {'vt ms':>8} {'floor ms':>8} {'/floor':>6} {'ceiling':>8} "
             f"{'vt/ceil':>7} {'loop ms':>8} {'loop/vt':>7} {'hf ms':>8} {'hf/vt':>6} "
             f"{'static':>8} {'st/vt':>6}" + (f" {'dense fl':>8}" if _fp8(r) else "")]
    hf = {(c["rows"], c["live"], c.get("cache", "dynamic")): c["tpot_s"]
          for c in (r.get("hf") or {}).get("cells", [])}
    for c in r["cells"]:
        S, live, vt = c["rows"], c["live"], c["tpot_s"]
        fl = floor_s(r, S, live)
        loop = c.get("graph_loop_s")
        h, st = hf.get((S, live, "dynamic")), hf.get((S, live, "static"))
        lines.append(
            f"{S:3d} {live:5d} {1e3 * vt:8.3f} "
            + (f"{1e3 * fl:8.3f} {vt / fl:6.2f} " if fl else f"{'-':>8} {'-':>6} ")
            + f"{1e3 * c['ceiling_s']:8.3f} {c['ceiling_s'] / vt:7.3f} "
            + (f"{1e3 * loop:8.3f} {loop / vt:7.3f} " if loop else f"{'-':>8} {'-':>7} ")
            + (f"{1e3 * h:8.2f} {h / vt:6.2f} " if h else f"{'-':>8} {'-':>6} ")
            + (f"{1e3 * st:8.2f} {st / vt:6.2f}" if st else f"{'-':>8} {'-':>6}")
            + (f" {1e3 * floor_s(r, S, live, dense=True):8.3f}" if fl and _fp8(r) else ""))
    hf_r = r.get("hf") or {}
    lines.append("vt/ceil: the last step's graph replayed after the run, over vt's step (1.0: "
                 "the host adds nothing; below 1 at long contexts, where the replay measured "
                 "cheaper than the step it repeats, docs/benchmarks.md section 1); loop/vt: "
                 "the hand-written graph loop's step over vt's (> 1: vt faster); "
                 "hf: transformers generate, its dynamic cache (eager) and its static cache "
                 "(compiled on a GPU); dense fl: an FP8 run's floor with its weights and KV "
                 "cache in the module's dtype (the bf16 floor)")
    lines.append(f"hf: {hf_r.get('impl') or hf_r.get('error') or 'left out'}")
    return "\n".join(lines)


def write_png(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, live in enumerate(sorted({c["live"] for c in r["cells"]})):
        cells = sorted((c for c in r["cells"] if c["live"] == live), key=lambda c: c["rows"])
        xs = [c["rows"] for c in cells]
        color = f"C{i}"
        ax.plot(xs, [1e3 * c["tpot_s"] for c in cells], "o-", color=color,
                label=f"vt {r['mode']}, live {live}")
        if r.get("floor_Bps"):
            ax.plot(xs, [1e3 * floor_s(r, S, live) for S in xs], "--", color=color,
                    label=f"floor, live {live}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows per decode step (S)")
    ax.set_ylabel("ms per output token")
    ax.set_title(f"{r['preset']}: decode step against its memory floor ({r['device']})", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)

