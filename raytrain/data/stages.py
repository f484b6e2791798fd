"""Worker-side stages of `raytrain prepare`, as pure functions on Arrow tables (Ray Data tasks and the in-process
engine run the same code): normalise + sign, LSH candidate pairs and their texts, per-partition finalise (dedup, near-duplicate
verification, split, tokenize, pack, statistics) and shard writing.

Every decision depends on a document's content hash only - its partition, its split, whether it is the copy
kept among duplicates, its place in the output - never on batch boundaries, block counts or task order, so the
same inputs give byte-identical shards on any cluster.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections import Counter
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raytrain import storage
from raytrain.data import minhash, neardup, provenance
from raytrain.data.quality import normalise, scrub_pii
from raytrain.data.report import MAX_LENGTH_SAMPLE

_SALT = {"split": 0x51, "tokenizer": 0x7A, "lengths": 0x1E, "review": 0x4E}
_TWO64 = float(2**64)


def unit(k: np.ndarray, seed: int, what: str) -> np.ndarray:
    """A uniform [0, 1) number per document from its hash, the seed and a purpose: splits and samples."""
    x = np.asarray(k, np.uint64) ^ minhash.mix(np.array([seed * 131 + _SALT[what]], np.uint64))[0]
    return minhash.mix(x).astype(np.float64) / _TWO64


def partition_of(k: np.ndarray, n_parts: int) -> np.ndarray:
    return ((np.asarray(k, np.uint64) >> np.uint64(1)) % np.uint64(n_parts)).astype(np.int64)


def normalise_batch(batch: pa.Table, *, min_chars: int, max_doc_chars: int, near: bool, bands: int, rows: int,
                    seed: int, n_parts: int, val_fraction: float, contamination=None, progress=None) -> pa.Table:
    """Raw documents (text, utf8) -> one row each: normalised text ("" when dropped), why it was dropped (""
    when kept), 128-bit content hash h, its first 8 bytes k, partition, split and LSH band keys."""
    texts, status = batch.column("text").to_pylist(), batch.column("utf8").to_pylist()
    out_text, reason, hs = [], [], []
    for raw, st in zip(texts, status):
        why = ""
        text = "" if raw is None else normalise(raw)
        if raw is None:
            why = "dropped_invalid_utf8"
        elif not text:
            why = "dropped_empty"
        elif len(text) < min_chars:
            why = "dropped_short"
        elif max_doc_chars and len(text) > max_doc_chars:
            why = "dropped_long"
        elif contamination is not None and contamination.hits(text):  # (raytrain/data/contamination.py)
            why = "dropped_contaminated"
        if why:
            text = ""
        reason.append(why)
        out_text.append(text)
        hs.append(hashlib.sha256(text.encode()).digest()[:16])
    k = np.frombuffer(b"".join(h[:8] for h in hs), dtype=">u8").astype(np.uint64) if hs else np.zeros(0, np.uint64)
    kept = np.array([not r for r in reason], bool)
    cols = {
        "text": pa.array(out_text, pa.large_string()),
        "reason": pa.array(reason, pa.string()),
        "replaced": pa.array(np.array([s == "replaced" for s in status], np.int8)),
        "h": pa.array(hs, pa.binary(16)),
        "k": pa.array(k),
        "part": pa.array(partition_of(k, n_parts)),
        "val": pa.array(unit(k, seed, "split") < val_fraction),
    }
    if "src" in batch.column_names:  # provenance: which input and record each document came from
        cols["src"], cols["rec"] = batch.column("src"), batch.column("rec")
    if near:
        keys = np.zeros((len(hs), bands), np.uint64)
        if kept.any():
            keys[kept] = minhash.band_keys(minhash.signatures(cols["text"].filter(pa.array(kept)), seed=seed),
                                           bands, rows)
        cols["bands"] = pa.FixedSizeListArray.from_arrays(pa.array(keys.reshape(-1)), bands)
    if progress is not None:
        progress.add("normalise", len(hs), sum(len(t) for t in texts if t))
    return pa.table(cols)


def count_batch(batch: pa.Table) -> pa.Table:
    """Per-block counts of drop reasons ("" for kept) and replaced UTF-8, and the kept documents' characters
    (summed on the driver)."""
    c = Counter(batch.column("reason").to_pylist())
    c["invalid_utf8_replaced"] = int(pc.sum(batch.column("replaced")).as_py() or 0)
    chars = int(pc.sum(pc.utf8_length(batch.column("text"))).as_py() or 0)  # dropped documents' text is ""
    return pa.table({"what": list(c), "n": [int(v) for v in c.values()],
                     "chars": [chars if w == "" else 0 for w in c]})


def explode_bands(batch: pa.Table, *, n_groups: int) -> pa.Table:
    """One row per (kept document, band): bucket key bk (band index mixed in), document k, and a coarse group."""
    kept = pc.equal(batch.column("reason"), "")
    b = batch.filter(kept)
    if not b.num_rows:
        return pa.table({"bk": pa.array([], pa.uint64()), "k": pa.array([], pa.uint64()), "g": pa.array([], pa.int64())})
    bands = b.column("bands").combine_chunks()
    nb = bands.type.list_size
    bk = bands.flatten().to_numpy()
    k = np.repeat(b.column("k").to_numpy(), nb)
    return pa.table({"bk": bk, "k": k, "g": (bk % np.uint64(n_groups)).astype(np.int64)})


MAX_BUCKET_PEERS = 64  # a bucket member is paired with at most this many smaller-hash members: bounded work per bucket


def bucket_pairs(group: pa.Table, *, n_parts: int) -> pa.Table:
    """Candidate pairs from shared LSH buckets, as requests: k = the smaller-hash document, other = the larger one,
    routed to k's partition, where attach_partners finds k's text. Copies of one document (same k) are one member;
    in a bucket of thousands each member is paired with its bucket's MAX_BUCKET_PEERS smallest hashes only."""
    bk, k = group.column("bk").to_numpy(), group.column("k").to_numpy()
    order = np.lexsort((k, bk))
    bk, k = bk[order], k[order]
    one = np.ones(len(bk), bool)
    one[1:] = (bk[1:] != bk[:-1]) | (k[1:] != k[:-1])
    bk, k = bk[one], k[one]
    idx = np.arange(len(bk))
    first = np.ones(len(bk), bool)
    first[1:] = bk[1:] != bk[:-1]
    start = np.maximum.accumulate(np.where(first, idx, 0))
    n_peer = np.minimum(idx - start, MAX_BUCKET_PEERS)
    later = np.repeat(idx, n_peer)
    earlier = start[later] + np.arange(len(later)) - np.repeat(np.cumsum(n_peer) - n_peer, n_peer)
    # A pair sharing several bands meets in several groups: attach_partners keeps one.
    pairs = np.unique(np.stack([k[earlier], k[later]], axis=1), axis=0) if len(later) else np.zeros((0, 2), np.uint64)
    n = len(pairs)
    return pa.table({"text": pa.array([""] * n, pa.large_string()), "k": pa.array(pairs[:, 0], pa.uint64()),
                     "part": pa.array(partition_of(pairs[:, 0], n_parts)),
                     "other": pa.array(pairs[:, 1], pa.uint64()), "marker": pa.array(np.ones(n, bool))})


