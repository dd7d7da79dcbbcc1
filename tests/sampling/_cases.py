"""Shared test inputs of the sampler: per-mode knobs, random logits, a chi-square bound."""
import math

import numpy as np

# mode -> (temperature, top_k, top_p, min_p)
MODES = {
    "greedy": (0.0, 0, 1.0, 0.0),
    "temperature": (0.8, 0, 1.0, 0.0),
    "top_k": (1.0, 50, 1.0, 0.0),
    "top_k_large": (1.2, 3000, 1.0, 0.0),
    "top_p": (1.0, 0, 0.9, 0.0),
    "min_p": (1.5, 0, 1.0, 0.05),
    "combined": (0.7, 200, 0.8, 0.01),
}


def knobs(modes: list[str], seed0: int = 11) -> dict:
    """The sampler's per-row vectors for rows in `modes`."""
    t, k, p, m = zip(*(MODES[n] for n in modes))
    n = len(modes)
    return dict(temperature=np.array(t, np.float32), top_k=np.array(k, np.int32), top_p=np.array(p, np.float32),
                min_p=np.array(m, np.float32), seed=np.arange(seed0, seed0 + n, dtype=np.uint64))


def random_logits(rng, S: int, V: int, ties: bool = False) -> np.ndarray:
    """Fresh logits; `ties`: rounded to 1/4 so thresholds fall inside runs of equal values, with
    some masked (-inf) tokens."""
    x = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    if ties:
        x = np.round(x * 4) / 4
        x[rng.random((S, V)) < 0.01] = -np.inf
    return x.astype(np.float32)


def chi2_bound(dof: int, z: float = 5.0) -> float:
    """Wilson-Hilferty upper quantile of chi-square(dof) at about z sigma (p ~ 3e-7)."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic over the tokens expected >= 5 times (the rest pooled in one bin)."""
    n = counts.sum()
    e = probs * n
    big = e >= 5
    stat = (((counts[big] - e[big]) ** 2) / e[big]).sum()
    rest_c, rest_e = counts[~big].sum(), e[~big].sum()
    dof = int(big.sum()) - 1
    if rest_e >= 5:
        stat += (rest_c - rest_e) ** 2 / rest_e
        dof += 1
    return float(stat), dof
