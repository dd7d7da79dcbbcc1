"""The numpy twin (what the sim runs and what the kernels must match): its draws follow the
sort-based float64 distribution, greedy is argmax with lowest-index ties, error rows are
flagged, ties at a threshold keep the lowest token ids, and a row's token does not depend on
its batch."""
import numpy as np
import pytest

from vt.sampling import reference
from vt.sampling.sampler import Sampler

from ._cases import MODES, chi2, chi2_bound, knobs, random_logits

CONFIGS = {  # (temperature, top_k, top_p, min_p)
    "temperature": (0.8, 0, 1.0, 0.0),
    "top_k": (1.0, 7, 1.0, 0.0),
    "top_p": (1.0, 0, 0.75, 0.0),
    "min_p": (1.5, 0, 1.0, 0.05),
    "top_k+top_p": (1.2, 12, 0.8, 0.0),
    "all": (0.7, 20, 0.9, 0.02),
}


def _draws(row, cfg, n, seed=99):
    """n draws from one logits row: one batch row per position."""
    t, k, p, m = cfg
    x = np.broadcast_to(row, (n, row.size))
    return reference.sample_tokens(x, np.arange(n, dtype=np.int32), np.full(n, t, np.float32),
                                   np.full(n, k, np.int32), np.full(n, p, np.float32), np.full(n, m, np.float32),
                                   np.full(n, seed, np.uint64))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_twin_draws_follow_the_sort_based_distribution(name):
    """10^5 draws, chi-square against the float64 reference, nothing outside the kept set."""
    row = (np.random.default_rng(1).standard_normal(40) * 2).astype(np.float32)
    t, k, p, m = CONFIGS[name]
    counts = np.bincount(_draws(row, CONFIGS[name], 100_000), minlength=row.size)
    probs = reference.distribution(row, np.float32(t), k, float(np.float32(p)), float(np.float32(m)))
    assert counts[probs == 0].sum() == 0, "a token outside the kept set was drawn"
    stat, dof = chi2(counts, probs)
    assert dof >= 3 and stat < chi2_bound(dof), f"chi-square {stat:.1f} over {dof} dof"


def test_ties_at_the_threshold_keep_the_lowest_token_ids_uniformly():
    """Five equal maxima, top_k 3: only tokens 2, 5, 9 are drawn, each a third of the time."""
    row = np.zeros(16, np.float32)
    row[[2, 5, 9, 11, 14]] = 4.0
    counts = np.bincount(_draws(row, (1.0, 3, 1.0, 0.0), 30_000), minlength=16)
    assert set(np.flatnonzero(counts)) == {2, 5, 9}
    stat, dof = chi2(counts, reference.distribution(row, 1.0, 3))
    assert stat < chi2_bound(dof)


def test_greedy_is_argmax_with_lowest_index_ties():
    x = np.array([[1, 3, 3, 2], [-0.0, 0.0, -1, -2], [-np.inf, 5, -np.inf, 5]], np.float32)
    kn = knobs(["greedy"] * 3)
    assert reference.sample_tokens(x, np.zeros(3, np.int32), **kn).tolist() == [1, 0, 1]


@pytest.mark.parametrize("mode", list(MODES))
def test_nan_inf_and_all_masked_rows_are_errors(mode):
    """NaN, +inf or all -inf: token -1 and table 0; -inf elsewhere only masks tokens."""
    x = random_logits(np.random.default_rng(2), 5, 300)
    x[0, 10] = np.nan
    x[1, 20] = np.inf
    x[2] = -np.inf
    x[3, 1:] = -np.inf
    table = np.full(8, -7, np.int32)
    out = np.full(5, -9, np.int32)
    kn = knobs([mode] * 5)
    Sampler().run_numpy(x, np.arange(5, dtype=np.int32) + 2, np.arange(5, dtype=np.int32), kn["temperature"],
                        kn["top_k"], kn["top_p"], kn["min_p"], kn["seed"], out, table)
    assert out[:3].tolist() == [-1, -1, -1] and table[2:5].tolist() == [0, 0, 0]
    assert out[3] == 0 and table[5] == 0       # only token 0 is unmasked
    assert 0 <= out[4] < 300 and table[6] == out[4]


def test_a_rows_token_does_not_depend_on_its_batch():
    """The same (logits, knobs, seed, position) alone and at any row of a random batch."""
    rng = np.random.default_rng(4)
    names = list(MODES)
    for trial in range(20):
        S = int(rng.integers(2, 40))
        modes = list(rng.choice(names, S))
        x = random_logits(rng, S, 500, ties=bool(trial % 2))
        pos = rng.integers(0, 10_000, S).astype(np.int32)
        kn = knobs(modes, seed0=int(rng.integers(0, 2**40)))
        batch = reference.sample_tokens(x, pos, **kn)
        for r in rng.choice(S, 3, replace=False):
            alone = reference.sample_tokens(x[r:r + 1], pos[r:r + 1], **{n: v[r:r + 1] for n, v in kn.items()})
            assert alone[0] == batch[r], f"trial {trial} row {r} ({modes[r]})"


def test_draws_change_with_seed_and_position():
    row = np.zeros(1000, np.float32)
    a = _draws(row, (1.0, 0, 1.0, 0.0), 200, seed=1)
    b = _draws(row, (1.0, 0, 1.0, 0.0), 200, seed=2)
    assert len(set(a.tolist())) > 150 and (a != b).mean() > 0.9
