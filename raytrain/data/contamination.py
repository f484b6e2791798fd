"""Contamination of training data by evaluation data: long word n-grams (13 by default, as GPT-3 and the
lm-evaluation-harness check) shared by a training document and an evaluation document.

Words are lower-cased runs of letters and digits (punctuation and spacing never hide an overlap). Every n-gram is
hashed to 64 bits (a polynomial hash over its words' hashes, order-sensitive), so the index of the evaluation
documents is a sorted array of hashes, small beside any corpus; an evaluation document shorter than n words is
matched whole. Scanning is per document and per batch: memory stays flat and time linear in the corpus, on Ray Data
where `prepare` runs there.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

from raytrain.errors import UserError

_WORD = re.compile(r"[^\W_]+")
_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: invertible modulo 2**64
_BASE_INV = np.uint64(pow(0x9E3779B97F4A7C15, -1, 2**64))
DEFAULT_N = 13


def _mix(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def words(text: str) -> np.ndarray:
    """The text's words as 64-bit hashes."""
    return _mix(np.array([zlib.crc32(w.encode()) for w in _WORD.findall(text.lower())], np.uint64))


def grams(w: np.ndarray, n: int) -> np.ndarray:
    """Hashes of every n-gram of the word hashes `w` (none when fewer than n words)."""
    m = len(w) - n + 1
    if m <= 0:
        return np.zeros(0, np.uint64)
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.concatenate([[np.uint64(1)], np.full(len(w) - 1, _BASE)])).astype(np.uint64)
        prefix = np.concatenate([[np.uint64(0)], np.cumsum(w * powers, dtype=np.uint64)])
        inv = np.cumprod(np.concatenate([[np.uint64(1)], np.full(m - 1, _BASE_INV)])).astype(np.uint64)
        return _mix((prefix[n:n + m] - prefix[:m]) * inv + np.uint64(n))


@dataclass
class NgramIndex:
    """The n-grams of the evaluation documents: {length: sorted hashes} (length n, and shorter whole documents); built
    by `of_sources`, also which evaluation example each n-gram came from (`owners`: {length: (hashes sorted, the
    example of each)}, `examples`: [(task or file, index in it)])."""

    n: int = DEFAULT_N
    by_len: dict = field(default_factory=dict)
    documents: int = 0
    owners: dict = field(default_factory=dict)
    examples: list = field(default_factory=list)

    @classmethod
    def of_sources(cls, texts: dict[str, list[str]], n: int = DEFAULT_N) -> "NgramIndex":
        """The index of {task or file: its examples' texts}, which remembers the example of every n-gram."""
        index = cls(n, examples=[(src, i) for src, v in texts.items() for i in range(len(v))])
        pairs: dict[int, tuple[list, list]] = {}
        for e, t in enumerate(t for v in texts.values() for t in v):
            w = words(t)
            if len(w):
                index.documents += 1
                g = grams(w, min(n, len(w)))
                hs, ex = pairs.setdefault(min(n, len(w)), ([], []))
                hs.append(g)
                ex.append(np.full(len(g), e, np.int64))
        for k, (hs, ex) in pairs.items():  # one pass: the sorted pairs give the unique hashes too
            h, e = np.concatenate(hs), np.concatenate(ex)
            order = np.argsort(h, kind="stable")
            index.owners[k] = (h[order], e[order])
            index.by_len[k] = np.unique(h)
        return index

    def examples_hit(self, text: str) -> list[int]:
        """The evaluation examples (indexes into `examples`) that share an n-gram with the text (or lie whole in it,
        when shorter than n words)."""
        w = words(text)
        out: set = set()
        for k, (h, e) in self.owners.items():
            g = grams(w, k)
            lo, hi = np.searchsorted(h, g, "left"), np.searchsorted(h, g, "right")
            for a, b in zip(lo[hi > lo], hi[hi > lo]):
                out.update(e[a:b].tolist())
        return sorted(out)

    @classmethod
    def of(cls, texts: Iterable[str], n: int = DEFAULT_N) -> "NgramIndex":
        parts: dict[int, list] = {}
        count = 0
        for t in texts:
            w = words(t)
            if not len(w):
                continue
            count += 1
            k = min(n, len(w))
            parts.setdefault(k, []).append(grams(w, k))
        return cls(n, {k: np.unique(np.concatenate(v)) for k, v in parts.items()}, count)

    def hits(self, text: str) -> int:
        """How many of the text's n-grams (and whole short evaluation documents) the index holds."""
        w = words(text)
        return int(sum(np.isin(grams(w, k), h, assume_unique=False).sum() for k, h in self.by_len.items()))


def task_texts(tasks: list[str], include_path: Optional[str]) -> dict[str, list[str]]:
    """{task: its evaluation documents' text} (prompt and answer) for lm-evaluation-harness tasks."""
    from raytrain.eval_tasks import check_tasks, offline, task_manager

    offline()
    check_tasks(tasks, include_path)
    out: dict[str, list[str]] = {}
    for name, task in task_manager(include_path, tasks).load(tasks)["tasks"].items():  # groups: their leaf tasks
        texts = []
        for doc in task.eval_docs:
            text, target = task.doc_to_text(doc), task.doc_to_target(doc)
            if task.OUTPUT_TYPE == "multiple_choice" and isinstance(target, int):
                target = task.doc_to_choice(doc)[target]
            texts.append(f"{text} {target}" if isinstance(target, str) else str(text))
        out[str(name)] = texts
    return out


def file_texts(files: list[str]) -> dict[str, list[str]]:
    """{file: its documents} for evaluation files read like prepare's inputs (.txt, .jsonl, .parquet)."""
    from raytrain.data.inputs import expand, read_file

    out: dict[str, list[str]] = {}
    for spec in files:
        for uri, _ in expand(spec):
            out[uri] = [t for t, _, _ in read_file(uri, text_mode="line") if t]
    return out


def build_index(*, tasks: list[str], files: list[str], include_path: Optional[str], n: int) -> tuple[NgramIndex, dict]:
    """The index over the tasks' and files' documents, and how many documents each gave."""
    if not tasks and not files:
        raise UserError("contamination: name evaluation data with --tasks and / or --file")
    texts = {**(task_texts(tasks, include_path) if tasks else {}), **(file_texts(files) if files else {})}
    index = NgramIndex.of_sources(texts, n)
    if not index.documents:
        raise UserError(f"contamination: the evaluation data ({', '.join(texts)}) has no words to look for")
    return index, {k: len(v) for k, v in texts.items()}
