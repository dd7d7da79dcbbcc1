"""Row invariance of every decode kernel: a row computed alone, or among other rows at any
position and any row count, gives the same bytes.

Each case has per-row arrays (axis 0 = rows; outputs poisoned) and shared ones. It runs once
on all M rows, then on subsets (each of some rows alone, random subsets in random order,
counts that cross the GEMM's 64-row block), and every row of every subset must equal its
bytes in the full run. On cuda the GEMMs run in the model's batch-invariant configuration
(Gemm rows_block = INVARIANT_ROWS, padded and zeroed like the model) and attention with a
fixed split count; those are what HybridModel(batch_invariant=True) runs.
"""
import weakref

import numpy as np
import pytest

from vt.bundled import kernels as K
from vt.bundled.kernels import gemm
from vt.bundled.kernels._common import to_storage
from vt.bundled.model import INVARIANT_ROWS
from vt.sampling import Sampler

from ._util import poison

ST = np.float16
_GEMMS = weakref.WeakKeyDictionary()


def _gemm(be, blocked=True):
    """One Gemm per (backend, mode) whose cuBLAS handle is bound on first (eager) use."""
    key = _GEMMS.setdefault(be, {})
    if blocked not in key:
        key[blocked] = K.Gemm([be.empty((gemm.WORKSPACE_BYTES,), np.uint8)],
                              rows_block=INVARIANT_ROWS if blocked else None)
    return key[blocked]


def _st(rng, shape, scale=1.0):
    return to_storage(rng.standard_normal(shape) * scale, ST)