def lookup_docs(batch: pa.Table) -> pa.Table:
    """Kept documents as attach_partners reads them beside the pair requests."""
    b = batch.filter(pc.equal(batch.column("reason"), ""))
    return pa.table({"text": b.column("text"), "k": b.column("k"), "part": b.column("part"),
                     "other": pa.array(np.zeros(b.num_rows, np.uint64)), "marker": pa.array(np.zeros(b.num_rows, bool))})


def attach_partners(group: pa.Table, *, n_parts: int) -> pa.Table:
    """Kept documents (marker False) and pair requests (marker True, k among those documents) -> each distinct pair
    once, carrying k's text, keyed by the larger-hash document and routed to its partition for verification."""
    marker = group.column("marker").to_numpy(zero_copy_only=False)
    docs, req = group.filter(pa.array(~marker)), group.filter(pa.array(marker))
    pairs = np.unique(np.stack([req.column("k").to_numpy(), req.column("other").to_numpy()], axis=1), axis=0) \
        if req.num_rows else np.zeros((0, 2), np.uint64)
    dk = docs.column("k").to_numpy()
    order = np.argsort(dk, kind="stable")
    idx = order[np.searchsorted(dk, pairs[:, 0], sorter=order)] if len(pairs) else np.zeros(0, np.int64)
    n = len(pairs)
    return pa.table({"text": docs.column("text").take(pa.array(idx, pa.int64())).combine_chunks().cast(pa.large_string()),
                     "h": pa.array([b"\0" * 16] * n, pa.binary(16)), "k": pa.array(pairs[:, 1], pa.uint64()),
                     "part": pa.array(partition_of(pairs[:, 1], n_parts)), "val": pa.array(np.zeros(n, bool)),
                     "marker": pa.array(np.ones(n, bool)), "other": pa.array(pairs[:, 0], pa.uint64()),
                     "src": pa.array([""] * n, pa.string()), "rec": pa.array(np.zeros(n, np.int64))})


