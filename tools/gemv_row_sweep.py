"""One-row GEMV block shapes for vt.torch.triton_gemv, timed on weights HBM serves, and
programmatic dependent launch (PDL) tried on each.

    python3 tools/gemv_row_sweep.py        (a CUDA GPU of compute capability 9 or newer)

Why a sweep of its own: Triton's autotuner times each candidate on one weight, which the
50 MB L2 then holds, so it picks shapes that are fast from L2. Here every timed call reads
another copy of the weight (copies worth >= 256 MB, rotated), in a captured graph of 20 calls.

For Llama-3-8B's qkv, o, gate_up and down at one row, each shape (BLOCK_N output columns a
program, BLOCK_K-wide K tiles, the first PRE_K columns loaded in one tile, warps, pipeline
stages, and DOT: a tensor-core dot over the row padded to 16, else a float32 reduction on the
CUDA cores) is checked against a float32 product (1e-2 relative) and timed; the four fastest
are timed again with and without PDL (griddepcontrol: the next call launches while this one
runs and loads its first weight tile before waiting on it). Then a chain through 32 layers
of the four linears, each input the previous output: cuBLAS, the fastest shapes, and the
fastest shapes with PDL, twice each. Percentages are of the eager device-copy rate measured
first. The shape vt.torch.triton_gemv.ONE_ROW uses came from this sweep (docs/benchmarks.md).
"""
import itertools, sys, time
from pathlib import Path
import torch, triton, triton.language as tl
import torch.nn.functional as F
from triton.language.extra.cuda import gdc_wait, gdc_launch_dependents

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout

from tools.decode_floor import replay_ms                                 # noqa: E402


