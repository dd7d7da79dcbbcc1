"""How far a decode step of a Llama-3-8B-shaped layer stack is from its memory floor, in one
run on one GPU: a captured torch.cuda.CUDAGraph of the step (random bf16 weights and cache),
dense vs paged attention, unfused vs fused layer ops.

    python tools/decode_floor.py [--layers 32] [--cases 1:192 1:2048 32:2048] [--gemms]
                                 [--blas cublas|cublaslt] [--variants NAME ...]

floor = (weight bytes + live KV bytes) / the floor rate measured here: the faster of an eager
device-to-device copy (bytes read + written over time) and an eager read
(vt.cli.bench.torch_decode.bandwidths). Variants:
  dense-unfused   what vt.torch.llama does: gather max_context slots, masked SDPA, norms in
                  float32 and back, RoPE halves, index_copy KV write, silu(gate) * up
  paged-unfused   the same, attention by vt.torch.paged_attention (live tokens only)
  paged-fused     plus vt.torch.fused: add_rms_norm, rope_and_cache, silu_mul
  fused-rope-attn paged-fused with RoPE and the KV write inside the attention kernel
                  (paged_attention.rope_cache_decode_attention: one kernel a layer less)
  fused-tgemv     paged-fused with vt.torch.triton_gemv's linear (at most 16 rows)
  fused-tgemv-silu  and its down projection with silu_mul computed as it reads (one kernel)
  fused-tgemv-all   and the residual add + RMSNorm inside qkv's and gate_up's kernels too
  tgemv-silu-rope fused-tgemv-silu with RoPE and the KV write inside the attention kernel
  tgemv-glu-rope  tgemv-silu-rope with the SiLU product in gate_up's kernel instead of down's
                  (linear_silu_mul; one row only): the decoder's one-row decode step
  tgemv-all-rope  fused-tgemv-all with RoPE and the KV write inside the attention kernel
  linears-*       the step's linear layers alone (cuBLAS; tgemv: the Triton linear)
vt's Triton kernels over one row are launched with programmatic dependent launch on
Hopper and newer (vt.torch.triton_pdl); VT_TRITON_PDL=0 times them launched the ordinary way.
--gemms: each linear's achieved weight bytes/s at S = 1, 8, 32 (a graph of 20 calls over
copies of the weight that L2 cannot hold), as a fraction of the floor rate.
This is evidence for wiring the kernels into vt.torch.llama; it does not go through vt
(python -m vt.cli.bench.torch_decode measures the decoder served by vt's engine).
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vt.cli.bench.torch_decode import bandwidths
from vt.torch import fused
from vt.torch.paged_attention import paged_decode_attention, rope_cache_decode_attention

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, EPS = 4096, 14336, 32, 8, 128, 128256, 1e-5
BS = 16


@dataclass
class Step:
    """The static inputs of a captured step of S rows."""
    ids: torch.Tensor          # [S]
    positions: torch.Tensor    # [S]
    seq_lens: torch.Tensor     # [S] int32
    slots: torch.Tensor        # [S]: the new token's cache slot
    tables: torch.Tensor       # [S, max_blocks] int32
    logits: torch.Tensor       # [S, vocab] f32


def make_weights(layers):
    def w(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * shape[-1] ** -0.5

    L = [dict(attn_norm=1 + 0.1 * w(HIDDEN), qkv=w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
              o=w(HIDDEN, HEADS * HEAD_DIM), mlp_norm=1 + 0.1 * w(HIDDEN),
              gate_up=w(2 * INTER, HIDDEN), down=w(HIDDEN, INTER)) for _ in range(layers)]
    return dict(layers=L, embed=w(VOCAB, HIDDEN), norm=1 + 0.1 * w(HIDDEN), head=w(VOCAB, HIDDEN))


def weight_bytes(W):
    n = sum(t.numel() for layer in W["layers"] for t in layer.values())
    # the embedding reads S rows, not the table
    return 2 * (n + W["norm"].numel() + W["head"].numel())


def rms(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def dense_attention(q, kc, vc, st, mask, slots_all):
    S = q.shape[0]
    keys, vals = kc[slots_all].transpose(1, 2), vc[slots_all].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.view(S, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM), keys,
                                         vals, attn_mask=mask)
    return out.reshape(S, HEADS * HEAD_DIM)


def forward_unfused(W, kc, vc, cos, sin, st: Step, paged: bool):
    S = st.ids.shape[0]
    t = torch.arange(st.tables.shape[1] * BS, device="cuda")
    slots_all = st.tables.long()[:, t // BS] * BS + t % BS
    mask = (t < st.seq_lens.unsqueeze(1))[:, None, None, :]
    c, s = cos[st.positions].unsqueeze(1), sin[st.positions].unsqueeze(1)
    x = W["embed"][st.ids]
    for i, L in enumerate(W["layers"]):
        qkv = F.linear(rms(x, L["attn_norm"]), L["qkv"])
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q = fused.rope_torch(q.reshape(S, HEADS, HEAD_DIM), c, s)
        k = fused.rope_torch(k.reshape(S, KV_HEADS, HEAD_DIM), c, s)
        kc[i].index_copy_(0, st.slots, k)
        vc[i].index_copy_(0, st.slots, v.reshape(S, KV_HEADS, HEAD_DIM))
        if paged:
            a = paged_decode_attention(q, kc[i], vc[i], st.tables, st.seq_lens,
                                       block_size=BS).view(S, -1)
        else:
            a = dense_attention(q, kc[i], vc[i], st, mask, slots_all)
        x = x + F.linear(a, L["o"])
        gate, up = F.linear(rms(x, L["mlp_norm"]), L["gate_up"]).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, L["down"])
    st.logits.copy_(F.linear(rms(x, W["norm"]), W["head"]))


def attend_layer(qkv, k_cache, v_cache, cos, sin, st: Step, rope_attend: bool):
    """A layer's fused attention from its qkv projection: rope_and_cache, then
    paged_decode_attention, or (rope_attend) both in rope_cache_decode_attention's kernel."""
    heads = dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    if rope_attend:
        return rope_cache_decode_attention(qkv, st.positions, cos, sin, k_cache, v_cache,
                                           st.slots, st.tables, st.seq_lens, block_size=BS,
                                           **heads)
    q = fused.rope_and_cache(qkv, st.positions, cos, sin, k_cache, v_cache, st.slots, **heads)
    return paged_decode_attention(q, k_cache, v_cache, st.tables, st.seq_lens, block_size=BS)