_TOKENIZERS: dict[str, object] = {}


def _tokenizer(tok_json: str):
    key = hashlib.sha256(tok_json.encode()).hexdigest()
    if key not in _TOKENIZERS:
        from tokenizers import Tokenizer

        _TOKENIZERS.clear()
        _TOKENIZERS[key] = Tokenizer.from_str(tok_json)
    return _TOKENIZERS[key]


def bottom(pairs, n: int) -> list:
    """The n pairs with the smallest keys: a sample that merges across partitions (the bottom of the union is the
    bottom of the bottoms)."""
    return heapq.nsmallest(n, pairs, key=lambda p: p[0])


def finalize_partition(group: pa.Table, *, tok_json: str, eot_id: int, window: int, pii: bool, review_n: int,
                       seed: int, cutoffs: dict, near_threshold: float = 1.0, example: dict | None = None,
                       out: str | None = None, progress=None) -> pa.Table:
    """One partition's documents (+ near-duplicate candidate pairs, marker rows) -> packed rows per split, and
    one stats row.

    Documents are taken in content-hash order, so the rows depend only on which documents the partition holds.
    Sample candidates are only those whose hash draw is below the split's cutoff (about twice the sample size
    over the whole corpus), so what the driver merges stays bounded however many partitions there are.

    out: the dataset URI, where the partition's provenance is written (raytrain/data/provenance.py); None: none.
    Of exact duplicates the copy with the smallest (source, record) survives, so provenance is deterministic too."""
    counts: Counter = Counter()
    marker = group.column("marker").to_numpy(zero_copy_only=False)
    pairs = group.filter(pa.array(marker))
    docs = group.filter(pa.array(~marker))
    docs = docs.take(pc.sort_indices(docs, [("h", "ascending"), ("src", "ascending"), ("rec", "ascending")]))
    h = docs.column("h").to_pylist()
    first = [i == 0 or h[i] != h[i - 1] for i in range(len(h))]
    counts["dropped_exact_duplicate"] = len(h) - sum(first)
    docs = docs.filter(pa.array(first))
    k = docs.column("k").to_numpy()
    is_near, near = neardup.verify(k, docs.column("text").to_pylist(), pairs, threshold=near_threshold,
                                   draw=unit(k, seed, "review"))
    counts["dropped_near_duplicate"] = int(is_near.sum())
    docs, k = docs.filter(pa.array(~is_near)), k[~is_near]
    texts = docs.column("text").to_pylist()
    if pii:
        texts = [scrub_pii(t, counts) for t in texts]
    val = docs.column("val").to_numpy(zero_copy_only=False)
    tok = _tokenizer(tok_json)
    part = int(group.column("part")[0].as_py()) if group.num_rows else 0
    src, rec = docs.column("src").to_pylist(), docs.column("rec").to_numpy()
    h = docs.column("h").to_pylist()
    out_rows, stats = [], {"counts": {}, "splits": {}, "provenance": {}}
    u_len, u_rev = unit(k, seed, "lengths"), unit(k, seed, "review")
    for split, mask in (("train", ~val), ("val", val)):
        idx = np.flatnonzero(mask)
        ex_counts: Counter = Counter()
        if example is None:
            rows, lens = _pack_text(tok, [texts[i] for i in idx], eot_id=eot_id, window=window, progress=progress)
        else:
            rows, lens = _pack_examples(tok, [texts[i] for i in idx], eot_id=eot_id, window=window, example=example,
                                        counts=ex_counts, progress=progress)
            counts.update({k: v for k, v in ex_counts.items() if k.startswith(("dropped_", "truncated"))})
        n = len(rows)
        spans = None
        if out is not None and example is None:
            spans = provenance.spans_of(lens, n, window)
            stats["provenance"][split] = provenance.write_docs(
                storage.join(out, split), part, h=[h[i] for i in idx], src=[src[i] for i in idx], rec=rec[idx],
                tokens=lens + 1, texts=[texts[i] for i in idx])
        out_rows.append((split, rows, spans))
        stats["splits"][split] = {**{k: v for k, v in ex_counts.items() if k.endswith("_tokens") or k == "examples"},
            "documents": int(len(idx)), "tokens": int(lens.sum()), "max": int(lens.max()) if len(lens) else 0,
            "rows": int(n),
            "lengths": bottom(((u, n) for u, n in zip(u_len[idx].tolist(), lens.tolist())
                                if u < cutoffs[split]), MAX_LENGTH_SAMPLE),
            "review": bottom(((u, texts[i]) for u, i in zip(u_rev[idx].tolist(), idx) if u < cutoffs["review"]),
                              review_n) if split == "train" else [],
        }
    counts["kept"] = len(texts)
    stats["counts"] = dict(counts)
    stats["near"] = near
    tables = [_rows_table(split, part, rows, window, spans) for split, rows, spans in out_rows]
    tables.append(pa.table({"kind": ["stats"], "split": [""], "part": [part], "seq": [0],
                            "tokens": pa.array([None], pa.list_(pa.int32())),
                            "spans": pa.array([None], pa.list_(pa.int32())),
                            "stats": pa.array([json.dumps(stats)], pa.large_string())}))
    return pa.concat_tables(tables)


