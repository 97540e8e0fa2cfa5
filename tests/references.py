"""Independent reference implementations the engine's tests compare against."""
from __future__ import annotations

import itertools
from typing import Callable

import numpy as np
import torch
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


def chi2_pvalue(counts: dict, exact: dict, n: int, min_expected: float = 5.0) -> float:
    """Chi-square p-value of outcome counts against exact probabilities; outcomes expected fewer than
    min_expected times are pooled into one cell (min_expected 0: every possible outcome its own cell),
    and an outcome of probability 0 fails outright."""
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for seq, prob in exact.items():
        if prob > 0 and prob * n >= min_expected:
            observed.append(counts.get(seq, 0))
            expected.append(prob * n)
        else:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += prob * n
    assert sum(v for s, v in counts.items() if exact.get(s, 0.0) == 0.0) == 0, "impossible continuation"
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    return _chisquare(observed, expected, n)


def detectable_shift(exact: dict, n: int, alpha: float, power: float = 0.9, min_expected: float = 5.0) -> float:
    """The power analysis a statistical test states: the smallest share of the most likely outcome's
    probability that, moved to the second most likely one, chi2_pvalue's test over n samples rejects
    with probability `power` at `alpha` (noncentral chi-square over the same pooled bins)."""
    probs = sorted((p for p in exact.values() if p > 0), reverse=True)
    bins = sum(p * n >= min_expected for p in probs) + any(p * n < min_expected for p in probs)
    df = max(bins - 1, 1)
    critical = stats.chi2.isf(alpha, df)
    lo, hi = 0.0, 1e6                                 # the noncentrality reaching `power`
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if stats.ncx2.sf(critical, df, mid) < power else (lo, mid)
    delta = np.sqrt(hi / (n * (1 / probs[0] + 1 / probs[1])))
    return float(delta / probs[0])


def _chisquare(observed: list, expected: list, n: int) -> float:
    """scipy's chi-square p-value, the expected counts scaled to sum to n (rounding aside, they do)."""
    return float(stats.chisquare(observed, np.array(expected) * (n / sum(expected))).pvalue)


# ---- the exact law of short outputs, and its chi-square bins ----------------------------------------
def penalised(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams) -> np.ndarray:
    """vLLM's penalties, independently: repetition over prompt + output (positive logits divided,
    negative multiplied), presence and frequency over the output."""
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=len(logits)).astype(np.float64)
    seen = (counts > 0) | (np.bincount(np.asarray(prompt, dtype=np.int64), minlength=len(logits)) > 0)
    rep = np.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
    return np.where(seen, rep, logits) - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def processed(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams,
              allowed: np.ndarray | None = None) -> np.ndarray:
    """The distribution a row samples from after `output`: penalties -> grammar mask -> temperature ->
    top-k -> top-p -> min-p; greedy rows one-hot on the argmax."""
    z = penalised(logits.astype(np.float64), prompt, output, p)
    if allowed is not None:
        z = np.where(allowed, z, -np.inf)
    if p.temperature == 0:
        return np.eye(len(z))[int(np.argmax(z))]
    return reference_probs(z, p)


def exact_law(step: Callable[[tuple], np.ndarray], length: int, eos: set[int]) -> dict[tuple, float]:
    """Every output of at most `length` tokens (shorter ones end in EOS) with its probability, where
    step(prefix) is the distribution after the generated tokens `prefix`."""
    law: dict[tuple, float] = {}

    def visit(prefix: tuple, prob: float) -> None:
        probs = step(prefix)
        for tok in np.flatnonzero(probs > 0):
            seq = prefix + (int(tok),)
            if tok in eos or len(seq) == length:
                law[seq] = law.get(seq, 0.0) + prob * probs[tok]
            else:
                visit(seq, prob * probs[tok])
    visit((), 1.0)
    assert abs(sum(law.values()) - 1) < 1e-9
    return law


def target_law(model, prompt: list[int], params: SamplingParams, length: int, eos: set[int] = frozenset(),
               grammars=None) -> dict[tuple, float]:
    """The exact law (exact_law) of the target's outputs after `prompt`: each step's distribution is
    `processed` from an uncached Hugging Face forward, under params.response_format's mask (by
    `grammars`) where it has one."""
    @torch.no_grad()
    def step(prefix: tuple) -> np.ndarray:
        logits = model(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1].double().numpy()
        mask = grammar_mask(grammars, params, prefix) if params.response_format else None
        return processed(logits, prompt, list(prefix), params, mask)
    return exact_law(step, length, eos)


