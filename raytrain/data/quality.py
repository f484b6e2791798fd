"""Document quality steps for `raytrain prepare`: normalise, drop empty / short / long, exact and near
de-duplication, optional PII scrubbing. Every step counts what it did, for the data report."""

from __future__ import annotations

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


def clean_documents(docs: Iterable[str], min_chars: int, max_chars: int, near_dup_threshold: float,
                    pii: bool, seed: int) -> tuple[list[str], Counter]:
    """Every quality step of the prepare pipeline (data/stages.py), in this process: the kept documents in input
    order (the first copy of exact duplicates; near duplicates as the pipeline decides) and per-step counts."""
    import numpy as np
    import pyarrow as pa

    from raytrain.data import minhash, neardup, stages

    docs = list(docs)
    near = near_dup_threshold < 1.0
    bands, rows = minhash.lsh_params(near_dup_threshold, minhash.NUM_PERM) if near else (0, 0)
    s = stages.normalise_batch(pa.table({"text": pa.array(docs, pa.large_string()), "utf8": ["ok"] * len(docs)}),
                               min_chars=min_chars, max_doc_chars=max_chars, near=near, bands=bands, rows=rows,
                               seed=seed, n_parts=1, val_fraction=0.0)
    counts: Counter = Counter({"input": len(docs)})
    drops: set = set()
    if near:
        requests = stages.bucket_pairs(stages.explode_bands(s, n_groups=1), n_parts=1)
        pairs = stages.attach_partners(pa.concat_tables([stages.lookup_docs(s), requests]), n_parts=1)
        docs = stages.lookup_docs(s)
        k = docs.column("k").to_numpy()
        removed, _ = neardup.verify(k, docs.column("text").to_pylist(), pairs, threshold=near_dup_threshold,
                                    draw=np.zeros(len(k)))
        drops = set(k[removed].tolist())
    seen: set = set()
    kept = []
    for text, why, h, k in zip(*(s.column(c).to_pylist() for c in ("text", "reason", "h", "k"))):
        if why:
            counts[why] += 1
        elif h in seen:
            counts["dropped_exact_duplicate"] += 1
        elif k in drops:
            counts["dropped_near_duplicate"] += 1
            seen.add(h)
        else:
            seen.add(h)
            kept.append(scrub_pii(text, counts) if pii else text)
    counts["kept"] = len(kept)
    return kept, counts
