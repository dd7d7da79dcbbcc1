"""Numpy side of the sampler.

sample_tokens: the twin the sim backend runs. It gives exactly the kernels' tokens: the same
order (logit desc, token id asc), the same float32 scaled logits, the same fixed-point top_p
mass, the same keyed uniforms and double race keys; it sorts where the kernels radix-select.
(The kernels' double log/exp come from CUDA's libdevice, the twin's from the host libm: a
last-bit difference could flip a token only when two race keys or a top_p mass boundary agree
to ~1e-16, which no test here meets.)

distribution: the plain sort-based definition in float64, the yardstick of the tests.
"""
from __future__ import annotations

import numpy as np

_MASS_ONE = 2.0**40  # fixed-point scale of a probability weight (kernels: weight())
_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (np.uint32(0x9E3779B9), np.uint32(0xBB67AE85))


def philox4x32_10(counter, key) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11):
    four u32 counter words and two u32 key words (arrays of one shape) -> four u32 words."""
    c0, c1, c2, c3 = (np.atleast_1d(np.asarray(c, np.uint32)) for c in counter)
    k0, k1 = (np.atleast_1d(np.asarray(k, np.uint32)).copy() for k in key)
    u32, hi = np.uint32, np.uint64(32)
    for _ in range(10):
        p0, p2 = c0.astype(np.uint64) * _PHILOX_M[0], c2.astype(np.uint64) * _PHILOX_M[1]
        c0, c1, c2, c3 = ((p2 >> hi).astype(u32) ^ c1 ^ k0, p2.astype(u32),
                          (p0 >> hi).astype(u32) ^ c3 ^ k1, p0.astype(u32))
        k0 += _PHILOX_W[0]
        k1 += _PHILOX_W[1]
    return c0, c1, c2, c3


def row_key(seed, positions) -> np.ndarray:
    """Each row's 64-bit key [S] u64 (the kernels' row_key, device_code.ROW_KEY): Philox4x32-10
    keyed on the seed, the position as its counter."""
    seed, pos = np.broadcast_arrays(np.atleast_1d(np.asarray(seed, np.uint64)),
                                    np.atleast_1d(np.asarray(positions)).astype(np.uint32))
    zero = np.zeros_like(pos)
    x0, x1, _, _ = philox4x32_10((pos, zero, zero, zero),
                                 ((seed & np.uint64(0xFFFFFFFF)).astype(np.uint32), (seed >> np.uint64(32)).astype(np.uint32)))
    return (x1.astype(np.uint64) << np.uint64(32)) | x0.astype(np.uint64)


def lowbias32(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.uint32)
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def gumbel(seed, positions, tokens) -> np.ndarray:
    """The race noise g = -log(-log(u)) of each (row, token): u keyed on (seed, position, token)."""
    key = row_key(seed, positions)
    k1 = (key & np.uint64(0xFFFFFFFF)).astype(np.uint32)[:, None]
    k2 = (key >> np.uint64(32)).astype(np.uint32)[:, None]
    h1 = lowbias32(lowbias32(np.asarray(tokens).astype(np.uint32)[None, :] ^ k1) + k2)
    lo = lowbias32(h1 ^ k1 ^ np.uint32(0x85EBCA6B)) >> np.uint32(12)
    w = (h1.astype(np.uint64) << np.uint64(20)) | lo.astype(np.uint64)
    return -np.log(-np.log((w.astype(np.float64) + 0.5) * 2.0**-52))


def weights(z: np.ndarray, zmax: np.ndarray) -> np.ndarray:
    """Fixed-point probability weights (40 fraction bits) of scaled logits z [S, n]."""
    d = z.astype(np.float64) - zmax[:, None]
    with np.errstate(invalid="ignore"):
        return np.where(d < -28.0, 0.0, np.floor(np.exp(np.maximum(d, -28.0)) * _MASS_ONE)).astype(np.uint64)


def sample_tokens(logits, positions, temperature, top_k, top_p, min_p, seed) -> np.ndarray:
    """The kernels' tokens [S] int32 (-1 for an error row, see vt.sampling.sampler)."""
    x = np.asarray(logits, np.float32)
    S, V = x.shape
    x = np.where(x == 0, np.float32(0), x)  # -0.0 ranks as +0.0
    t = np.asarray(temperature, np.float32).reshape(S)
    k = np.asarray(top_k, np.int32).reshape(S)
    p = np.asarray(top_p, np.float32).reshape(S)
    mp = np.asarray(min_p, np.float32).reshape(S)
    greedy = ~(t > 0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        finite_x = np.where(np.isnan(x), -np.inf, x)
        toks = np.argmax(finite_x, axis=1).astype(np.int64)
        inv_t = np.where(greedy, np.float32(1), np.float32(1) / np.where(greedy, np.float32(1), t))
        z = x * inv_t[:, None]
        zmax = finite_x.max(axis=1) * inv_t
        err = np.isnan(x).any(1) | np.isposinf(x).any(1) | (finite_x.max(axis=1) == -np.inf)
    # A finite max whose scaled value overflows (a tiny temperature) keeps the argmax: the limit.
    rows = np.flatnonzero(~greedy & ~err & np.isfinite(zmax))
    if rows.size:
        toks[rows] = _race(x[rows], z[rows], zmax[rows], k[rows], p[rows], mp[rows],
                           np.asarray(seed, np.uint64).reshape(S)[rows], np.asarray(positions).reshape(S)[rows])
    toks[err] = -1
    return toks.astype(np.int32)


def _race(x, z, zmax, k, p, mp, seed, positions) -> np.ndarray:
    S, V = x.shape
    order = np.argsort(-x, axis=1, kind="stable")         # logit desc, token id asc
    zs = np.take_along_axis(z, order, axis=1)
    rank = np.arange(V)[None, :]
    n_k = np.where((k > 0) & (k < V), k, V)
    w = np.where(rank < n_k[:, None], weights(zs, zmax.astype(np.float64)), np.uint64(0))
    mass = w.sum(axis=1, dtype=np.uint64)
    q = np.ceil(p.astype(np.float64) * mass.astype(np.float64))
    q = np.where(q >= mass.astype(np.float64), mass, np.maximum(q, 1).astype(np.uint64))
    n_p = np.where(p < 1, (np.cumsum(w, axis=1, dtype=np.uint64) < q[:, None]).sum(axis=1) + 1, V)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_mp = np.where(mp > 0, np.log(mp.astype(np.float64)), -np.inf)
        keep = (rank < np.minimum(n_k, n_p)[:, None]) & (zs.astype(np.float64) - zmax[:, None] >= log_mp[:, None])
    kept = np.zeros((S, V), bool)
    np.put_along_axis(kept, order, keep, axis=1)
    with np.errstate(invalid="ignore"):
        key = z.astype(np.float64) + gumbel(seed, positions, np.arange(V))
    return np.argmax(np.where(kept, key, -np.inf), axis=1)


def distribution(logits_row, temperature, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The sort-based definition in float64: probabilities [V] of one row (sampling, T > 0)."""
    x = np.asarray(logits_row, np.float64)
    V = x.size
    order = np.lexsort((np.arange(V), -x))                 # logit desc, token id asc
    p = np.exp((x[order] - x[order[0]]) / temperature)
    if 0 < top_k < V:
        p[top_k:] = 0
    p /= p.sum()
    if top_p < 1:
        n = int(np.searchsorted(np.cumsum(p), top_p)) + 1  # smallest prefix reaching top_p
        p[n:] = 0
    p[p < min_p * p[0]] = 0
    out = np.zeros(V)
    out[order] = p / p.sum()
    return out
