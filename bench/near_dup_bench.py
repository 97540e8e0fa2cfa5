"""Near-duplicate detection on a planted set from real text, and its time per 10k rows:

    .venv/bin/python -m bench.near_dup_bench --out bench/out/near_dup.json

Planted set: the shipped seed texts (data/synthetic/seeds.parquet) of at least --min-words words as
originals, and for each a paraphrase with --changed of its words replaced by words drawn from the other
texts (a few words changed, as a re-sampled row differs). Every original and paraphrase goes through
the job's own index in order (pipeline/synthetic/near_dup.py at --threshold): recall = paraphrases
found as their own original's near-duplicate, overall and split by the pair's true Jaccard similarity
(3-word shingles) at or above the threshold and below it; precision = flagged rows that are a planted
pair (a flag on an unplanted pair may still be a near-duplicate the seed set holds).

Time per 10k rows: --rows texts (the originals and paraphrases repeated with one word changed each, so
nothing is an exact copy) through signatures + LSH checks, median of --repeats. The same with rensa
(Rust MinHash, `pip install rensa`) where installed, for the choice between them.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import pyarrow.parquet as pq

from pipeline.synthetic.config import NearDuplicateConfig
from pipeline.synthetic.near_dup import NearDuplicates, shingles


def planted(texts: list[str], changed: int, rng: random.Random) -> list[str]:
    words = [w for t in texts for w in t.split()]
    out = []
    for t in texts:
        ws = t.split()
        for i in rng.sample(range(len(ws)), min(changed, len(ws))):
            ws[i] = rng.choice(words)
        out.append(" ".join(ws))
    return out


def jaccard(a: str, b: str, k: int) -> float:
    x, y = set(shingles(a, k)), set(shingles(b, k))
    return len(x & y) / len(x | y) if x | y else 1.0


def ours(rows: list[str], cfg: NearDuplicateConfig) -> dict:
    near = NearDuplicates(cfg)
    sigs = near.signatures(rows)
    found = near.check([{"id": str(i), "signature": s} for i, s in enumerate(sigs)])
    return {int(k): int(v[1]) for k, v in found.items() if v is not None}


def rensa_found(rows: list[str], cfg: NearDuplicateConfig) -> dict | None:
    try:
        import rensa
    except ImportError:
        return None
    lsh = rensa.RMinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm, num_bands=16)
    hashes, found = [], {}
    for i, text in enumerate(rows):
        m = rensa.RMinHash(num_perm=cfg.num_perm, seed=1)
        m.update([s.decode() for s in shingles(text, cfg.shingle_words)] or [""])
        hits = [j for j in lsh.query(m) if hashes[j].jaccard(m) >= cfg.threshold]
        if hits:
            found[i] = min(hits)
        lsh.insert(i, m)
        hashes.append(m)
    return found


def score(found: dict, sims: list[float], threshold: float) -> dict:
    """Rows 0..n-1 originals, n..2n-1 their paraphrases in order; sims: each pair's true Jaccard. Recall
    overall and over the pairs at or above the threshold (what the detector is for) and below it."""
    n = len(sims)
    hit = [found.get(n + i) == i for i in range(n)]
    above = [h for h, j in zip(hit, sims) if j >= threshold]
    below = [h for h, j in zip(hit, sims) if j < threshold]
    flagged = len(found)
    return {"recall": round(sum(hit) / n, 4), "recall_at_or_above": round(sum(above) / len(above), 4) if above else None,
            "pairs_at_or_above": len(above), "recall_below": round(sum(below) / len(below), 4) if below else None,
            "precision": round(sum(hit) / flagged, 4) if flagged else None, "flagged": flagged, "pairs": n}


def per_10k(fn, rows: list[str], repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(rows)
        times.append((time.perf_counter() - t0) * 10_000 / len(rows))
    return {"median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3), "max_s": round(max(times), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="data/synthetic/seeds.parquet")
    ap.add_argument("--min-words", type=int, default=30)
    ap.add_argument("--changed", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--threshold", type=float, default=0.7)
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = NearDuplicateConfig(threshold=args.threshold)
    texts = [t for t in pq.read_table(args.seeds).column("text").to_pylist() if len(t.split()) >= args.min_words]
    result = {"originals": len(texts), "threshold": args.threshold, "planted": []}
    for changed in args.changed:
        copies = planted(texts, changed, random.Random(changed))
        rows = texts + copies
        sims = [jaccard(a, b, cfg.shingle_words) for a, b in zip(texts, copies)]
        entry = {"changed_words": changed, "jaccard_median": round(statistics.median(sims), 3),
                 "jaccard_min": round(min(sims), 3), "ours": score(ours(rows, cfg), sims, args.threshold)}
        r = rensa_found(rows, cfg)
        entry["rensa"] = score(r, sims, args.threshold) if r is not None else "not installed"
        result["planted"].append(entry)
        print(json.dumps(entry), flush=True)
    rng = random.Random(0)
    base = texts + planted(texts, 2, random.Random(2))
    big = [planted([base[i % len(base)]], 1, rng)[0] + f" r{i}" for i in range(args.rows)]
    result["per_10k_rows"] = {"ours (datasketch)": per_10k(lambda rows: ours(rows, cfg), big, args.repeats)}
    if rensa_found(["a b c"], cfg) is not None:
        result["per_10k_rows"]["rensa"] = per_10k(lambda rows: rensa_found(rows, cfg), big, args.repeats)
    print(json.dumps(result["per_10k_rows"]))
    json.dump(result, open(args.out, "w"), indent=2)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