def forward_fused(W, kc, vc, cos, sin, st: Step, lin=F.linear, silu_mul_down=None,
                  rope_attend: bool = False, gate_up_silu_mul=None):
    """The paged, fused step. silu_mul_down: the SiLU product inside the down projection;
    gate_up_silu_mul: inside the gate_up projection (None, both: fused.silu_mul between)."""
    S = st.ids.shape[0]
    x = W["embed"][st.ids]
    layers = W["layers"]
    h = fused.rms_norm(x, layers[0]["attn_norm"], EPS)
    for i, L in enumerate(layers):
        qkv = lin(h, L["qkv"])
        a = attend_layer(qkv, kc[i], vc[i], cos, sin, st, rope_attend)
        x, h = fused.add_rms_norm(x, lin(a.view(S, -1), L["o"]), L["mlp_norm"], EPS)
        if gate_up_silu_mul is not None:
            d = lin(gate_up_silu_mul(h, L["gate_up"]), L["down"])
        elif silu_mul_down is None:
            d = lin(fused.silu_mul(lin(h, L["gate_up"])), L["down"])
        else:
            d = silu_mul_down(lin(h, L["gate_up"]), L["down"])
        nxt = layers[i + 1]["attn_norm"] if i + 1 < len(layers) else W["norm"]
        x, h = fused.add_rms_norm(x, d, nxt, EPS)
    st.logits.copy_(lin(h, W["head"]))


def forward_tgemv_all(W, kc, vc, cos, sin, st: Step, tgemv, rope_attend: bool = False):
    """paged-fused with every op before a projection inside its kernel: the residual add and
    RMSNorm in qkv's and gate_up's (add_rms_norm_linear), silu_mul in down's: 7 kernels a
    layer (qkv, rope_and_cache, attention and its split-K reduce, o, gate_up, down; 6 with
    rope_attend, RoPE and the KV write inside the attention kernel)."""
    S = st.ids.shape[0]
    x, delta = W["embed"][st.ids], None
    for i, L in enumerate(W["layers"]):
        res, qkv = tgemv.add_rms_norm_linear(x, delta, L["attn_norm"], EPS, L["qkv"])
        x = x if res is None else res
        a = attend_layer(qkv, kc[i], vc[i], cos, sin, st, rope_attend)
        x, gate_up = tgemv.add_rms_norm_linear(x, tgemv.linear(a.view(S, -1), L["o"]),
                                               L["mlp_norm"], EPS, L["gate_up"])
        delta = tgemv.silu_mul_linear(gate_up, L["down"])
    _, h = fused.add_rms_norm(x, delta, W["norm"], EPS)
    st.logits.copy_(tgemv.linear(h, W["head"]))


