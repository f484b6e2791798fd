"""Provenance of prepared data: where every packed token came from (input digests, per-partition document tables,
per-shard span tables), written by `raytrain prepare` and read back by `raytrain data trace` and the run report.

Layout under a split (listed in its manifest.json under "provenance"):
    provenance/docs-PPPPP.parquet   partition P's documents in packing order: h (the first 8 bytes of the content
                                    hash de-duplication uses), source (input URI or the built-in corpus), record
                                    (byte offset of its line, Parquet row, 0 for a whole file, index in the built-in
                                    corpus), tokens (with its end-of-text token), head (first characters)
    provenance/spans-SSSSS.parquet  shard S's spans, sorted by row: sample_id, pos (first token in the row), len,
                                    part, doc (row of docs-<part>), doc_start (its first token in the document)
A span covers a document's tokens and the end-of-text token after it, so a row's spans cover the row exactly.
The document that survives among exact duplicates is the smallest (content hash, source, record): the same inputs
give the same provenance on any cluster. Nothing here is read while training.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
from collections import Counter
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain import storage
from raytrain.errors import UserError

VERSION = 1
DIR = "provenance"
HEAD_CHARS = 32  # the first characters of each document, kept so a trace reads without the inputs
HASH_BYTES = 8  # of the content hash: enough to find a document again (contamination), half the bytes
# Span columns are sorted or nearly so: delta-encoded, they cost about a byte a span (measured: 0.45 of plain zstd).
SPAN_ENCODING = {c: "DELTA_BINARY_PACKED" for c in ("sample_id", "pos", "len", "doc", "doc_start")}
BUILTIN_SOURCE = "python-docs"


def docs_name(part: int) -> str:
    return f"{DIR}/docs-{part:05d}.parquet"


def spans_name(shard: int) -> str:
    return f"{DIR}/spans-{shard:05d}.parquet"


# --- digests of the inputs --------------------------------------------------------------------------------------

def file_digest(uri: str) -> dict:
    """{uri, bytes, sha256} of one input file, streamed (local or s3://)."""
    h, n = hashlib.sha256(), 0
    fs, path = storage.resolve(uri)
    try:
        with fs.open_input_stream(path) as f:
            while True:
                chunk = f.read(8 << 20)
                if not chunk:
                    break
                h.update(chunk)
                n += len(chunk)
    except OSError as e:  # (FileNotFoundError included) an input gone between listing and hashing
        raise UserError(f"input {uri}: cannot read it ({str(e).strip().splitlines()[0]})") from None
    return {"uri": uri, "bytes": n, "sha256": h.hexdigest()}


def builtin_digest(max_chars: int) -> dict:
    """The built-in corpus's identity: the sha256 of its documents (they come from this Python's standard library,
    so another Python version may give another corpus) and that version."""
    from raytrain.data.corpus import python_docs

    h, n = hashlib.sha256(), 0
    for doc in python_docs(max_chars):
        b = doc.encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
        n += len(doc)
    return {"uri": BUILTIN_SOURCE, "bytes": n, "sha256": h.hexdigest(), "python": sys.version.split()[0]}


def input_digests(files: list[str], builtin_max_chars: Optional[int], ray_engine: bool) -> list[dict]:
    """Every input's digest, in the inputs' order: Ray tasks on a cluster (one read per file, beside the
    pipeline's), this process otherwise."""
    out = [builtin_digest(builtin_max_chars)] if builtin_max_chars is not None else []
    if ray_engine and len(files) > 1:
        import ray

        # A whole CPU each: the pipeline's idle workers take them (a fractional CPU made Ray start new worker
        # processes, whose start-up cost 20 % of a 64 MB prepare's CPU time; measured).
        task = ray.remote(num_cpus=1)(file_digest)
        out += ray.get([task.remote(u) for u in files])
    else:
        out += [file_digest(u) for u in files]
    return out


# --- writing (prepare's tasks) ------------------------------------------------------------------------------------

def spans_of(lens: np.ndarray, n_rows: int, window: int) -> np.ndarray:
    """Documents of token lengths `lens`, each followed by an end-of-text token, laid end to end and cut into
    n_rows rows of `window` tokens -> [spans, 5] int64: row, pos, len, doc, doc_start (row-major order)."""
    lens = np.asarray(lens, np.int64) + 1  # with its end-of-text token
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]) if len(lens) else np.zeros(0, np.int64)
    ends = starts + lens
    total = n_rows * window
    keep = starts < total
    docs = np.flatnonzero(keep)
    first, last = starts[docs] // window, (np.minimum(ends[docs], total) - 1) // window
    count = last - first + 1
    doc = np.repeat(docs, count)
    row = np.repeat(first, count) + np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    lo = np.maximum(starts[doc], row * window)
    hi = np.minimum(ends[doc], (row + 1) * window)
    return np.stack([row, lo - row * window, hi - lo, doc, lo - starts[doc]], axis=1)