def _pack_text(tok, texts: list[str], *, eot_id: int, window: int, progress) -> tuple[np.ndarray, np.ndarray]:
    """Documents, each followed by eot, cut into rows of `window` tokens (the remainder of the last is dropped);
    (rows, document lengths)."""
    lens = np.zeros(len(texts), np.int64)
    pieces = []
    for s in range(0, len(texts), 1000):  # encode in chunks: Encoding objects are large, ids are kept as int32
        enc = tok.encode_batch_fast(texts[s:s + 1000])
        for j, e in enumerate(enc):
            ids = np.asarray(e.ids, np.int32)
            lens[s + j] = len(ids)
            pieces.append(ids)
            pieces.append(np.array([eot_id], np.int32))
        if progress is not None:
            progress.add("tokenize", len(enc), sum(len(t) for t in texts[s:s + 1000]))
    flat = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    n = len(flat) // window
    return flat[: n * window].reshape(n, window), lens


def _pack_examples(tok, docs: list[str], *, eot_id: int, window: int, example: dict, counts: Counter,
                   progress) -> tuple[np.ndarray, np.ndarray]:
    """Example documents -> rows of tokens | loss_mask | segment_ids side by side ([n, 3 * window]); (rows,
    example lengths). Counts examples, learned / masked / padding tokens, truncations and drops."""
    from raytrain.data.examples import Encoder, pack

    enc = Encoder(tok, eot_id=eot_id, chat_template=example.get("chat_template"))
    encoded = [enc(d) for d in docs]
    if progress is not None:
        progress.add("tokenize", len(docs), sum(len(d) for d in docs))
    rows = pack(encoded, window=window, packed=example["pack"], too_long=example["too_long"], pad_id=eot_id,
                counts=counts)
    return rows.reshape(len(rows), 3 * window), np.array([len(ids) for ids, _ in encoded], np.int64)


