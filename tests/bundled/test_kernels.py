"""Every kernel against its float64 reference, and captured + replayed bit-identical to eager.

Fresh random inputs per case, pure outputs poisoned (NaN) before each run. Tolerances:
fp32 outputs of fp32 paths < 1e-5 relative (max error over max |reference|), fp16/bf16
outputs < 1e-2, index outputs exact.
"""
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from vt.bundled import kernels as K
from vt.bundled.kernels import attention, embedding, gdn, gemm, kvcache, mlp, moe, norm, rope
from vt.bundled.kernels._common import f64, to_storage

from ._util import assert_close, poison

F32, F16 = 1e-5, 1e-2
DTYPES = {"float16": np.float16, "bfloat16": np.uint16}


@dataclass
class Case:
    arrays: dict              # host arrays: inputs, in/out arrays, poisoned outputs
    launch: Callable          # launch(be, stream, device_arrays)
    expect: Callable          # expect(host arrays) -> {name: (expected, rtol)}; rtol 0 = exact


def _st(rng, shape, st, scale=1.0):
    return to_storage(rng.standard_normal(shape) * scale, st)


def _poisoned(shape, dtype):
    return np.full(shape, poison(dtype), dtype)


def case_embed(rng, st):
    a = dict(emb=_st(rng, (64, 96), st), table=rng.integers(0, 64, 9).astype(np.int32),
             rows=rng.integers(0, 9, 5).astype(np.int32), out=_poisoned((5, 96), np.float32))
    return Case(a, lambda be, s, d: be.launch(s, K.EmbedTokens(), d["emb"], d["table"], d["rows"], d["out"]),
                lambda a: {"out": (embedding.reference_embed(a["emb"], a["table"], a["rows"]), 0)})


def case_gather(rng, st):
    a = dict(src=_st(rng, (7, 96), st), idx=np.array([6, 0, 3], np.int32), out=_poisoned((3, 96), st))
    return Case(a, lambda be, s, d: be.launch(s, K.GatherRows(), d["src"], d["idx"], d["out"]),
                lambda a: {"out": (embedding.reference_gather(a["src"], a["idx"]), 0)})


def case_rmsnorm(rng, st):
    a = dict(x=(rng.standard_normal((5, 200)) * 3).astype(np.float32), w=_st(rng, 200, st),
             out=_poisoned((5, 200), st))
    return Case(a, lambda be, s, d: be.launch(s, K.RMSNorm(), d["x"], d["w"], d["out"], eps=1e-6),
                lambda a: {"out": (norm.reference(a["x"], a["w"], 1e-6), F16)})


def case_rope(rng, st):
    D, hq, hk = 64, 4, 2
    a = dict(qkv=_st(rng, (5, (hq + 2 * hk) * D), st), pos=rng.integers(0, 2000, 5).astype(np.int32))

    def expect(a):
        x = f64(a["qkv"]).copy()
        nr = (hq + hk) * D
        x[:, :nr] = rope.reference(a["qkv"][:, :nr].reshape(5, hq + hk, D), a["pos"], 1e4).reshape(5, nr)
        return {"qkv": (x, F16)}
    return Case(a, lambda be, s, d: be.launch(s, K.RoPE(), d["qkv"], d["pos"], n_heads=hq + hk,
                                              head_dim=D, theta=1e4), expect)


def case_kv_write(rng, st):
    D, hq, hk, bs = 32, 4, 2, 8
    a = dict(qkv=_st(rng, (5, (hq + 2 * hk) * D), st),
             slots=rng.choice(6 * bs, 5, replace=False).astype(np.int32),
             kc=_st(rng, (6, bs, hk, D), st), vc=_st(rng, (6, bs, hk, D), st))

    def expect(a):
        kc, vc = kvcache.reference(a["qkv"], a["slots"], a["kc"], a["vc"], hq, hk, D)
        return {"kc": (f64(kc), 0), "vc": (f64(vc), 0)}
    return Case(a, lambda be, s, d: be.launch(s, K.KVWrite(), d["qkv"], d["slots"], d["kc"], d["vc"],
                                              q_heads=hq, kv_heads=hk, head_dim=D), expect)


