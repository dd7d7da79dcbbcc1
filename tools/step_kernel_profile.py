"""Where the one-row decode step's device time goes, kernel by kernel: CUPTI durations (through
torch.profiler) of replays of tools/decode_floor.py's captured Llama-3-8B-shaped step.

    python tools/step_kernel_profile.py [--variant glu|silu-down] [--live 256] [--replays 10]

Variants (decode_floor.py's names):
  glu        tgemv-glu-rope: the SiLU product in gate_up's kernel, down a plain linear (the
             decoder's one-row step)
  silu-down  tgemv-silu-rope: the SiLU product computed as down's kernel reads its row
Each one-row GEMV is named by its place in the step (qkv, o, gate_up, down per layer, then
lm_head) and its weight bytes over its time are given as a fraction of the floor rate
measured first in the same run (vt.cli.bench.torch_decode.bandwidths); the last line sums
the gaps between kernels (negative: overlap, as programmatic dependent launch allows).
Launch with VT_TRITON_PDL=0 to see each kernel's own duration without that overlap.
"""
from __future__ import annotations

import argparse
import collections
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import decode_floor as df
from vt.cli.bench.torch_decode import bandwidths
from vt.torch import triton_gemv as tg

LINEARS = ("qkv", "o", "gate_up", "down")


def step_fn(variant, W, kc, vc, cos, sin, st):
    if variant == "glu":
        return lambda: df.forward_fused(W, kc, vc, cos, sin, st, lin=tg.linear,
                                        gate_up_silu_mul=tg.linear_silu_mul, rope_attend=True)
    return lambda: df.forward_fused(W, kc, vc, cos, sin, st, lin=tg.linear,
                                    silu_mul_down=tg.silu_mul_linear, rope_attend=True)


def kernel_events(fn, replays):
    """The CUDA kernel events of `replays` replays of fn captured as a graph, in start order."""
    graph = df.capture(fn)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(events, key=lambda e: e.time_range.start)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=["glu", "silu-down"], default="glu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--live", type=int, default=256, help="the row's tokens in the cache")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--replays", type=int, default=10)
    args = ap.parse_args()
    rate = max(bandwidths().values())
    torch.manual_seed(0)
    W = df.make_weights(args.layers)
    weight_bytes = {name: W["layers"][0][name].numel() * 2 for name in LINEARS}
    weight_bytes["lm_head"] = W["head"].numel() * 2
    blocks = args.max_context // df.BS + 1
    kc = torch.randn(args.layers, blocks * df.BS, df.KV_HEADS, df.HEAD_DIM, device="cuda",
                     dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    angles = torch.rand(args.max_context, df.HEAD_DIM // 2, device="cuda") * 6.28
    angles = torch.cat((angles, angles), -1)
    st = df.make_step(1, args.live, args.max_context)
    per_step = len(LINEARS) * args.layers + 1
    with torch.inference_mode():
        events = kernel_events(step_fn(args.variant, W, kc, vc, angles.cos(), angles.sin(), st),
                               args.replays)
    total, count, gemv = collections.defaultdict(float), collections.Counter(), 0
    for e in events:
        name = e.name[:60]
        if name.startswith("_gemv_one_row"):
            place = gemv % per_step
            name = "gemv " + (LINEARS[place % len(LINEARS)] if place < per_step - 1
                              else "lm_head")
            gemv += 1
        total[name] += e.time_range.elapsed_us()
        count[name] += 1
    R = args.replays
    span = (events[-1].time_range.end - events[0].time_range.start) / R
    print(f"{args.variant}, one row, {args.live} live tokens, {args.layers} layers: "
          f"{len(events) // R} kernels a step, span {span:.1f} us a step, kernels' sum "
          f"{sum(total.values()) / R:.1f} us; floor rate {rate / 1e12:.2f} TB/s")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1]):
        each = us / count[name]
        linear = name.split()[-1] if name.startswith("gemv ") else None
        share = f"{weight_bytes[linear] / (each * 1e-6) / rate:5.0%}" if linear else "     "
        print(f"  {us / R:9.1f} us/step {share} {count[name] // R:4d}/step {each:8.2f} us each"
              f"  {name}")
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(events, events[1:])]
    print(f"  gaps between kernels: median {statistics.median(gaps):.2f} us, "
          f"{sum(g for g in gaps if g < 50) / R:.1f} us a step (gaps of 50 us or more, "
          f"between replays, left out)")


if __name__ == "__main__":
    main()
