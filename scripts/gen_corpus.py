"""Synthetic corpus for `raytrain prepare` tests and benchmarks: Zipf-distributed words, exact and near duplicates
planted at known rates and recorded.

    python scripts/gen_corpus.py OUT_DIR --mb 64 [--exact 0.02] [--near 0.02] [--threshold 0.9] [--seed 0]

Writes OUT_DIR/corpus/part-00000.jsonl ... ({"id": n, "text": ...} per line, files of about --file-mb MB) and
OUT_DIR/planted.jsonl: one line per planted duplicate, {"id", "kind": "exact" | "near", "of": source id,
"jaccard"} where jaccard is measured with the project's own shingling (raytrain.data.minhash.jaccard) and lies in
[threshold, 0.97] for near duplicates. Every other document is unique (independent Zipf draws).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from raytrain.data.minhash import jaccard  # noqa: E402

SYLLABLES = "ka lo mi nu pe ra si to vu ze ba de fi go hu ja ke li mo ne".split()


def vocabulary(n: int, rng: np.random.Generator) -> np.ndarray:
    words = set()
    while len(words) < n:
        k = int(rng.integers(1, 5))
        words.add("".join(SYLLABLES[i] for i in rng.integers(0, len(SYLLABLES), k)))
    return rng.permutation(np.array(sorted(words)))  # Zipf rank unrelated to spelling


def near_copy(text: str, vocab: np.ndarray, threshold: float, rng: np.random.Generator) -> tuple[str, float] | None:
    """Substitute random words until the Jaccard similarity drops just below 0.97, and keep the copy if it is
    still >= threshold."""
    words = text.split()
    for _ in range(20):
        w = list(words)
        while True:
            w[int(rng.integers(len(w)))] = str(vocab[int(rng.integers(len(vocab)))])
            j = jaccard(text, " ".join(w))
            if j < 0.97:
                break
        if threshold <= j:
            return " ".join(w), j
    return None


def generate(out: Path, mb: float, exact: float, near: float, threshold: float, seed: int,
             file_mb: float = 16.0, vocab_size: int = 50_000, zipf_a: float = 1.1,
             min_words: int = 80, max_words: int = 400) -> dict:
    rng = np.random.default_rng(seed)
    vocab = vocabulary(vocab_size, rng)
    p = 1.0 / np.arange(1, vocab_size + 1) ** zipf_a
    cdf = np.cumsum(p / p.sum())
    (out / "corpus").mkdir(parents=True, exist_ok=True)
    target, written, n, part = mb * 2**20, 0, 0, 0
    pool: list[str] = []  # recent unique documents, sources for duplicates
    f = None
    planted = open(out / "planted.jsonl", "w")
    counts = {"unique": 0, "exact": 0, "near": 0}
    while written < target:
        if f is None or f.tell() > file_mb * 2**20:
            if f:
                f.close()
            f = open(out / "corpus" / f"part-{part:05d}.jsonl", "w")
            part += 1
        u = rng.random()
        text, rec = None, None
        if pool and u < exact:
            src = int(rng.integers(len(pool)))
            text, rec = pool[src][1], {"kind": "exact", "of": pool[src][0], "jaccard": 1.0}
        elif pool and u < exact + near:
            src = int(rng.integers(len(pool)))
            got = near_copy(pool[src][1], vocab, threshold, rng)
            if got:
                text, rec = got[0], {"kind": "near", "of": pool[src][0], "jaccard": round(got[1], 4)}
        if text is None:
            k = int(rng.integers(min_words, max_words))
            text = " ".join(vocab[np.searchsorted(cdf, rng.random(k))])
            pool.append((n, text))
            if len(pool) > 1000:
                pool.pop(int(rng.integers(len(pool))))
            counts["unique"] += 1
        else:
            planted.write(json.dumps({"id": n, **rec}) + "\n")
            counts[rec["kind"]] += 1
        line = json.dumps({"id": n, "text": text}) + "\n"
        f.write(line)
        written += len(line)
        n += 1
    f.close()
    planted.close()
    return {"documents": n, "bytes": written, "files": part, **counts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--mb", type=float, default=16)
    ap.add_argument("--exact", type=float, default=0.02, help="share of documents that are exact copies")
    ap.add_argument("--near", type=float, default=0.02, help="share of documents that are near copies")
    ap.add_argument("--threshold", type=float, default=0.9, help="near copies have Jaccard in [threshold, 0.97]")
    ap.add_argument("--file-mb", type=float, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(json.dumps(generate(Path(a.out), a.mb, a.exact, a.near, a.threshold, a.seed, a.file_mb)))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
