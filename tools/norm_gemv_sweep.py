"""One-row shapes for vt.torch.triton_gemv.add_rms_norm_linear (the residual add and RMSNorm
inside the projection's kernel), timed on weights HBM serves, against the two kernels it
replaces (vt.torch.fused.add_rms_norm, then the one-row linear).

    python3 tools/norm_gemv_sweep.py        (a CUDA GPU)

For Llama-3-8B's qkv and gate_up at one row, with a residual delta: the fused kernel's output
against the two kernels' (h equal bit for bit, y's relative difference), then each timed in a
captured graph of 20 calls over weight copies worth >= 256 MB (rotated, so that L2 serves
none), as tools/gemv_row_sweep.py times the plain linear: the two kernels, the fused kernel
with its shape ONE_ROW_NORM, and the fused kernel with each of 24 shapes (this tool sets
ONE_ROW_NORM for each and puts it back after). The ideal is the weight bytes at 3.0 TB/s.
docs/benchmarks.md has a run and what it decided.
"""
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout

from tools.decode_floor import replay_ms, weight_copies         # noqa: E402
from vt.torch import fused, triton_gemv as tg                    # noqa: E402


def main():
    torch.manual_seed(0)
    K = 4096
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    d = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
    for name, N in (("qkv", 6144), ("gate_up", 28672)):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        copies = weight_copies(w)

        def two():
            for i in range(20):
                tg.linear(fused.add_rms_norm(x, d, nw, 1e-5)[1], copies[i % len(copies)])

        def one():
            for i in range(20):
                tg.add_rms_norm_linear(x, d, nw, 1e-5, copies[i % len(copies)])

        h_ref, normed = fused.add_rms_norm(x, d, nw, 1e-5)
        y_ref = tg.linear(normed, w).float()
        h, y = tg.add_rms_norm_linear(x, d, nw, 1e-5, w)
        rel = ((y.float() - y_ref).norm() / y_ref.norm()).item()
        print(f"{name}: h equal {torch.equal(h, h_ref)}, y rel {rel:.1e}; ideal at 3 TB/s "
              f"{w.numel() * 2 / 3.0e12 * 1e6:.1f} us", flush=True)
        print(f"  two kernels   {replay_ms(two) * 1e3 / 20:6.1f} us", flush=True)
        print(f"  ONE_ROW_NORM  {replay_ms(one) * 1e3 / 20:6.1f} us", flush=True)
        chosen = dict(tg.ONE_ROW_NORM)
        try:
            for bn, bk, warps, stages in itertools.product((8, 16, 32), (256, 512), (4, 8),
                                                           (3, 4)):
                tg.ONE_ROW_NORM.update(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                       num_stages=stages)
                print(f"  BN {bn:2d} BK {bk} w {warps} s {stages}: "
                      f"{replay_ms(one) * 1e3 / 20:6.1f} us", flush=True)
        finally:
            tg.ONE_ROW_NORM.clear()
            tg.ONE_ROW_NORM.update(chosen)
        copies.clear()   # free the copies before the next weight


if __name__ == "__main__":
    main()
