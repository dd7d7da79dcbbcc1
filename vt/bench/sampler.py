"""vt's sampler against the best simple PyTorch sampler over the same fp32 [S, V] logits.

Peers (what a PyTorch engineer writes): greedy `torch.argmax`; top_k 50 `torch.topk` +
softmax + multinomial; top_p 0.9 sort + softmax + cumsum + mask + multinomial; plain
temperature full softmax + exponential race (probs / Exponential(1), argmax). Each side is
timed as the mean of CALLS calls captured in one CUDA graph (launch cost excluded), after a
warm-up replay, median of REPEATS replays. Needs a CUDA GPU, CuPy and PyTorch.

    vt bench --workload sampler [--conc 1 8 ...] [--vocab 32000 ...] [--sampling greedy ...]
"""
from __future__ import annotations

import json

MODES = ("greedy", "top_k", "top_p", "temperature")
S_LIST = (1, 8, 32, 128, 256)
V_LIST = (32000, 128256, 151936)
CALLS, REPEATS = 50, 3
TEMPERATURE, TOP_K, TOP_P = 1.0, 50, 0.9


def _torch_sample(torch, logits, mode):
    if mode == "greedy":
        return torch.argmax(logits, dim=-1)
    if mode == "top_k":
        vals, idx = torch.topk(logits, TOP_K, dim=-1)
        probs = torch.softmax(vals / TEMPERATURE, dim=-1)
        return idx.gather(1, torch.multinomial(probs, 1)).squeeze(1)
    if mode == "top_p":
        vals, idx = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(vals / TEMPERATURE, dim=-1)
        drop = torch.cumsum(probs, dim=-1) - probs >= TOP_P   # mass before a token already reached
        probs = probs.masked_fill(drop, 0.0)
        return idx.gather(1, torch.multinomial(probs, 1)).squeeze(1)
    probs = torch.softmax(logits / TEMPERATURE, dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def _graph_us(torch, body) -> float:
    """Mean µs per call of `body`, CALLS calls captured in one CUDA graph; median of REPEATS."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            body()                                   # compile, fill caches, eager warm-up
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            body()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / CALLS)
    return sorted(times)[len(times) // 2]


def _vt_body(torch, cp, logits, mode):
    from vt.sampling.sampler import Sampler

    S, V = logits.shape
    dev = logits.device
    vec = {
        "token_rows": torch.arange(S, dtype=torch.int32, device=dev),
        "positions": torch.arange(S, dtype=torch.int32, device=dev) + 17,
        "temperature": torch.full((S,), 0.0 if mode == "greedy" else TEMPERATURE, device=dev),
        "top_k": torch.full((S,), TOP_K if mode == "top_k" else 0, dtype=torch.int32, device=dev),
        "top_p": torch.full((S,), TOP_P if mode == "top_p" else 1.0, device=dev),
        "min_p": torch.zeros(S, device=dev),
        "seed": torch.arange(S, dtype=torch.int64, device=dev),
    }
    out = torch.empty(S, dtype=torch.int32, device=dev)
    table = torch.zeros(S, dtype=torch.int32, device=dev)
    args = [cp.asarray(logits)] + [cp.asarray(vec[n]) for n in ("token_rows", "positions", "temperature",
                                                                  "top_k", "top_p", "min_p")]
    args += [cp.asarray(vec["seed"]).view(cp.uint64), cp.asarray(out), cp.asarray(table)]
    sampler = Sampler()

    def body():
        stream = torch.cuda.current_stream()
        with cp.cuda.ExternalStream(stream.cuda_stream):
            sampler.run_cupy(stream.cuda_stream, *args)
    return body


def _torch_backed_allocator(torch, cp):
    """CuPy allocations (the sampler's workspace) from torch's caching allocator, which gives
    allocations made during torch's graph capture the graph's private pool (as vt's pool does)."""
    def alloc(size):
        t = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")
        return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(t.data_ptr(), size, t), 0)
    return alloc


def run_sampler_bench(S_list=S_LIST, V_list=V_LIST, modes=MODES, seed: int = 0, log=print) -> list[dict]:
    """One row per (S, V, mode): {S, V, mode, vt_us, torch_us, ratio = vt_us / torch_us}."""
    import cupy as cp
    import torch

    cp.cuda.set_allocator(_torch_backed_allocator(torch, cp))
    try:
        return _grid(torch, cp, S_list, V_list, modes, seed, log)
    finally:
        cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)


def _grid(torch, cp, S_list, V_list, modes, seed, log):
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for V in V_list:
        for S in S_list:
            logits = torch.randn(S, V, device="cuda", generator=gen) * 3.0
            for mode in modes:
                vt_us = _graph_us(torch, _vt_body(torch, cp, logits, mode))
                torch_us = _graph_us(torch, lambda: _torch_sample(torch, logits, mode))
                row = dict(S=S, V=V, mode=mode, vt_us=round(vt_us, 2), torch_us=round(torch_us, 2),
                           ratio=round(vt_us / torch_us, 3))
                log(json.dumps(row))
                rows.append(row)
    return rows


def run(S_list, V_list, modes, seed: int = 0) -> dict:
    """The whole sweep as vt bench's result: the rows and what they ran on."""
    import torch

    from vt.bench.run import vt_commit
    rows = run_sampler_bench(S_list, V_list, modes, seed, log=lambda line: None)
    return dict(workload="sampler", commit=vt_commit(), device=torch.cuda.get_device_name(),
                torch=torch.__version__, calls_per_graph=CALLS, repeats=REPEATS, rows=rows)


def table(res: dict) -> str:
    """µs per call, vt | torch (ratio), one line per (V, S), one column per mode."""
    modes = list(dict.fromkeys(r["mode"] for r in res["rows"]))
    at = {(r["V"], r["S"], r["mode"]): r for r in res["rows"]}
    lines = ["us per call inside a CUDA graph, vt | torch (vt / torch)",
             f"{'V':>7} {'S':>4} " + " ".join(f"{m:>26}" for m in modes)]
    for V, S in dict.fromkeys((r["V"], r["S"]) for r in res["rows"]):
        cells = [at[V, S, m] for m in modes]
        lines.append(f"{V:>7} {S:>4} " + " ".join(
            f"{c['vt_us']:>9.1f} | {c['torch_us']:>7.1f} ({c['ratio']:.2f})" for c in cells))
    return "\n".join(lines)


def write_json(res: dict, path: str) -> None:
    from vt.atomic_file import write_text_atomic
    write_text_atomic(path, json.dumps(res, indent=1) + "\n")


def write_png(res: dict, path: str) -> None:
    """vt's time over torch's against S, one panel per mode, one line per V (below 1: vt wins)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vt.atomic_file import atomic_open
    modes = list(dict.fromkeys(r["mode"] for r in res["rows"]))
    fig, axes = plt.subplots(1, len(modes), figsize=(4 * len(modes), 3.4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for V in dict.fromkeys(r["V"] for r in res["rows"]):
            pts = sorted((r["S"], r["ratio"]) for r in res["rows"] if r["V"] == V and r["mode"] == mode)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"V={V}")
        ax.axhline(1.0, color="gray", lw=0.8)
        if mode != "greedy":   # the target: half of torch's time (greedy's is 1.0, the line above)
            ax.axhline(0.5, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(mode)
        ax.set_xlabel("rows S")
    axes[0][0].set_ylabel("vt time / torch time")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"vt's sampler against torch's ({res.get('device')}, {res.get('commit')})", fontsize=9)
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)

