"""Paged GQA decode attention candidates on one GPU, one run: device time per call and the
live KV bytes it must read over that time.

    python tools/paged_attention_bench.py [--rows 1 32] [--live 192 2048 4096] [--no-flex]

Candidates, all on the same bf16 cache ([slots, kv_heads, head_dim], block size 16, random
block tables, random contents), one decode query per row:
  dense    gather all max_context slots through the block table, masked SDPA (what a
           fixed-shape step does without a paged kernel)
  triton   vt.torch.paged_attention (split-K over live tokens, Triton)
  vt_cupy  vt.model.kernels.attention.PagedAttention (CuPy/NVRTC split-K), on the torch
           tensors' memory through CuPy views, launched on torch's stream
  flex     torch flex_attention (compiled) over a CONTIGUOUS [S, kv_heads, max_context, D]
           cache with a block mask of the live lengths built once outside the timed region:
           its best case (no block-table indirection, no per-step mask build)
Each candidate is captured as a CUDA graph of REPS calls and timed by events over replays
(median); its output is compared with the dense one (relative error, bf16).
"""
from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

from vt.torch import paged_attention as pa

REPS = 20


def graph_time_us(fn, replays=15):
    """Median device µs per call of fn, from a CUDA graph of REPS calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / REPS)
    return statistics.median(times)


def case(S, live, max_context, heads=32, kv_heads=8, head_dim=128, bs=16):
    max_blocks = max_context // bs
    num_blocks = S * max_blocks + 1
    k = torch.randn(num_blocks * bs, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(S, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    tables = (1 + torch.randperm(num_blocks - 1, device="cuda")[:S * max_blocks]).view(S, max_blocks)
    lens = torch.full((S,), live, dtype=torch.int32, device="cuda")
    return q, k, v, tables.int(), lens


def dense(q, k, v, tables, lens, bs=16):
    S, heads, D = q.shape
    kvh = k.shape[1]
    t = torch.arange(tables.shape[1] * bs, device=q.device)
    slots = tables.long()[:, t // bs] * bs + t % bs
    mask = (t < lens.unsqueeze(1))[:, None, None, :]
    keys, vals = k[slots].transpose(1, 2), v[slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.view(S, kvh, heads // kvh, D), keys, vals, attn_mask=mask)
    return out.reshape(S, heads, D)


def vt_cupy_runner(q, k, v, tables, lens, bs=16):
    """CuPy views of the torch tensors, made once outside the capture (DLPack of int16: CuPy
    has no bf16, and vt's kernels take bf16 as raw 16-bit storage)."""
    import cupy as cp

    from vt.model.kernels.attention import PagedAttention
    S, heads, D = q.shape
    kvh = k.shape[1]
    out = torch.empty_like(q)

    def view(t, shape):
        return cp.from_dlpack(t.view(torch.int16)).view(cp.uint16).reshape(shape)

    rows = torch.arange(S, dtype=torch.int32, device=q.device)
    args = (view(q, (S, heads * D)), view(k, (-1, bs, kvh, D)), view(v, (-1, bs, kvh, D)),
            cp.from_dlpack(tables), cp.from_dlpack(lens), cp.from_dlpack(rows),
            view(out, (S, heads * D)))
    kernel = PagedAttention()
    # The kernel's one temporary (its split partials) comes from a torch buffer made here:
    # CuPy's own pool would allocate on the capturing stream.
    scratch = torch.empty(S * heads * 64 * (D + 2), dtype=torch.float32, device=q.device)

    def scratch_alloc(size):
        assert size <= scratch.numel() * 4, size
        return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(scratch.data_ptr(), size, scratch), 0)

    def run():
        stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())
        with stream, cp.cuda.using_allocator(scratch_alloc):
            kernel.run_cupy(None, *args, q_heads=heads, kv_heads=kvh, head_dim=D)
        return out
    return run


def flex_runner(q, k, v, tables, lens, bs=16):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    S, heads, D = q.shape
    kvh, T = k.shape[1], tables.shape[1] * bs
    t = torch.arange(T, device=q.device)
    slots = tables.long()[:, t // bs] * bs + t % bs
    kd = k[slots].transpose(1, 2).contiguous()       # [S, kvh, T, D], gathered once, untimed
    vd = v[slots].transpose(1, 2).contiguous()
    qd = q.view(S, heads, 1, D)

    def live(b, h, q_idx, kv_idx):
        return kv_idx < lens[b]

    mask = create_block_mask(live, S, None, 1, T, device=q.device, BLOCK_SIZE=128)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(qd, kd, vd, block_mask=mask, enable_gqa=True).view(S, heads, D)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--live", type=int, nargs="+", default=[192, 2048, 4096])
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--no-flex", action="store_true")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'S':>3} {'live':>5} {'cand':>8} {'us/call':>9} {'live GB/s':>10} {'rel err':>8}")
    for S in args.rows:
        for live in args.live:
            inputs = case(S, live, args.max_context)
            kv_bytes = S * live * inputs[1].shape[1] * inputs[1].shape[2] * 2 * 2
            ref = dense(*inputs)
            cands = {"dense": lambda: dense(*inputs),
                     "triton": lambda: pa.paged_decode_attention(*inputs, block_size=16),
                     "vt_cupy": vt_cupy_runner(*inputs)}
            if not args.no_flex:
                try:
                    cands["flex"] = flex_runner(*inputs)
                except Exception as e:   # report and go on: flex is one candidate of four
                    print(f"flex unavailable: {type(e).__name__}: {str(e)[:200]}")
            for name, fn in cands.items():
                try:
                    err = rel(fn(), ref)
                    us = graph_time_us(fn)
                except Exception as e:
                    print(f"{S:>3} {live:>5} {name:>8} failed: {type(e).__name__}: {str(e)[:300]}")
                    continue
                print(f"{S:>3} {live:>5} {name:>8} {us:>9.1f} {kv_bytes / us / 1e3:>10.0f} "
                      f"{err:>8.1e}", flush=True)
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
