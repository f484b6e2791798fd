"""Vectorised MinHash and LSH band keys for near-duplicate detection: shingles of 5 words, hashed with arrow/numpy, signatures by rensa.

A document's shingles are its lower-cased, whitespace-split words taken 5 at a time (one shingle of all its
words when it has fewer than 5); that is the project's definition of a document's shingle set, and
`jaccard` measures similarity with it. Each word is hashed once per batch (blake2b of its distinct
spellings), shingles are combined from word hashes with uint64 arithmetic, and the `num_perm` permutations
are computed by rensa (Rust) from those hashes: no per-shingle Python work, unlike datasketch's default (a
SHA-1 per shingle and per-document set-up), which was about 45 % of the single-process prepare's time.
Measured on 3000 synthetic documents (docs/BENCHMARKS.md): datasketch 1.1 MB/s, numpy multiply-shift 3.6 MB/s,
rensa on these shingle hashes 140-230 MB/s (shingling itself 20-36 MB/s).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

SHINGLE = 5
NUM_PERM = 128  # 12 bands of 10 rows at threshold 0.9: see lsh_params and docs/DATA.md
M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads every input bit over the whole word."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_MULT = mix(np.arange(1, SHINGLE + 1, dtype=np.uint64)) | np.uint64(1)  # per-position odd multipliers


def _words(texts) -> tuple[np.ndarray, np.ndarray]:
    """(hash of every word, in order; words per document): lower-cased, split on Unicode whitespace (Arrow)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    elif not isinstance(texts, pa.Array):
        texts = pa.array(list(texts), pa.large_string())
    trimmed = pc.utf8_trim_whitespace(pc.utf8_lower(texts))
    # an empty (or all-space) text has no words, not one empty word
    split = pc.utf8_split_whitespace(pc.if_else(pc.equal(trimmed, ""), pa.scalar(None, trimmed.type), trimmed))
    n_words = pc.list_value_length(split).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(split)
    if not len(flat):
        return np.zeros(0, np.uint64), n_words
    enc = pc.dictionary_encode(flat)
    # Each distinct spelling is hashed once: a Zipf corpus repeats a few words most of the time.
    uniq = np.fromiter((int.from_bytes(hashlib.blake2b(w, digest_size=8).digest(), "little")
                        for w in enc.dictionary.cast(pa.large_binary()).to_pylist()), np.uint64, len(enc.dictionary))
    return uniq[enc.indices.to_numpy(zero_copy_only=False)], n_words


def shingle_hashes(texts) -> tuple[np.ndarray, np.ndarray]:
    """(hashes of every document's shingles, one after the other; offsets: doc i owns [off[i], off[i+1])).
    `texts`: a list of str or a pyarrow string array."""
    w, n_words = _words(texts)
    starts = np.concatenate([[0], np.cumsum(n_words)])
    n_sh = np.where(n_words > 0, np.maximum(1, n_words - (SHINGLE - 1)), 0)
    padded = np.concatenate([w, np.zeros(SHINGLE - 1, np.uint64)])
    sh = np.zeros(len(w), np.uint64)
    for k in range(SHINGLE):
        sh += padded[k:k + len(w)] * _MULT[k]
    for i in np.flatnonzero((n_words > 0) & (n_words < SHINGLE)):
        # a document of fewer than 5 words is one shingle of all its words, not running into the next one
        s = starts[i]
        sh[s] = (w[s:s + n_words[i]] * _MULT[:n_words[i]]).sum(dtype=np.uint64)
    doc = np.repeat(np.arange(len(n_words)), n_words)
    keep = (np.arange(len(w)) - starts[:-1][doc]) < n_sh[doc]
    off = np.concatenate([[0], np.cumsum(n_sh)])
    return mix(sh[keep]), off


def shingle_set(text: str) -> set[int]:
    sh, _ = shingle_hashes([text])
    return set(sh.tolist())


def jaccard(a: str, b: str) -> float:
    x, y = shingle_set(a), shingle_set(b)
    return len(x & y) / max(1, len(x | y))


def signatures(texts, num_perm: int = NUM_PERM, seed: int = 0) -> np.ndarray:
    """MinHash signatures, uint32 [len(texts), num_perm] (rensa, from our shingle hashes); texts must be non-empty."""
    import rensa

    sh, off = shingle_hashes(texts)
    if not len(off) - 1:
        return np.zeros((0, num_perm), np.uint32)
    m = rensa.RMinHash.digest_matrix_from_flat_token_hashes(sh, off.astype(np.uint64), num_perm, seed)
    return np.asarray(m.to_rows(), dtype=np.uint32).reshape(len(off) - 1, num_perm)


def lsh_params(threshold: float, num_perm: int, recall: float = 0.99) -> tuple[int, int]:
    """(bands, rows per band): the most selective split of num_perm whose chance of making a pair at
    exactly `threshold` a candidate is >= recall, so near duplicates just above the threshold are found."""
    best = (num_perm, 1)
    for r in range(1, num_perm + 1):
        b = num_perm // r
        if b and 1 - (1 - threshold ** r) ** b >= recall:
            best = (b, r)
    return best


def candidate_probability(j: float, bands: int, rows: int) -> float:
    return 1 - (1 - j ** rows) ** bands


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """uint64 [n, bands]: one key per band; two documents share a bucket when a band's keys are equal."""
    n = sig.shape[0]
    keys = np.zeros((n, bands), np.uint64)
    mult = mix(np.arange(7, 7 + rows, dtype=np.uint64)) | np.uint64(1)
    salt = np.arange(bands, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # array maths wraps silently
    for j in range(bands):
        band = sig[:, j * rows:(j + 1) * rows].astype(np.uint64)
        keys[:, j] = mix((band * mult[None, :]).sum(axis=1, dtype=np.uint64) + salt[j])
    return keys


def threshold_midpoint(bands: int, rows: int) -> float:
    """Where the LSH S-curve crosses 1/2: pairs far below it are rarely candidates."""
    return (1 - 0.5 ** (1 / bands)) ** (1 / rows) if bands else math.nan