def case_attention(rng, st, D=64, hq=8, hk=2, bs=8, lens=(1, 37, 0, 16, 9)):
    N, lens = len(lens), np.array(lens, np.int32)
    mb = max(8, -(-int(lens.max()) // bs))  # block-table columns
    nb = N * mb
    bt = rng.permutation(nb).reshape(N, mb).astype(np.int32)
    rows = rng.permutation(N).astype(np.int32)
    a = dict(qkv=_st(rng, (N, (hq + 2 * hk) * D), st), kc=_st(rng, (nb, bs, hk, D), st),
             vc=_st(rng, (nb, bs, hk, D), st), bt=bt, lens=lens, rows=rows,
             out=_poisoned((N, hq * D), st))

    def expect(a):
        q = a["qkv"][:, : hq * D].reshape(N, hq, D)
        o = attention.reference(q, a["kc"], a["vc"], a["bt"], a["lens"], a["rows"])
        return {"out": (o.reshape(N, -1), F16)}
    return Case(a, lambda be, s, d: be.launch(
        s, K.PagedAttention(), d["qkv"], d["kc"], d["vc"], d["bt"], d["lens"], d["rows"], d["out"],
        q_heads=hq, kv_heads=hk, head_dim=D), expect)


def _gdn_case(rng, st, cu, fresh, H=3, dk=64, dv=32, starts=None):
    """starts: each segment's first position (default 0); positions go on from it."""
    nseg, T = len(cu) - 1, cu[-1]
    starts = [0] * nseg if starts is None else starts
    pos = np.concatenate([s + np.arange(b - a) for s, a, b in zip(starts, cu[:-1], cu[1:])])
    a = dict(proj=_st(rng, (T, 2 * H * (dk + dv) + 2 * H), st),
             A_log=np.log(rng.uniform(1, 16, H)).astype(np.float32),
             dt_bias=rng.uniform(-3, 1, H).astype(np.float32), w=_st(rng, dv, st, 0.3) + 0,
             states=(rng.standard_normal((nseg + 2, H, dk, dv)) * 0.3).astype(np.float32),
             sidx=rng.permutation(nseg + 2)[:nseg].astype(np.int32), cu=np.array(cu, np.int32),
             pos=pos.astype(np.int32), out=_poisoned((T, H * dv), st))

    def expect(a):
        o, S = gdn.reference(a["proj"], a["A_log"], a["dt_bias"], a["w"], a["states"], a["sidx"],
                             a["cu"], a["pos"], H, dk, dv, fresh, 1e-6)
        return {"out": (o, F16), "states": (S, F32)}
    return Case(a, lambda be, s, d: be.launch(
        s, K.GDN(), d["proj"], d["A_log"], d["dt_bias"], d["w"], d["states"], d["sidx"], d["cu"],
        d["pos"], d["out"], heads=H, dk=dk, dv=dv, fresh=fresh, eps=1e-6), expect)


def case_gdn_decode(rng, st):
    """fresh=False: every state goes on, position 0 included (a padded decode row's)."""
    return _gdn_case(rng, st, [0, 1, 2, 3, 4], fresh=False, starts=[5, 0, 17, 1])


def case_gdn_prefill(rng, st):
    return _gdn_case(rng, st, [0, 3, 8, 9], fresh=True)


def case_gdn_prefill_chunks(rng, st):
    """A chunked prefill: first chunks (position 0, zero state) and continuing ones (their
    state goes on) in one launch."""
    return _gdn_case(rng, st, [0, 3, 8, 9, 13, 14], fresh=True, starts=[0, 5, 0, 12, 1])


def case_attention_d128(rng, st):
    return case_attention(rng, st, D=128)


def case_attention_bench_heads_long_context(rng, st):
    """The bench's heads (32 q / 8 kv, D=128) at 24 rows x up to 512 keys: few splits (2 on an
    H200), each split many batches of keys per warp, some rows shorter than a batch."""
    lens = rng.integers(1, 513, 24)
    lens[:3] = (512, 3, 0)
    return case_attention(rng, st, D=128, hq=32, hk=8, bs=16, lens=tuple(lens))


def case_attention_unsplit_d96(rng, st):
    """72 rows x 8 kv heads fill the GPU without splitting (P == 1 writes the output itself);
    D=96 reads a row with 8 lanes x 12 elements."""
    lens = rng.integers(0, 200, 72)
    return case_attention(rng, st, D=96, hq=16, hk=8, bs=16, lens=tuple(lens))


def case_gdn_d128(rng, st):
    return _gdn_case(rng, st, [0, 1, 2], fresh=True, H=2, dk=128, dv=128, starts=[0, 9])


def case_silu_mul(rng, st):
    a = dict(gu=_st(rng, (2, 6, 96), st, 2), out=_poisoned((2, 6, 48), st))
    return Case(a, lambda be, s, d: be.launch(s, K.SiluMul(), d["gu"], d["out"]),
                lambda a: {"out": (mlp.reference(a["gu"]), F16)})


def case_router(rng, st):
    lg = rng.standard_normal((7, 8)).astype(np.float32)
    lg[3, 5] = lg[3, 2]  # a tie: the lower expert index wins in both implementations
    a = dict(logits=lg, wd=_poisoned((7, 8), np.float32), topk=_poisoned((7, 3), np.int32))

    def expect(a):
        wd, sel = moe.reference_router(a["logits"], 3)
        return {"wd": (wd, F32), "topk": (sel, 0)}
    return Case(a, lambda be, s, d: be.launch(s, K.Router(), d["logits"], d["wd"], d["topk"], k=3), expect)


def case_combine(rng, st):
    lg = rng.standard_normal((5, 8))
    lg[:, 0] = -np.inf     # expert 0 is nobody's pick
    wd, sel = moe.reference_router(lg, 2)
    y = _st(rng, (8, 5, 64), st)
    y[0, :, :] = to_storage(np.full((5, 64), np.inf), st)  # an unselected expert's inf never leaks
    wd[:, 0] = 0
    a = dict(wd=wd.astype(np.float32), topk=sel.astype(np.int32), y=y,
             out=rng.standard_normal((5, 64)).astype(np.float32))
    return Case(a, lambda be, s, d: be.launch(s, K.Combine(), d["wd"], d["topk"], d["y"], d["out"]),
                lambda a: {"out": (moe.reference_combine(a["wd"], a["y"], a["out"]), F32)})


_GEMMS = weakref.WeakKeyDictionary()


def _gemm_of(be):
    """One Gemm (cuBLAS handle + workspace) per backend: bound eagerly, then reused in captures."""
    if be not in _GEMMS:
        _GEMMS[be] = K.Gemm([be.empty((gemm.WORKSPACE_BYTES,), np.uint8)])
    return _GEMMS[be]


def _gemm_case(rng, st, xs, ws, out_dtype, accumulate):
    out_shape = ws[:-2] + (xs[-2], ws[-2]) if len(ws) == 3 else (xs[0], ws[0])
    a = dict(x=_st(rng, xs, st), w=_st(rng, ws, st, 0.1),
             out=(rng.standard_normal(out_shape).astype(out_dtype) if accumulate
                  else _poisoned(out_shape, out_dtype)))
    if np.dtype(out_dtype) == np.float16 and st == np.uint16:
        a["out"] = to_storage(np.zeros(out_shape) if accumulate else np.full(out_shape, np.nan), st)
    tol = F32 if np.dtype(out_dtype) == np.float32 else F16
    return Case(a, lambda be, s, d: be.launch(s, _gemm_of(be), d["x"], d["w"], d["out"],
                                              accumulate=accumulate),
                lambda a: {"out": (gemm.reference(a["x"], a["w"], a["out"] if accumulate else None), tol)})


def case_gemm_f32(rng, st):
    return _gemm_case(rng, st, (5, 256), (96, 256), np.float32, False)


def case_gemm_storage(rng, st):
    return _gemm_case(rng, st, (5, 256), (96, 256), np.float16, False)


def case_gemm_accumulate(rng, st):
    return _gemm_case(rng, st, (3, 128), (64, 128), np.float32, True)


def case_gemm_batched_shared_x(rng, st):
    return _gemm_case(rng, st, (5, 64), (4, 32, 64), np.float16, False)


def case_gemm_batched(rng, st):
    return _gemm_case(rng, st, (4, 5, 64), (4, 32, 64), np.float16, False)


def _routed_case(rng, st, per_slot):
    """RoutedGemm (storage out, as in the model): 3 rows, top-2 of 6 experts, one expert
    picked twice; x one row per row (gate/up) or one per slot (down)."""
    n, k, E, N, K_ = 3, 2, 6, 48, 64
    topk = np.array([[4, 1], [1, 5], [0, 3]], np.int32)
    a = dict(x=_st(rng, (n * k if per_slot else n, K_), st), w=_st(rng, (E, N, K_), st, 0.1),
             topk=topk, out=_poisoned((n * k, N), st))
    return Case(a, lambda be, s, d: be.launch(s, K.RoutedGemm(_gemm_of(be)), d["x"], d["w"],
                                              d["topk"], d["out"]),
                lambda a: {"out": (gemm.reference_routed(a["x"], a["w"], a["topk"]), F16)})


def case_gemm_routed_rows(rng, st):
    return _routed_case(rng, st, per_slot=False)


def case_gemm_routed_slots(rng, st):
    return _routed_case(rng, st, per_slot=True)


def case_combine_routed(rng, st):
    wd, topk = moe.reference_router(rng.standard_normal((5, 8)), 2)
    a = dict(wd=wd.astype(np.float32), topk=topk.astype(np.int32), y=_st(rng, (10, 64), st),
             out=rng.standard_normal((5, 64)).astype(np.float32))
    return Case(a, lambda be, s, d: be.launch(s, K.CombineRouted(), d["wd"], d["topk"], d["y"], d["out"]),
                lambda a: {"out": (moe.reference_combine_routed(a["wd"], a["topk"], a["y"], a["out"]), F32)})


CASES = {n[5:]: f for n, f in dict(globals()).items() if n.startswith("case_")}
_DTYPE_FREE = {"router", "sample_greedy", "sample_top_k"}
PARAMS = [pytest.param(n, d, id=f"{n}-{d}") for n in CASES for d in DTYPES
          if not (n in _DTYPE_FREE and d == "bfloat16")]


def _run(io, case, capture=False):
    d = {k: io.put(v) for k, v in case.arrays.items()}
    be, s = io.be, io.s
    if not capture:
        case.launch(be, s, d)
        s.synchronize()
        return {k: io.get(v) for k, v in d.items()}
    with be.pool.scratch_warmup("kernel warm-up"):
        case.launch(be, s, d)
        s.synchronize()
    before = be.pool.stats().mallocs_during_capture
    with be.capture(s, name="kernel") as cap:
        case.launch(be, s, d)
    assert be.pool.stats().mallocs_during_capture == before == 0
    for k, v in case.arrays.items():   # fresh inputs, outputs poisoned again
        io.set(d[k], v)
    cap.graph.launch(s)
    s.synchronize()
    return {k: io.get(v) for k, v in d.items()}


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_kernel_matches_float64_reference(io, name, dtype):
    """Each kernel's output is within its stated tolerance of the float64 reference."""
    case = CASES[name](np.random.default_rng(abs(hash((name, dtype))) % 2**32), DTYPES[dtype])
    got = _run(io, case)
    for key, (want, rtol) in case.expect(case.arrays).items():
        g = f64(got[key]) if got[key].dtype.kind in "fu" and got[key].dtype != np.int32 else got[key]
        if rtol == 0:
            np.testing.assert_array_equal(g, want, err_msg=f"{name}.{key}")
        else:
            assert_close(g, want, rtol, f"{name}.{key}")


@pytest.mark.parametrize("name,dtype", [p for p in PARAMS if p.values[1] == "float16"])
def test_kernel_replay_is_bit_identical_to_eager(io, name, dtype):
    """A captured kernel replayed on fresh copies of the inputs gives exactly the eager bytes."""
    case = CASES[name](np.random.default_rng(7), DTYPES[dtype])
    eager = _run(io, case)
    replay = _run(io, case, capture=True)
    for k in eager:
        assert eager[k].tobytes() == replay[k].tobytes(), f"{name}.{k} differs after replay"


@pytest.mark.gpu
def test_gemm_release_stream_returns_the_workspace_for_another_stream():
    """A Gemm with one workspace serves one stream; release_stream (Runner.close) destroys
    that stream's cuBLAS handle and lets the next stream take the workspace."""
    from vt.backend.cuda import CudaBackend
    with CudaBackend() as be:
        g = K.Gemm([be.empty((gemm.WORKSPACE_BYTES,), np.uint8)])
        x, w, out = be.empty((2, 64), np.float16), be.empty((32, 64), np.float16), be.empty((2, 32), np.float32)
        first, second = be.stream("first"), be.stream("second")
        be.launch(first, g, x, w, out)   # values do not matter: this is about the handles
        with pytest.raises(RuntimeError, match="no pre-allocated cuBLAS workspace left"):
            be.launch(second, g, x, w, out)
        first.synchronize()
        g.release_stream(first.handle)
        g.release_stream(first.handle)   # idempotent
        be.launch(second, g, x, w, out)
        second.synchronize()
        g.close()