def forward_linears(W, st: Step, lin=F.linear):
    """The step's linear layers alone, in its order, on static inputs: its GEMM time."""
    S = st.ids.shape[0]
    h = torch.full((S, HIDDEN), 0.01, device="cuda", dtype=torch.bfloat16)
    m = torch.full((S, INTER), 0.01, device="cuda", dtype=torch.bfloat16)
    for L in W["layers"]:
        lin(h, L["qkv"]), lin(h, L["o"]), lin(h, L["gate_up"]), lin(m, L["down"])
    st.logits.copy_(lin(h, W["head"]))


def make_step(S, live, max_context):
    max_blocks = max_context // BS
    perm = 1 + torch.randperm(S * max_blocks, device="cuda")      # block 0: scratch
    tables = perm.view(S, max_blocks).int()
    pos = torch.full((S,), live - 1, device="cuda", dtype=torch.long)
    slots = tables.long()[:, (live - 1) // BS] * BS + (live - 1) % BS
    return Step(ids=torch.randint(0, VOCAB, (S,), device="cuda"), positions=pos,
                seq_lens=torch.full((S,), live, device="cuda", dtype=torch.int32), slots=slots,
                tables=tables, logits=torch.empty(S, VOCAB, device="cuda"))


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph, after two warm-up calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_ms(fn, replays=20):
    """Median ms of a captured graph of fn (warmed up on a side stream first)."""
    graph = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


def weight_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """w and clones of it, worth >= 256 MB together: calls that rotate over them read each
    from HBM, since L2 (50-60 MB) holds none by the time it comes round again."""
    return [w] + [w.clone() for _ in range(-(-2**28 // (w.numel() * w.element_size())) - 1)]


def gemm_table(W, rate, tgemv=None):
    L = W["layers"][0]
    print(f"\nGEMM weight bytes/s (floor rate {rate / 1e12:.2f} TB/s)")
    print(f"{'linear':>8} {'shape':>12}  torch (and triton) at S = 1, 8, 32")
    for name, w in (("qkv", L["qkv"]), ("o", L["o"]), ("gate_up", L["gate_up"]),
                    ("down", L["down"]), ("lm_head", W["head"])):
        cells = []
        copies = weight_copies(w)
        for S in (1, 8, 32):
            x = torch.randn(S, w.shape[1], device="cuda", dtype=torch.bfloat16)
            us = replay_ms(lambda: [F.linear(x, copies[i % len(copies)])
                                    for i in range(20)]) * 1e3 / 20
            bw = w.numel() * 2 / (us / 1e6)
            cells.append(f"{us:6.1f}us {bw / rate:4.0%}")
            if tgemv and S <= tgemv.MAX_ROWS:
                err = ((tgemv.linear(x, w).float() - F.linear(x, w).float()).norm()
                       / F.linear(x, w).float().norm()).item()
                us = replay_ms(lambda: [tgemv.linear(x, copies[i % len(copies)])
                                        for i in range(20)]) * 1e3 / 20
                bw = w.numel() * 2 / (us / 1e6)
                cells.append(f"triton {us:6.1f}us {bw / rate:4.0%} (rel {err:.0e})")
        copies.clear()   # free the copies before the next weight
        print(f"{name:>8} {str(tuple(w.shape)):>12} " + " ".join(f"{c:>14}" for c in cells))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--cases", nargs="+", default=["1:192", "1:2048", "32:2048"],
                    help="S:live_tokens pairs")
    ap.add_argument("--gemms", action="store_true")
    ap.add_argument("--variants", nargs="+", metavar="NAME",
                    help="time only these variants (each one's logits compared with the one it "
                         "changes where that one runs too)")
    ap.add_argument("--no-triton", action="store_true",
                    help="leave out vt.torch.triton_gemv (the Triton linear for few rows)")
    ap.add_argument("--blas", choices=["cublas", "cublaslt"], default="cublas",
                    help="the library torch's GEMMs go through "
                         "(torch.backends.cuda.preferred_blas_library)")
    args = ap.parse_args()
    torch.backends.cuda.preferred_blas_library(args.blas)
    tgemv = None
    if not args.no_triton:
        from vt.torch import triton_gemv as tgemv
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"layers {args.layers}, max_context {args.max_context}, "
          f"blas {torch.backends.cuda.preferred_blas_library()}")
    rates = bandwidths()   # eager kernels: a copy captured in a graph runs on a copy engine
    rate = max(rates.values())
    W = make_weights(args.layers)
    wb = weight_bytes(W)
    cases = [tuple(int(v) for v in c.split(":")) for c in args.cases]
    max_rows = max(S for S, _ in cases)
    slots = (max_rows * args.max_context // BS + 1) * BS
    kc = torch.randn(args.layers, slots, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    ang = torch.rand(args.max_context, HEAD_DIM // 2, device="cuda") * 6.28
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    print(f"weights {wb / 1e9:.2f} GB, floor rate {rate / 1e12:.2f} TB/s (copy "
          f"{rates['copy'] / 1e12:.2f}, read {rates['read'] / 1e12:.2f}), "
          f"weight floor {wb / rate * 1e3:.2f} ms")
    print(f"{'S':>3} {'live':>5} {'variant':>14} {'ms':>8} {'floor ms':>9} {'/floor':>7} "
          f"{'logits rel diff':>16}")
    with torch.inference_mode():
        for S, live in cases:
            st = make_step(S, live, args.max_context)
            kv_read = args.layers * S * live * KV_HEADS * HEAD_DIM * 2 * 2
            floor_ms = (wb + kv_read) / rate * 1e3
            outs = {}
            variants = {
                "dense-unfused": lambda: forward_unfused(W, kc, vc, cos, sin, st, paged=False),
                "paged-unfused": lambda: forward_unfused(W, kc, vc, cos, sin, st, paged=True),
                "paged-fused": lambda: forward_fused(W, kc, vc, cos, sin, st),
                "fused-rope-attn": lambda: forward_fused(W, kc, vc, cos, sin, st,
                                                         rope_attend=True),
                "linears-only": lambda: forward_linears(W, st)}
            if tgemv and S <= tgemv.MAX_ROWS:
                variants["fused-tgemv"] = lambda: forward_fused(W, kc, vc, cos, sin, st,
                                                                lin=tgemv.linear)
                variants["fused-tgemv-silu"] = lambda: forward_fused(
                    W, kc, vc, cos, sin, st, lin=tgemv.linear, silu_mul_down=tgemv.silu_mul_linear)
                variants["fused-tgemv-all"] = lambda: forward_tgemv_all(W, kc, vc, cos, sin, st,
                                                                        tgemv)
                variants["tgemv-silu-rope"] = lambda: forward_fused(
                    W, kc, vc, cos, sin, st, lin=tgemv.linear,
                    silu_mul_down=tgemv.silu_mul_linear, rope_attend=True)
                if S == 1:
                    variants["tgemv-glu-rope"] = lambda: forward_fused(
                        W, kc, vc, cos, sin, st, lin=tgemv.linear,
                        gate_up_silu_mul=tgemv.linear_silu_mul, rope_attend=True)
                variants["tgemv-all-rope"] = lambda: forward_tgemv_all(
                    W, kc, vc, cos, sin, st, tgemv, rope_attend=True)
                variants["linears-tgemv"] = lambda: forward_linears(W, st, lin=tgemv.linear)
            bases = {"paged-fused": "paged-unfused", "fused-rope-attn": "paged-fused",
                     "fused-tgemv": "paged-fused",
                     "fused-tgemv-silu": "paged-fused", "fused-tgemv-all": "paged-fused",
                     "tgemv-silu-rope": "fused-tgemv-silu", "tgemv-glu-rope": "tgemv-silu-rope",
                     "tgemv-all-rope": "fused-tgemv-all"}
            if args.variants:
                unknown = set(args.variants) - set(variants)
                if unknown:
                    raise SystemExit(f"decode_floor: no variant {sorted(unknown)} at S={S} "
                                     f"(there are {', '.join(variants)})")
                variants = {n: fn for n, fn in variants.items() if n in args.variants}
            for name, fn in variants.items():
                ms = replay_ms(fn)
                fn()
                outs[name] = st.logits.clone()
                # each variant against the one it changes: paged vs dense, fused vs unfused;
                # not the linears alone (random inputs: no logits to compare), nor against a
                # variant --variants left out
                base = bases.get(name, "dense-unfused")
                against = ""
                if not name.startswith("linears") and base in outs:
                    err = ((outs[name] - outs[base]).norm() / outs[base].norm()).item()
                    against = f" {err:>9.1e} vs {base}"
                print(f"{S:>3} {live:>5} {name:>14} {ms:>8.3f} {floor_ms:>9.3f} "
                      f"{ms / floor_ms:>7.2f}{against}", flush=True)
    if args.gemms:
        gemm_table(W, rate, tgemv)


if __name__ == "__main__":
    main()