def _parquet(table: pa.Table, **kw) -> bytes:
    buf = io.BytesIO()
    # Written once, read rarely: a higher zstd level costs little beside prepare's tokenizing and saves a third.
    pq.write_table(table, buf, compression="zstd", compression_level=9, **kw)
    return buf.getvalue()


def _write(uri: str, data: bytes, name: str) -> dict:
    storage.write_bytes(uri, data)
    return {"path": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_docs(split_uri: str, part: int, *, h: list, src: list, rec: np.ndarray, tokens: np.ndarray,
               texts: list[str]) -> Optional[dict]:
    """Partition `part`'s document table for one split (its documents in packing order); its manifest entry."""
    if not len(h):
        return None
    table = pa.table({"h": pa.array([x[:HASH_BYTES] for x in h], pa.binary(HASH_BYTES)),
                      "source": pa.array(src, pa.string()).dictionary_encode(),
                      "record": pa.array(np.asarray(rec, np.int64)), "tokens": pa.array(np.asarray(tokens, np.int32)),
                      "head": pa.array([t[:HEAD_CHARS] for t in texts], pa.string())})
    name = docs_name(part)
    return {"part": part, **_write(storage.join(split_uri, name), _parquet(table, use_dictionary=["source"]), name)}


def write_spans(split_uri: str, shard: int, *, sample_ids: np.ndarray, part: np.ndarray, spans: pa.Array) -> dict:
    """Shard `shard`'s span table: row i of `spans` (a list array) is row i's flat [pos, len, doc, doc_start] * k
    (its partition: part[i]); its manifest entry."""
    spans = spans.combine_chunks() if isinstance(spans, pa.ChunkedArray) else spans
    counts = spans.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64) // 4
    flat = spans.flatten().to_numpy(zero_copy_only=False).reshape(-1, 4)
    table = pa.table({"sample_id": pa.array(np.repeat(np.asarray(sample_ids, np.int64), counts)),
                      "pos": pa.array(flat[:, 0].astype(np.int32)), "len": pa.array(flat[:, 1].astype(np.int32)),
                      "part": pa.array(np.repeat(np.asarray(part), counts).astype(np.int32)),
                      "doc": pa.array(flat[:, 2].astype(np.int32)), "doc_start": pa.array(flat[:, 3].astype(np.int32))})
    name = spans_name(shard)
    data = _parquet(table, use_dictionary=["part"], column_encoding=SPAN_ENCODING)
    return {"shard": shard, **_write(storage.join(split_uri, name), data, name)}


# --- reading (trace, report) -------------------------------------------------------------------------------------

