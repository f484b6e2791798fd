"""Near-duplicate removal honours near_dup_threshold on real text: the license and copyright files every Debian /
Ubuntu machine has, read at test time, against a brute-force count with the project's shingles."""

import glob
import hashlib
import json
import os

import pytest

from raytrain.data import minhash
from raytrain.data.prepare import PrepareConfig, prepare
from raytrain.data.quality import normalise
from raytrain.data.stages import clean_documents

THRESHOLD = 0.9
TOLERANCE = 0.0  # candidates are verified with the exact Jaccard of their shingle sets: no estimate to allow for
SOURCES = ["/usr/share/common-licenses/*", "/usr/share/doc/*/copyright"]


def _real_texts() -> list[str]:
    paths = sorted(p for pattern in SOURCES for p in glob.glob(pattern) if os.path.isfile(p))
    texts = []
    for p in paths:
        try:
            texts.append(open(p, "rb").read().decode("utf-8", "replace"))
        except OSError:
            continue
    if len(texts) < 200:
        pytest.skip(f"only {len(texts)} files in {SOURCES}: this test needs a Debian/Ubuntu system's 200 or more")
    return texts


def _brute_force_removals(docs: list[str], threshold: float) -> set[str]:
    """Every document with a document of smaller content hash at exact Jaccard >= threshold (the one-hop rule),
    over all pairs; pairs whose set sizes alone keep them below the threshold are skipped."""
    key = {d: hashlib.sha256(d.encode()).digest()[:8] for d in docs}
    docs = sorted(docs, key=key.get)
    sets = [minhash.shingle_set(d) for d in docs]
    removed = set()
    for i, a in enumerate(sets):
        for j in range(i):
            b = sets[j]
            if min(len(a), len(b)) < threshold * max(len(a), len(b)):
                continue
            if len(a & b) / max(1, len(a | b)) >= threshold:
                removed.add(docs[i])
                break
    return removed


def _best_match(doc: str, others: list[str]) -> float:
    a = minhash.shingle_set(doc)
    return max(len(a & b) / max(1, len(a | b)) for b in map(minhash.shingle_set, others) if b != a)


def test_near_duplicates_removed_on_real_text_match_a_brute_force_count(tmp_path):
    texts = _real_texts()
    kept, counts = clean_documents(texts, 1, 0, THRESHOLD, False, 0)
    unique = sorted({normalise(t) for t in texts} - {""})
    removed = set(unique) - set(kept)
    expected = _brute_force_removals(unique, THRESHOLD)
    assert counts["dropped_near_duplicate"] == len(removed)
    assert abs(len(removed) - len(expected)) <= 0.1 * max(len(expected), 1), (len(removed), len(expected))
    worst = min((_best_match(d, unique) for d in removed), default=1.0)
    assert worst >= THRESHOLD - TOLERANCE, worst
    # The pipeline (in-process engine) removes the same, and its report and review sample say so.
    out = tmp_path / "out"
    r = prepare(PrepareConfig(inputs=SOURCES, out=str(out), vocab_size=300, seq_len=32, engine="local",
                              near_dup_threshold=THRESHOLD), log=lambda *_: None)
    assert r["filters"]["dropped_near_duplicate"] == len(removed)
    near = json.loads((out / "report.json").read_text())["near_duplicates"]
    assert near["candidate_pairs"] == near["verified_pairs"] + near["rejected_pairs"] >= len(removed)
    assert sum(near["removed_by_jaccard"].values()) == len(removed)
    assert all(float(j) >= THRESHOLD - 0.01 for j in near["removed_by_jaccard"])
    pairs = [json.loads(x) for x in (out / "review_sample.jsonl").read_text().splitlines()]
    pairs = [p for p in pairs if "removed_as_near_duplicate_of" in p]
    assert pairs and all(p["jaccard"] >= THRESHOLD and p["text"] in removed for p in pairs)
    assert all(abs(minhash.jaccard(p["text"], p["removed_as_near_duplicate_of"]) - p["jaccard"]) < 1e-4 for p in pairs)
    print(f"real corpus: {len(texts)} files, {len(unique)} unique, removed {len(removed)}, brute force "
          f"{len(expected)}, worst best match {worst:.3f}, {near}")


def test_a_candidate_below_the_threshold_is_kept_and_one_above_is_removed():
    """Pairs at Jaccard ~0.8 share a bucket 74 % of the time (12 bands of 10 rows) but are not removed at 0.9;
    pairs at ~0.95 are; the copy kept is the one of smaller content hash."""
    import random

    rng = random.Random(1)
    vocab = [f"w{i}" for i in range(5000)]
    docs, pairs = [], []
    for n, changes in enumerate([12] * 10 + [3] * 10):  # 12 of 600 words changed: J ~0.82; 3: J ~0.95
        words = [rng.choice(vocab) for _ in range(600)]
        twin = list(words)
        for i in rng.sample(range(600), changes):
            twin[i] = f"x{n}_{i}"
        a, b = " ".join(words), " ".join(twin)
        docs += [a, b]
        pairs.append((a, b, minhash.jaccard(a, b)))
    kept, counts = clean_documents(docs, 1, 0, THRESHOLD, False, 0)
    kept = set(kept)
    for a, b, j in pairs:
        first = min((a, b), key=lambda d: hashlib.sha256(d.encode()).digest())
        assert ({a, b} <= kept) if j < THRESHOLD else (kept & {a, b} == {first}), j
    assert counts["dropped_near_duplicate"] == sum(j >= THRESHOLD for *_, j in pairs) == 10