def prefix_bins(law: dict[tuple, float], n: int, min_expected: float = 5.0,
                prefixes: dict[tuple, float] | None = None) -> dict[tuple, float]:
    """Chi-square bins for n samples, from the exact law alone: an output expected >= min_expected
    times is its own bin; the others pool under their longest prefix whose remainder (what no finer
    bin holds) is expected that often, so a shift between first tokens stays visible; the rest is ().
    prefixes: every prefix's probability where the law lists only the likelier outputs (by default
    summed from the law)."""
    if prefixes is None:
        prefixes = {}
        for out, prob in law.items():
            for k in range(1, len(out)):
                prefixes[out[:k]] = prefixes.get(out[:k], 0.0) + prob
    bins = {out: prob for out, prob in law.items() if prob * n >= min_expected}
    for k in range(max(map(len, prefixes), default=0), 0, -1):
        for prefix in [p for p in prefixes if len(p) == k]:
            inside = sum(prob for b, prob in bins.items() if len(b) > k and b[:k] == prefix)
            if (prefixes[prefix] - inside) * n >= min_expected:
                bins[prefix] = prefixes[prefix] - inside
    bins[()] = max(0.0, 1.0 - sum(bins.values()))
    return bins


def bins_pvalue(counts: dict[tuple, int], bins: dict[tuple, float], rest: tuple = ()) -> float:
    """Chi-square p-value of observed outputs against the bins' probabilities: an output counts in
    its own bin, else its longest binned prefix's, else `rest`'s."""
    n = sum(counts.values())
    observed = dict.fromkeys(bins, 0)
    for out, c in counts.items():
        observed[next((out[:k] for k in range(len(out), 0, -1) if out[:k] in bins), rest)] += c
    return _chisquare([observed[b] for b in bins], [bins[b] * n for b in bins], n)


def binned_pvalue(counts: dict[tuple, int], law: dict[tuple, float], min_expected: float = 5.0) -> float:
    """Chi-square p-value of observed outputs against their exact law over prefix_bins; 0 where an
    output the law gives probability 0 was observed. A remainder bin expected < min_expected times
    joins the smallest other bin."""
    n = sum(counts.values())
    if any(law.get(out, 0.0) == 0.0 for out in counts):
        return 0.0
    bins, rest = prefix_bins(law, n, min_expected), ()
    if bins[()] * n < min_expected:                 # too small to stand alone
        rest = min((b for b in bins if b), key=bins.get)
        bins[rest] += bins.pop(())
    return bins_pvalue(counts, bins, rest)


# ---- a vocabulary small enough to enumerate, with grammars ----------------------------------------
TINY_TOKENS = [b"<eos>", b"a", b"b", b"c", b"ab", b"ba", b"{", b"}"]
TINY_EOS = 0


class TinyTokenizer:
    """Longest-match tokenizer over TINY_TOKENS (what llguidance needs of a tokenizer)."""
    eos_token_id, bos_token_id, tokens, special_token_ids = TINY_EOS, None, TINY_TOKENS, [TINY_EOS]

    def __call__(self, text):
        text = text.encode() if isinstance(text, str) else text
        out, i = [], 0
        while i < len(text):
            best = max((t for t in range(1, len(TINY_TOKENS)) if text.startswith(TINY_TOKENS[t], i)),
                       key=lambda t: len(TINY_TOKENS[t]))
            out.append(best)
            i += len(TINY_TOKENS[best])
        return out


def tiny_grammars():
    """response_format support over TINY_TOKENS."""
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    from pipeline.engine.grammar.library import Grammars
    vocab = len(TINY_TOKENS)
    return Grammars(llguidance.LLTokenizer(TokenizerWrapper(TinyTokenizer()), n_vocab=vocab), vocab)


def grammar_mask(grammars, params: SamplingParams, prefix) -> np.ndarray:
    """The tokens params.response_format allows after `prefix`, by llguidance's matcher driven directly."""
    import llguidance
    matcher = llguidance.LLMatcher(grammars.tokenizer, grammars.compile(params.constraint), log_level=0)
    assert matcher.consume_tokens(list(prefix))
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return bits[:grammars.vocab_size].astype(bool)


# ---- covering arrays ---------------------------------------------------------------------------------
def interactions(cell: dict, triples: tuple = ()) -> set:
    """A cell's (factor, value) pairs, and its triples among the factors `triples`."""
    items = sorted(cell.items())
    out = set(itertools.combinations(items, 2))
    return out | set(itertools.combinations([i for i in items if i[0] in triples], 3))


def covering_array(cells: list[dict], triples: tuple = ()) -> list[dict]:
    """A subset of `cells` (dicts of factor -> value) holding every interaction (`interactions`) that
    some cell holds: every pair of factor values that occur together, and every triple among the
    factors `triples`. Greedy (the cell holding the most uncovered ones first, ties: the earliest),
    deterministic."""
    held = [interactions(c, triples) for c in cells]
    uncovered = set().union(*held)
    chosen = []
    while uncovered:
        best = max(range(len(cells)), key=lambda i: len(held[i] & uncovered))
        chosen.append(cells[best])
        uncovered -= held[best]
    return chosen
