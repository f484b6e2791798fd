"""Near-duplicate verification: the exact Jaccard of LSH candidate pairs, what it removed, and the S-curve."""

from __future__ import annotations

import heapq

import numpy as np
import pyarrow as pa

from raytrain.data import minhash

NEAR_REVIEW = 5  # removed near duplicates, beside the document that caused the removal, in review_sample.jsonl
BINS = 100  # removed documents' Jaccard counted in bins of 0.01


def pair_jaccard(a: list[str], b: list[str]) -> np.ndarray:
    """Exact Jaccard of the project's shingle sets (minhash.jaccard) of a[i] and b[i], for every i at once."""
    if not a:
        return np.zeros(0)
    sa, oa = minhash.shingle_hashes(a)
    sb, ob = minhash.shingle_hashes(b)
    out = np.zeros(len(a))
    for i in range(len(a)):
        x, y = np.unique(sa[oa[i]:oa[i + 1]]), np.unique(sb[ob[i]:ob[i + 1]])
        inter = len(np.intersect1d(x, y, assume_unique=True))
        out[i] = inter / max(1, len(x) + len(y) - inter)
    return out


def verify(k: np.ndarray, texts: list[str], pairs: pa.Table, *, threshold: float, draw: np.ndarray,
           review_n: int = NEAR_REVIEW) -> tuple[np.ndarray, dict]:
    """One partition's documents (content keys k, texts) and its candidate pairs (k: a document here, other: the
    smaller-hash document it shares a bucket with, text: that one's text) -> which documents are near duplicates
    (a candidate at exact Jaccard >= threshold), and the partition's summary: pairs, removed documents' best
    Jaccard in bins, and a review sample drawn by `draw` (a [0, 1) number per document)."""
    pk = pairs.column("k").to_numpy()
    order = np.argsort(k, kind="stable")
    pos = order[np.searchsorted(k, pk, sorter=order)] if len(k) else np.zeros(0, np.int64)
    jac = pair_jaccard([texts[i] for i in pos], pairs.column("text").to_pylist())
    ok = jac >= threshold
    removed = np.zeros(len(k), bool)
    removed[pos[ok]] = True
    # Each removed document's best match (highest Jaccard, then smallest hash): what a person should see.
    po = pairs.column("other").to_numpy()
    best = {}
    for i in np.lexsort((po, -jac, pos)):
        if ok[i] and int(pos[i]) not in best:
            best[int(pos[i])] = i
    top = jac[np.fromiter(best.values(), np.int64, len(best))]
    hist = np.bincount(np.minimum((top * BINS).astype(np.int64), BINS - 1), minlength=BINS)
    partner = pairs.column("text")
    review = heapq.nsmallest(review_n, ((float(draw[d]), texts[d], partner[i].as_py(), float(jac[i]))
                                        for d, i in best.items()))
    return removed, {"candidate_pairs": int(len(jac)), "verified_pairs": int(ok.sum()),
                     "jaccard_bins": hist.tolist(), "review": review}


def merge(summaries: list[dict], review_n: int = NEAR_REVIEW) -> dict:
    """Per-partition summaries -> totals (rejected = candidates - verified), bins and the review sample."""
    out = {"candidate_pairs": 0, "verified_pairs": 0, "jaccard_bins": [0] * BINS, "review": []}
    for s in summaries:
        out["candidate_pairs"] += s["candidate_pairs"]
        out["verified_pairs"] += s["verified_pairs"]
        out["jaccard_bins"] = [x + y for x, y in zip(out["jaccard_bins"], s["jaccard_bins"])]
        out["review"] = heapq.nsmallest(review_n, out["review"] + [tuple(r) for r in s["review"]])
    out["rejected_pairs"] = out["candidate_pairs"] - out["verified_pairs"]
    return out


def s_curve(threshold: float, bands: int, rows: int) -> list[dict]:
    """For pairs at Jaccard J: the chance LSH makes them a candidate, and the chance one is removed (a candidate
    verified exactly: the same above the threshold, 0 below it)."""
    grid = sorted({0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, round(threshold, 4)})
    return [{"jaccard": j, "candidate": round(minhash.candidate_probability(j, bands, rows), 4),
             "removed": round(minhash.candidate_probability(j, bands, rows), 4) if j >= threshold else 0.0}
            for j in grid]
