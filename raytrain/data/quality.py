"""Document quality steps for `raytrain prepare`: normalise, drop empty / short / long, exact and near
de-duplication, optional PII scrubbing. Every step counts what it did, for the data report."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections import Counter
from typing import Iterable

_SPACES = re.compile(r"[ \t\f\v\u00a0]+")
_BLANK_LINES = re.compile(r"\n{3,}")
_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")
_IPV4 = re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b")
_PHONE = re.compile(r"(?<!\w)(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]\d{3,4}(?!\w)")


def normalise(text: str) -> str:
    """Unicode NFC, one space for runs of spaces/tabs, no trailing spaces, at most one blank line."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(_SPACES.sub(" ", line).rstrip() for line in text.split("\n"))
    return _BLANK_LINES.sub("\n\n", text).strip()


def scrub_pii(text: str, counts: Counter) -> str:
    for name, pattern, token in (("pii_email", _EMAIL, "<EMAIL>"), ("pii_ip", _IPV4, "<IP>"),
                                 ("pii_phone", _PHONE, "<PHONE>")):
        text, n = pattern.subn(token, text)
        counts[name] += n
    return text


def _shingles(text: str, n: int = 5) -> set[bytes]:
    words = text.lower().split()
    return {" ".join(words[i:i + n]).encode() for i in range(max(1, len(words) - n + 1))}


def clean_documents(docs: Iterable[str], min_chars: int, max_chars: int, near_dup_threshold: float,
                    pii: bool, seed: int) -> tuple[list[str], Counter]:
    """Apply every quality step in order; returns the kept documents and per-step counts."""
    counts: Counter = Counter()
    kept: list[str] = []
    seen: set[bytes] = set()
    lsh = None
    if near_dup_threshold < 1.0:
        from datasketch import MinHash, MinHashLSH

        lsh = MinHashLSH(threshold=near_dup_threshold, num_perm=64)
    for raw in docs:
        counts["input"] += 1
        text = normalise(raw)
        if not text:
            counts["dropped_empty"] += 1
            continue
        if len(text) < min_chars:
            counts["dropped_short"] += 1
            continue
        if max_chars and len(text) > max_chars:
            counts["dropped_long"] += 1
            continue
        digest = hashlib.sha256(text.encode()).digest()
        if digest in seen:
            counts["dropped_exact_duplicate"] += 1
            continue
        seen.add(digest)
        if lsh is not None:
            mh = MinHash(num_perm=64, seed=seed)
            mh.update_batch(list(_shingles(text)))
            if lsh.query(mh):
                counts["dropped_near_duplicate"] += 1
                continue
            lsh.insert(str(len(kept)), mh)
        if pii:
            text = scrub_pii(text, counts)
        kept.append(text)
    counts["kept"] = len(kept)
    return kept, counts
