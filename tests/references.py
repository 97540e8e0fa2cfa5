"""Independent reference implementations the engine's tests compare against."""
from __future__ import annotations

import numpy as np
from scipy import stats

from pipeline.engine.core.request import SamplingParams


def reference_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Independent implementation: temperature -> top-k -> top-p -> min-p -> normalise."""
    z = logits.astype(np.float64) / p.temperature
    keep = np.ones_like(z, dtype=bool)
    if p.top_k:
        keep &= z >= np.sort(z)[::-1][p.top_k - 1]
    probs = np.where(keep, np.exp(z - z.max()), 0.0)
    probs /= probs.sum()
    if p.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        drop = np.zeros_like(keep)
        drop[order] = before >= p.top_p
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum()
    if p.min_p > 0:
        probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
        probs /= probs.sum()
    return probs



def chi2_pvalue(counts: dict[tuple, int], exact: dict[tuple, float], n: int) -> float:
    """Chi-square p-value of outcome counts against exact probabilities; outcomes expected fewer than
    5 times are pooled into one cell, and an outcome of probability 0 fails outright."""
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for seq, prob in exact.items():
        if prob * n >= 5:
            observed.append(counts.get(seq, 0))
            expected.append(prob * n)
        else:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += prob * n
    assert sum(v for s, v in counts.items() if exact.get(s, 0.0) == 0.0) == 0, "impossible continuation"
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    expected = np.array(expected) * (n / sum(expected))
    return float(stats.chisquare(observed, expected).pvalue)
