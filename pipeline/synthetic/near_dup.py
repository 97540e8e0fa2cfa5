"""Near-duplicate rows: MinHash signatures over word shingles, found by LSH (datasketch).

    shingles     the lower-cased text's words (`\\w+`), every `shingle_words` in a row (a shorter text:
                 all its words as one shingle)
    signature    MinHash of the shingle set, `num_perm` 32-bit values (datasketch, seed 1: the same in
                 every process); the share of equal values estimates the Jaccard similarity
    near dup     a row whose signature matches an earlier row's in the LSH index (bands tuned by
                 datasketch for `threshold`, weighted 9:1 against missed pairs: with equal weights a
                 pair at Jaccard 0.81 was missed 1 time in 8) with an estimated similarity (the
                 share of equal values) >= threshold: the earliest
                 such row (earlier slots first, then this slot's rows in order) is `near_duplicate_of`
    persisted    each stage's signatures go to `near_duplicates.parquet` beside its curated rows, with
                 num_perm/shingle_words in its metadata, so a later slot loads them without rereading
                 text (files made with other settings are skipped, and said)

datasketch was chosen over rensa (Rust) by bench/near_dup_bench.py: the same recall and precision on
the planted set, and both take seconds per 10k rows, far below a slot's generation.
"""
from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
from datasketch import LeanMinHash, MinHash, MinHashLSH

from .config import NearDuplicateConfig

WORD = re.compile(r"\w+")
SEED = 1
LSH_WEIGHTS = (0.1, 0.9)                # bands chosen against missed pairs: candidates are verified anyway
SCHEME = "affine32"                  # datasketch 2's permutation scheme (stored with the signatures)


def shingles(text: str, k: int) -> list[bytes]:
    words = WORD.findall(text.lower())
    if len(words) <= k:
        return [" ".join(words).encode()] if words else []
    return [" ".join(words[i:i + k]).encode() for i in range(len(words) - k + 1)]


class NearDuplicates:
    """An LSH index of earlier rows; `check` flags a slot's rows in order and adds them."""

    def __init__(self, cfg: NearDuplicateConfig):
        self.cfg = cfg
        self.lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm, weights=LSH_WEIGHTS)
        self.order: dict[str, int] = {}            # key -> insertion order (the earliest wins)
        self.where: dict[str, tuple[str | None, str]] = {}   # key -> (slot or None for this one, row id)
        self.stored: dict[str, np.ndarray] = {}              # key -> signature
        self.last: dict[str, np.ndarray] = {}                # row id -> signature, of the last `check`

    def signatures(self, texts: list[str]) -> list[np.ndarray]:
        sets = [shingles(t, self.cfg.shingle_words) for t in texts]
        return [m.hashvalues.astype(np.uint32) for m in MinHash.bulk(sets, num_perm=self.cfg.num_perm, seed=SEED,
                                                                           scheme=SCHEME)]

    def add(self, slot: str | None, row_id: str, signature: np.ndarray) -> None:
        key = f"{slot}\x00{row_id}"
        if key in self.order:
            return
        self.lsh.insert(key, self._minhash(signature))
        self.order[key], self.where[key], self.stored[key] = len(self.order), (slot, row_id), signature

    def nearest_earlier(self, signature: np.ndarray) -> tuple[str | None, str] | None:
        m = self._minhash(signature)
        hits = [k for k in self.lsh.query(m) if self.similarity(signature, k) >= self.cfg.threshold]
        return self.where[min(hits, key=self.order.__getitem__)] if hits else None

    def similarity(self, signature: np.ndarray, key: str) -> float:
        """The estimated Jaccard similarity to an indexed row: the share of equal MinHash values."""
        return float(np.mean(signature == self.stored[key]))

    def check(self, rows: list[dict]) -> dict[str, tuple[str | None, str] | None]:
        """rows {id, signature, or None: not checked (empty, or an exact duplicate)} in order -> id ->
        the (slot, id) it nearly duplicates, or None; every checked row is then in the index."""
        out = {}
        self.last = {}
        for r in rows:
            sig = r["signature"]
            out[r["id"]] = None if sig is None else self.nearest_earlier(sig)
            if sig is not None:
                self.add(None, r["id"], sig)
                self.last[r["id"]] = sig
        return out

    def _minhash(self, signature: np.ndarray) -> LeanMinHash:
        """The signature as datasketch's LSH takes it (a lean MinHash: no permutations to make)."""
        return LeanMinHash(seed=SEED, hashvalues=signature.astype(np.uint64), scheme=SCHEME)

    def table(self) -> pa.Table:
        """The signatures `check` computed last, for near_duplicates.parquet."""
        ids = list(self.last)
        table = pa.table({"id": pa.array(ids, pa.string()),
                          "signature": pa.array([self.last[i].tobytes() for i in ids], pa.binary())})
        return table.replace_schema_metadata(self.metadata())

    def metadata(self) -> dict:
        return {"num_perm": str(self.cfg.num_perm), "shingle_words": str(self.cfg.shingle_words), "scheme": SCHEME}

    def load(self, slot: str, table: pa.Table) -> bool:
        """Add an earlier slot's signatures; False (nothing added) if made with other settings."""
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        if {k: meta.get(k) for k in self.metadata()} != self.metadata():
            return False
        for rid, blob in zip(table.column("id").to_pylist(), table.column("signature").to_pylist()):
            self.add(slot, rid, np.frombuffer(blob, dtype=np.uint32))
        return True