def _rows_table(split: str, part: int, rows: np.ndarray, window: int, spans) -> pa.Table:
    """Packed rows; `spans` ([k, 5]: row, pos, len, doc, doc_start; None: no provenance) ride along per row as
    [pos, len, doc, doc_start] * its spans."""
    n = len(rows)
    if spans is None:
        span_col = pa.array([None] * n, pa.list_(pa.int32()))
    else:
        offsets = np.searchsorted(spans[:, 0], np.arange(n + 1)) * 4
        span_col = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                            pa.array(spans[:, 1:].reshape(-1).astype(np.int32)))
    return pa.table({
        "kind": pa.array(["rows"] * n, pa.string()), "split": pa.array([split] * n, pa.string()),
        "part": pa.array(np.full(n, part, np.int64)), "seq": pa.array(np.arange(n, dtype=np.int64)),
        "tokens": pa.ListArray.from_arrays(pa.array(np.arange(0, rows.size + 1, rows.shape[1], dtype=np.int32)),
                                           pa.array(rows.reshape(-1), pa.int32())),
        "spans": span_col,
        "stats": pa.array([None] * n, pa.large_string()),
    })


def assign_shards(batch: pa.Table, *, offsets: dict, shard_rows: int) -> pa.Table:
    """Packed rows -> their global row number in the split (partitions in order) and their shard."""
    b = batch.filter(pc.equal(batch.column("kind"), "rows"))
    split, part, seq = (b.column(c).to_numpy(zero_copy_only=False) for c in ("split", "part", "seq"))
    g = np.array([offsets[s][p] for s, p in zip(split.tolist(), part.tolist())], np.int64) + seq if len(seq) else seq
    shard = g // shard_rows
    key = np.array([f"{s}/{x:08d}" for s, x in zip(split.tolist(), shard.tolist())], object)
    return pa.table({"key": pa.array(key, pa.string()), "split": b.column("split"), "g": pa.array(g, pa.int64()),
                     "tokens": b.column("tokens"), "part": b.column("part"), "spans": b.column("spans")})


def write_shard_group(group: pa.Table, *, out: str, formats: list[str], window: int, shard_rows: int,
                      columns: int = 1, progress=None) -> pa.Table:
    """One shard's rows -> its files (one per format), skipped when an earlier run wrote the same bytes."""
    from raytrain.data.shards import write_shard

    group = group.take(pc.sort_indices(group, [("g", "ascending")]))
    split = group.column("split")[0].as_py()
    start = int(group.column("g")[0].as_py())
    # columns > 1: fine-tuning rows, tokens | loss_mask | segment_ids side by side (raytrain/data/examples.py)
    rows = np.asarray(group.column("tokens").combine_chunks().flatten().to_numpy(), np.int32).reshape(-1, window * columns)
    entries, reused = write_shard(storage.join(out, split), start // shard_rows, start, rows, formats, columns=columns)
    prov = None
    if group.column("spans").null_count == 0:  # provenance: this shard's span table beside it
        prov = provenance.write_spans(storage.join(out, split), start // shard_rows,
                                      sample_ids=group.column("g").to_numpy(), part=group.column("part").to_numpy(),
                                      spans=group.column("spans"))
    if progress is not None:
        progress.add("write", len(rows), sum(e["bytes"] for e in entries.values()))
    return pa.table({"split": [split], "index": [start // shard_rows], "entries": [json.dumps(entries)],
                     "reused": [reused], "spans": [json.dumps(prov)]})


def clean_documents(docs: Iterable[str], min_chars: int, max_chars: int, near_dup_threshold: float,
                    pii: bool, seed: int) -> tuple[list[str], Counter]:
    """Every quality step of the prepare pipeline (the stages above), in this process: the kept documents in input
    order (the first copy of exact duplicates; near duplicates as the pipeline decides) and per-step counts."""
    docs = list(docs)
    near = near_dup_threshold < 1.0
    bands, rows = minhash.lsh_params(near_dup_threshold, minhash.NUM_PERM) if near else (0, 0)
    s = normalise_batch(pa.table({"text": pa.array(docs, pa.large_string()), "utf8": ["ok"] * len(docs)}),
                        min_chars=min_chars, max_doc_chars=max_chars, near=near, bands=bands, rows=rows,
                        seed=seed, n_parts=1, val_fraction=0.0)
    counts: Counter = Counter({"input": len(docs)})
    drops: set = set()
    if near:
        requests = bucket_pairs(explode_bands(s, n_groups=1), n_parts=1)
        pairs = attach_partners(pa.concat_tables([lookup_docs(s), requests]), n_parts=1)
        docs = lookup_docs(s)
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