@triton.jit
def gemv(X, W, Y, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         PRE_K: tl.constexpr, PDL: tl.constexpr, DOT: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn[:, None] < N
    wrow = W + rn[:, None].to(tl.int64) * stride_w
    if PDL:
        gdc_launch_dependents()
    rp = tl.arange(0, PRE_K)
    w0 = tl.load(wrow + rp[None, :], mask=nmask, other=0.0)     # weights: no dependency
    if PDL:
        gdc_wait()
    rs = tl.arange(0, 16)
    if DOT:
        xx = tl.load(X + rs[:, None] * 0 + rp[None, :], mask=rs[:, None] == 0, other=0.0)
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        acc += tl.dot(xx, tl.trans(w0))
    else:
        x0 = tl.load(X + rp)
        acc = tl.sum(w0.to(tl.float32) * x0.to(tl.float32)[None, :], axis=1)
    rk = tl.arange(0, BLOCK_K)
    for k0 in range(PRE_K, K, BLOCK_K):
        w = tl.load(wrow + k0 + rk[None, :], mask=nmask, other=0.0)
        if DOT:
            xx = tl.load(X + k0 + rs[:, None] * 0 + rk[None, :], mask=rs[:, None] == 0, other=0.0)
            acc += tl.dot(xx, tl.trans(w))
        else:
            x = tl.load(X + k0 + rk)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if DOT:
        out = tl.sum(tl.where(rs[:, None] == 0, acc, 0.0), axis=0)
    else:
        out = acc
    tl.store(Y + rn, out.to(Y.dtype.element_ty), mask=rn < N)


def launch(x, w, y, cfg, pdl):
    bn, bk, pre, warps, stages, dot = cfg
    N, K = w.shape
    gemv[(triton.cdiv(N, bn),)](x, w, y, N, K, w.stride(0), BLOCK_N=bn, BLOCK_K=bk, PRE_K=pre,
                                PDL=pdl, DOT=dot, num_warps=warps, num_stages=stages,
                                launch_pdl=pdl)


def graph_us(fn, calls, replays=15):
    """µs per call of fn's `calls` calls, in a captured graph (decode_floor.replay_ms)."""
    return replay_ms(fn, replays) * 1e3 / calls


def main():
    torch.manual_seed(0)
    dev = "cuda"
    x_ = torch.empty(2**28, dtype=torch.uint8, device=dev); y_ = torch.empty_like(x_)
    for _ in range(3): y_.copy_(x_)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20): y_.copy_(x_)
    torch.cuda.synchronize(); rate = 2 * 2**28 * 20 / (time.perf_counter() - t)
    del x_, y_
    print(torch.cuda.get_device_name(), "copy rate", round(rate / 1e12, 3), "TB/s", flush=True)
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336)}
    cfgs = [(bn, bk, pre, w, s, d) for bn, bk, pre, w, s, d in itertools.product(
                (8, 16, 32), (256, 512), (0, 1024), (4, 8), (3, 4), (False, True))
            if not (d and bn < 16)]
    cfgs = [(bn, bk, pre or bk, w, s, d) for bn, bk, pre, w, s, d in cfgs]
    best = {}
    for name, (N, K) in shapes.items():
        ncopy = -(-2**28 // (N * K * 2))
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in range(ncopy)]
        x = torch.randn(K, device=dev, dtype=torch.bfloat16)
        y = torch.empty(N, device=dev, dtype=torch.bfloat16)
        ref = (ws[0].float() @ x.float())
        calls = 20
        tus = graph_us(lambda: [F.linear(x[None], ws[i % ncopy]) for i in range(calls)], calls)
        ideal = N * K * 2 / rate * 1e6
        res = []
        t0 = time.time()
        for cfg in cfgs:
            try:
                launch(x, ws[0], y, cfg, False)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if err > 1e-2:
                    print("bad", name, cfg, err); continue
                us = graph_us(lambda: [launch(x, ws[i % ncopy], y, cfg, False)
                                       for i in range(calls)], calls, replays=5)
                res.append((us, cfg))
            except Exception:   # out of resources etc.
                pass
        res.sort()
        print(f"{name} {N}x{K}: ideal {ideal:.1f}us torch {tus:.1f}us ({ideal / tus:.0%}); "
              f"{len(res)} cfgs in {time.time() - t0:.0f}s", flush=True)
        for us, cfg in res[:4]:
            pus = graph_us(lambda: [launch(x, ws[i % ncopy], y, cfg, True)
                                    for i in range(calls)], calls)
            us = graph_us(lambda: [launch(x, ws[i % ncopy], y, cfg, False)
                                   for i in range(calls)], calls)
            launch(x, ws[0], y, cfg, True)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            print(f"   {cfg}: {us:.1f}us ({ideal / us:.0%})  pdl {pus:.1f}us "
                  f"({ideal / pus:.0%}) err {err:.1e}", flush=True)
        best[name] = res[0][1]
        del ws
    # a chain through 32 layers of the four linears, each input the previous output
    L = 32
    Wl = [{n: torch.randn(*s, device=dev, dtype=torch.bfloat16) * s[1] ** -0.5
           for n, s in shapes.items()} for _ in range(L)]
    h = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    bufs = {n: torch.empty(s[0], device=dev, dtype=torch.bfloat16) for n, s in shapes.items()}

    def chain_torch():
        for l in Wl:
            F.linear(h[None], l["qkv"]); a = F.linear(h[None], l["o"])
            g = F.linear(a, l["gate_up"]); F.linear(g[:, :14336], l["down"])

    def chain(pdl):
        def f():
            for l in Wl:
                launch(h, l["qkv"], bufs["qkv"], best["qkv"], pdl)
                launch(bufs["qkv"][:4096], l["o"], bufs["o"], best["o"], pdl)
                launch(bufs["o"], l["gate_up"], bufs["gate_up"], best["gate_up"], pdl)
                launch(bufs["gate_up"][:14336], l["down"], bufs["down"], best["down"], pdl)
        return f
    ideal = sum(N * K * 2 for N, K in shapes.values()) * L / rate * 1e3
    for name, fn in (("torch", chain_torch), ("triton", chain(False)), ("triton-pdl", chain(True)),
                     ("torch2", chain_torch), ("triton2", chain(False)), ("triton-pdl2", chain(True))):
        ms = graph_us(fn, 1) / 1e3
        print(f"chain {name}: {ms:.3f} ms, ideal {ideal:.3f} ms ({ideal / ms:.0%})", flush=True)


if __name__ == "__main__":
    main()
