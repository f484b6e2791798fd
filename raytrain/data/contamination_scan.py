"""`raytrain data contamination DATA`: the documents of a prepared split that share an n-gram with evaluation data
(raytrain/data/contamination.py), found by reading the split's inputs again as `prepare` read them."""

from __future__ import annotations

from raytrain.data import pipeline
from raytrain.data.contamination import NgramIndex


def scan(uri: str, *, index: NgramIndex, split: str = "train") -> dict:
    """The documents of a prepared split that share an n-gram with the index, with their sources: the split's
    inputs read again (as `prepare` read them, normalised), flagged per document, and kept if the split holds them
    (their content hash is in its document tables, streamed)."""
    from raytrain import storage
    from raytrain.data.prepare import PrepareConfig
    from raytrain.data.provenance import HASH_BYTES, Provenance

    prov = Provenance(storage.join(storage.absolute(uri), split), f"contamination: {uri}")
    cfg = PrepareConfig(**{k: v for k, v in prov.prepare.items() if k in PrepareConfig.model_fields})
    flagged = flag_inputs(cfg, index)
    key = lambda f: bytes.fromhex(f["h"])[:HASH_BYTES]  # noqa: E731 - what the document tables keep of the hash
    hashes = {key(f) for f in flagged}
    in_split: set = set()
    for path in prov.document_tables():  # one table at a time: memory as one partition's hashes
        in_split |= hashes & set(prov.table(path, columns=["h"]).column("h").to_pylist())
    found = [f for f in flagged if key(f) in in_split]
    return {"split": prov.uri, "ngram": index.n, "evaluation_documents": index.documents, "contaminated": found,
            "by_source": by_example(index, found)}


def by_example(index: NgramIndex, found: list[dict]) -> dict:
    """Per task or file: how many of its examples share an n-gram with a document of the split, which, and the
    clean ones (the subset an evaluation scores to report a clean figure beside the whole)."""
    hit = {e for f in found for e in f.get("examples") or ()}
    out: dict = {}
    for e, (src, i) in enumerate(index.examples):
        rec = out.setdefault(src, {"examples": 0, "contaminated": [], "clean": []})
        rec["examples"] += 1
        rec["contaminated" if e in hit else "clean"].append(i)
    return out


def flag_inputs(cfg, index: NgramIndex) -> list[dict]:
    """Every input document (as prepare reads and normalises it) that shares an n-gram with the index: {source,
    record, h, hits, head}. On Ray Data for inputs of 32 MB and more, like prepare."""
    src = pipeline.Sources(cfg)
    kw = pipeline.read_kw(cfg)
    if pipeline.use_ray(cfg.engine if cfg.engine != "auto" else ("ray" if src.bytes >= pipeline.LOCAL_MAX_BYTES
                                                                 else "local")):
        import ray.data

        pipeline.quiet_ray_data()
        ds = ray.data.from_items(src.units, override_num_blocks=max(1, len(src.units))).map_batches(
            _flag_units, batch_size=1, batch_format="pyarrow", fn_kwargs={"read_kw": kw, "index": index})
        rows = ds.take_all()
    else:
        import pyarrow as pa

        rows = [r for u in src.units for r in _flag_units(pa.Table.from_pylist([u]), read_kw=kw,
                                                            index=index).to_pylist()]
    if src.builtin:
        rows += _flag_table(pipeline.builtin_table(src.builtin), index).to_pylist()
    return sorted(rows, key=lambda r: (r["source"], r["record"]))


def _flag_units(batch, *, read_kw: dict, index: NgramIndex):
    return _flag_table(pipeline.read_batch(batch, **read_kw), index)


def _flag_table(raw, index: NgramIndex):
    import hashlib

    import pyarrow as pa

    from raytrain.data.quality import normalise

    out = {"source": [], "record": [], "h": [], "hits": [], "head": [], "examples": []}
    for text, src, rec in zip(raw.column("text").to_pylist(), raw.column("src").to_pylist(),
                              raw.column("rec").to_pylist()):
        if text is None:
            continue
        t = normalise(text)
        n = index.hits(t)
        if n:
            out["source"].append(src)
            out["record"].append(rec)
            out["h"].append(hashlib.sha256(t.encode()).digest()[:16].hex())
            out["hits"].append(n)
            out["head"].append(t[:80])
            out["examples"].append(index.examples_hit(t) if index.owners else [])
    return pa.table({"source": pa.array(out["source"], pa.string()), "record": pa.array(out["record"], pa.int64()),
                     "h": pa.array(out["h"], pa.string()), "hits": pa.array(out["hits"], pa.int64()),
                     "head": pa.array(out["head"], pa.string()),
                     "examples": pa.array(out["examples"], pa.list_(pa.int64()))})