def _padded(m):
    return -(-m // INVARIANT_ROWS) * INVARIANT_ROWS


def _run(io, case, sel):
    """The case on rows `sel` (in that order): its per-row outputs as host arrays."""
    per_row, shared, launch, outs = case
    d = {k: io.put(v[sel]) for k, v in per_row.items()}
    d.update({k: io.put(v) for k, v in shared.items()})
    launch(io.be, io.s, d, len(sel))
    io.s.synchronize()
    return {k: io.get(d[k]) for k in outs}


def _check(io, case, M, rng):
    full = _run(io, case, np.arange(M))
    subsets = [np.array([r]) for r in (0, M - 1, int(rng.integers(M)))]
    subsets += [rng.permutation(M)[: int(rng.integers(2, M + 1))] for _ in range(3)]
    for sel in subsets:
        got = _run(io, case, sel)
        for k, v in got.items():
            for j, r in enumerate(sel):
                assert v[j].tobytes() == full[k][r].tobytes(), \
                    f"{k}: row {r} differs when run among {len(sel)} rows (at {j}) vs {M}"


# ---------------------------------------------------------------- cases: (per_row, shared, launch, outs)

def case_gemm(rng, out_dtype=np.float32, accumulate=False, K_=256, N=96):
    """The model's GEMM call: its rows zero-padded to the 64-row block (as HybridModel does)."""
    M = 150   # three blocks
    per_row = dict(x=_st(rng, (M, K_)),
                   out=(rng.standard_normal((M, N)).astype(out_dtype) if accumulate
                        else np.full((M, N), poison(out_dtype), out_dtype)))
    shared = dict(w=_st(rng, (N, K_), 0.1))

    def launch(be, s, d, m):
        P = _padded(m)
        x, out = be.empty((P, K_), ST), be.empty((P, N), out_dtype)
        be.launch(s, K.Fill(), x, value=0)
        be.launch(s, K.Fill(), out, value=0)
        be.copy_d2d(x[:m], d["x"], s)
        be.copy_d2d(out[:m], d["out"], s)
        be.launch(s, _gemm(be), x, d["w"], out, accumulate=accumulate)
        be.copy_d2d(d["out"], out[:m], s)
    return per_row, shared, launch, ["out"], M


def case_gemm_storage(rng):
    return case_gemm(rng, out_dtype=ST)


def case_gemm_accumulate(rng):
    return case_gemm(rng, accumulate=True, K_=128, N=64)


def case_moe_all_experts(rng, routed=False):
    """Router GEMM's output -> top-k -> expert gate/up GEMM -> SiLU -> down GEMM -> combine,
    the model's all-expert MoE block in blocks of 64 rows (routed=True: the routed path)."""
    M, E, k, F, H = 70, 6, 2, 32, 64
    per_row = dict(x=_st(rng, (M, H)), logits=rng.standard_normal((M, E)).astype(np.float32),
                   out=rng.standard_normal((M, H)).astype(np.float32))
    shared = dict(egu=_st(rng, (E, 2 * F, H), 0.2), edown=_st(rng, (E, H, F), 0.2))

    def launch(be, s, d, m):
        wd, topk = be.empty((m, E), np.float32), be.empty((m, k), np.int32)
        be.launch(s, K.Router(), d["logits"], wd, topk, k=k)
        if routed:
            gu, act, y = be.empty((m * k, 2 * F), ST), be.empty((m * k, F), ST), be.empty((m * k, H), ST)
            rg = K.RoutedGemm(_gemm(be, blocked=False))
            be.launch(s, rg, d["x"], d["egu"], topk, gu)
            be.launch(s, K.SiluMul(), gu, act)
            be.launch(s, rg, act, d["edown"], topk, y)
            be.launch(s, K.CombineRouted(), wd, topk, y, d["out"])
            return
        P = _padded(m)
        B, C = INVARIANT_ROWS, P // INVARIANT_ROWS
        x = be.empty((P, H), ST)
        be.launch(s, K.Fill(), x, value=0)
        be.copy_d2d(x[:m], d["x"], s)
        gu, act, y = be.empty((C, E, B, 2 * F), ST), be.empty((C, E, B, F), ST), be.empty((C, E, B, H), ST)
        be.launch(s, _gemm(be), x, d["egu"], gu)
        be.launch(s, K.SiluMul(), gu, act)
        be.launch(s, _gemm(be), act, d["edown"], y)
        be.launch(s, K.Combine(), wd, topk, y, d["out"])
    return per_row, shared, launch, ["out"], M


def case_rmsnorm(rng):
    M = 40
    per_row = dict(x=(rng.standard_normal((M, 200)) * 3).astype(np.float32),
                   out=np.full((M, 200), poison(ST), ST))
    return (per_row, dict(w=_st(rng, 200)),
            lambda be, s, d, m: be.launch(s, K.RMSNorm(), d["x"], d["w"], d["out"], eps=1e-6), ["out"], M)


def case_silu_mul(rng):
    M = 40
    per_row = dict(gu=_st(rng, (M, 96), 2), out=np.full((M, 48), poison(ST), ST))
    return per_row, {}, lambda be, s, d, m: be.launch(s, K.SiluMul(), d["gu"], d["out"]), ["out"], M


def case_rope(rng):
    M, D, hq, hk = 40, 64, 4, 2
    per_row = dict(qkv=_st(rng, (M, (hq + 2 * hk) * D)), pos=rng.integers(0, 2000, M).astype(np.int32))
    return (per_row, {}, lambda be, s, d, m: be.launch(s, K.RoPE(), d["qkv"], d["pos"], n_heads=hq + hk,
                                                      head_dim=D, theta=1e4), ["qkv"], M)


def case_router(rng):
    M = 40
    per_row = dict(logits=rng.standard_normal((M, 8)).astype(np.float32),
                   wd=np.full((M, 8), np.nan, np.float32), topk=np.full((M, 3), -1, np.int32))
    return (per_row, {}, lambda be, s, d, m: be.launch(s, K.Router(), d["logits"], d["wd"], d["topk"], k=3),
            ["wd", "topk"], M)


def case_embed(rng):
    M = 40
    per_row = dict(rows=rng.integers(0, 9, M).astype(np.int32), out=np.full((M, 96), np.nan, np.float32))
    shared = dict(emb=_st(rng, (64, 96)), table=rng.integers(0, 64, 9).astype(np.int32))
    return (per_row, shared, lambda be, s, d, m: be.launch(s, K.EmbedTokens(), d["emb"], d["table"],
                                                          d["rows"], d["out"]), ["out"], M)


def case_attention(rng):
    """The bench's heads (32 q / 8 kv, D=128), up to 700 keys: several splits on cuda."""
    M, D, hq, hk, bs = 40, 128, 32, 8, 16
    mb = 44
    lens = rng.integers(0, mb * bs, M).astype(np.int32)
    lens[:3] = (mb * bs, 1, 0)
    per_row = dict(qkv=_st(rng, (M, (hq + 2 * hk) * D)), lens=lens,
                   rows=rng.integers(0, M, M).astype(np.int32), out=np.full((M, hq * D), poison(ST), ST))
    shared = dict(kc=_st(rng, (M * mb, bs, hk, D)), vc=_st(rng, (M * mb, bs, hk, D)),
                  bt=rng.permutation(M * mb).reshape(M, mb).astype(np.int32))

    def launch(be, s, d, m):
        splits = K.attention.invariant_splits(hk) if be.name == "cuda" else 1
        be.launch(s, K.PagedAttention(), d["qkv"], d["kc"], d["vc"], d["bt"], d["lens"], d["rows"],
                  d["out"], q_heads=hq, kv_heads=hk, head_dim=D, fixed_splits=splits)
    return per_row, shared, launch, ["out"], M


def case_gdn_decode(rng, H=2, dk=128, dv=128):
    M = 24
    per_row = dict(proj=_st(rng, (M, 2 * H * (dk + dv) + 2 * H)),
                   states=(rng.standard_normal((M, H, dk, dv)) * 0.3).astype(np.float32),
                   out=np.full((M, H * dv), poison(ST), ST))
    shared = dict(A_log=np.log(rng.uniform(1, 16, H)).astype(np.float32),
                  dt_bias=rng.uniform(-3, 1, H).astype(np.float32), w=_st(rng, dv, 0.3))

    def launch(be, s, d, m):
        # [0..m]: state_idx = idx[:m] (row b's own state), cu = idx, positions = idx[:m]
        # (unread: fresh=False)
        idx = _iota(be, s, m)
        be.launch(s, K.GDN(), d["proj"], d["A_log"], d["dt_bias"], d["w"], d["states"], idx[:m], idx,
                  idx[:m], d["out"], heads=H, dk=dk, dv=dv, fresh=False, eps=1e-6)
    return per_row, shared, launch, ["out", "states"], M


def _iota(be, s, m):
    host = be.pinned_empty((m + 1,), np.int32)
    host[:] = np.arange(m + 1)
    d = be.empty((m + 1,), np.int32)
    be.copy_h2d(d, host, s)
    s.synchronize()
    return d


def case_sample(rng):
    M, V = 40, 300
    temp = rng.uniform(0.3, 2, M).astype(np.float32)
    temp[::3] = 0
    per_row = dict(logits=(rng.standard_normal((M, V)) * 2).astype(np.float32),
                   rows=np.arange(M, dtype=np.int32), pos=rng.integers(0, 100, M).astype(np.int32),
                   temp=temp, top_k=rng.integers(0, 60, M).astype(np.int32),
                   top_p=rng.uniform(0.3, 1, M).astype(np.float32),
                   min_p=rng.uniform(0, 0.2, M).astype(np.float32),
                   seed=rng.integers(0, 2**63, M, dtype=np.uint64), out=np.full(M, -1, np.int32))
    shared = dict(table=np.zeros(M + 1, np.int32))
    return (per_row, shared, lambda be, s, d, m: be.launch(
        s, Sampler(), d["logits"], d["rows"], d["pos"], d["temp"], d["top_k"], d["top_p"],
        d["min_p"], d["seed"], d["out"], d["table"]), ["out"], M)


CASES = {n[5:]: f for n, f in dict(globals()).items() if n.startswith("case_")}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_row_is_identical_alone_and_in_any_batch(io, name):
    """A row's output bytes do not depend on the other rows, their count or its position."""
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    *case, M = CASES[name](rng)
    _check(io, case, M, rng)


def test_routed_and_all_expert_moe_agree_bit_for_bit_on_the_sim(sim_backend):
    """The sim's routed expert path (small batches) gives the all-expert path's bytes, so a
    default (not batch_invariant) sim model is row-invariant across the path switch too."""
    from ._util import DeviceIO
    io = DeviceIO(sim_backend)
    rng = np.random.default_rng(5)
    *dense, M = case_moe_all_experts(rng)
    *routed, _ = case_moe_all_experts(np.random.default_rng(5), routed=True)
    sel = np.arange(M)
    assert _run(io, dense, sel)["out"].tobytes() == _run(io, routed, sel)["out"].tobytes()


def test_plain_numpy_gemm_is_row_invariant_without_blocks(sim_backend):
    """Gemm without rows_block (the default model) on the sim: still row-invariant at every M
    (row-wise products); np.matmul over [M, K] is not, which this test would catch."""
    from ._util import DeviceIO
    io = DeviceIO(sim_backend)
    rng = np.random.default_rng(6)
    per_row = dict(x=_st(rng, (33, 1024)), out=np.full((33, 256), np.nan, np.float32))
    shared = dict(w=_st(rng, (256, 1024), 0.1))
    case = (per_row, shared, lambda be, s, d, m: be.launch(s, _gemm(be, blocked=False), d["x"], d["w"],
                                                           d["out"]), ["out"])
    _check(io, case, 33, rng)