class Provenance:
    """A prepared split's provenance, read on demand: the documents behind any of its rows."""

    def __init__(self, split_uri: str, what: str = "data"):
        self.uri = storage.absolute(split_uri)
        try:
            m = json.loads(storage.read_text(storage.join(self.uri, "manifest.json")))
        except ValueError:
            raise UserError(f"{what}: {self.uri}/manifest.json is not valid JSON; prepare the data again") from None
        except UserError as e:  # missing, or the storage itself failed: say which
            if "not found" in str(e):
                raise UserError(f"{what}: {self.uri} is not a prepared split (no manifest.json)") from None
            raise UserError(f"{what}: {e}") from None
        p = m.get("provenance") or {}
        if not p.get("spans"):
            why = p.get("spans_missing") or "it was prepared without provenance (provenance=false, or before it existed)"
            raise UserError(f"{what}: {self.uri} has no span tables: {why}; prepare it again with provenance=true")
        self.inputs = p.get("inputs", [])
        self.prepare = m.get("prepare", {})
        self.shard_rows = np.array([s["rows"] for s in next(iter(_shard_lists(m)))], np.int64)
        self.shard_first = np.concatenate([[0], np.cumsum(self.shard_rows)[:-1]])
        self._spans = {int(e["shard"]): e["path"] for e in p["spans"]}
        self._docs = {int(e["part"]): e["path"] for e in p.get("documents", [])}
        self._cache: dict[str, pa.Table] = {}

    def _table(self, path: str) -> pa.Table:
        if path not in self._cache:
            self._cache[path] = self.table(path)
        return self._cache[path]

    def table(self, path: str, columns: Optional[list[str]] = None) -> pa.Table:
        """One provenance table of the split, read whole (not cached)."""
        return pq.read_table(io.BytesIO(storage.read_bytes(storage.join(self.uri, path))), columns=columns)

    def document_tables(self) -> list[str]:
        return [self._docs[p] for p in sorted(self._docs)]

    def spans(self, sample_id: int) -> list[dict]:
        """Row `sample_id`'s documents in row order: {pos, len, doc_start, part, doc, h, source, record, tokens,
        head}."""
        shard = int(np.searchsorted(self.shard_first, sample_id, side="right") - 1)
        t = self._table(self._spans[shard])
        ids = t.column("sample_id").to_numpy()
        lo, hi = np.searchsorted(ids, sample_id, side="left"), np.searchsorted(ids, sample_id, side="right")
        out = []
        for r in t.slice(lo, hi - lo).to_pylist():
            d = self._table(self._docs[r["part"]]).slice(r["doc"], 1).to_pylist()[0]
            out.append({"pos": r["pos"], "len": r["len"], "doc_start": r["doc_start"], "part": r["part"],
                        "doc": r["doc"], "h": d["h"].hex(), "source": d["source"], "record": d["record"],
                        "tokens": d["tokens"], "head": d["head"]})
        return out


def _shard_lists(m: dict):
    shards = m["shards"]
    return [shards] if isinstance(shards, list) else list(shards.values())


def document_text(source: str, record: int, prepare: dict) -> str:
    """A document's text as prepare tokenized it: read from its input again and normalised (PII scrubbed when
    prepare did); for checks of a trace against the raw inputs."""
    from raytrain.data.inputs import kind, read_file
    from raytrain.data.quality import normalise, scrub_pii

    if source == BUILTIN_SOURCE:
        from raytrain.data.corpus import python_docs

        for i, doc in enumerate(python_docs(prepare.get("max_chars", 3_000_000))):
            if i == record:
                raw = doc
                break
        else:
            raise UserError(f"the built-in corpus of this Python has no document {record}")
    else:
        k = kind(source)
        if k == "parquet":
            rows = read_file(source, text_field=prepare.get("text_field", "text"))
            raw = next(t for t, _, r in rows if r == record)
        elif k == "text" and prepare.get("text_mode", "file") == "file":
            raw = read_file(source, invalid_utf8=prepare.get("invalid_utf8", "replace"))[0][0]
        else:
            # the record's line: a range starting at its offset reads it first
            rows = read_file(source, text_field=prepare.get("text_field", "text"),
                             text_mode=prepare.get("text_mode", "file"),
                             invalid_utf8=prepare.get("invalid_utf8", "replace"), start=record, stop=record + 1)
            raw = rows[0][0]
    text = normalise(raw)
    return scrub_pii(text, Counter()) if prepare.get("pii_scrub") else text
