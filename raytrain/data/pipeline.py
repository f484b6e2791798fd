"""Driver side of `raytrain prepare`: runs the stages of data/stages.py as one Ray Data pipeline on the cluster's
CPUs (engine=ray), or in this process for small inputs (engine=local: same functions, same bytes out).

    read files ─ map_batches(normalise + sign) ─ materialize S (object store; spills to disk)
      S ─ map_batches(explode LSH bands) ─ groupby(band group).map_groups(bucket_pairs) ─ candidate pairs P
      S kept ∪ P ─ groupby(partition of the smaller-hash document).map_groups(attach_partners) ─ pairs + its text
      S ─ sample (by hash) ─ driver trains the tokenizer on it (bounded)
      S kept ∪ pairs ─ groupby(partition).map_groups(dedup, verify pairs, split, tokenize, pack, stats) ─ F
      F rows ─ map_batches(global row number, shard) ─ groupby(shard).map_groups(write shard files)
Only counts, the tokenizer sample, per-partition statistics and one manifest entry per shard reach the driver.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
import threading
import time
from collections import Counter
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raytrain.data import minhash, neardup, provenance, stages
from raytrain.data.corpus import BUILTIN, python_docs
from raytrain.data.inputs import expand, read_file, read_units, use_ray, user_errors_from_ray
from raytrain.data.report import MAX_LENGTH_SAMPLE
from raytrain.errors import UserError

LOCAL_MAX_BYTES = 32 << 20  # engine=auto: smaller inputs are prepared in this process (Ray start-up costs more)
TOKENIZER_SAMPLE_CHARS = 200 << 20  # a cap on the tokenizer sample however large its documents
# A local Ray instance started by prepare. Every process that touches the object store maps its pages, so its
# size counts once per such process: small (above it, blocks spill to disk), and one spill and one restore worker
# instead of Ray's four each, which otherwise stay alive each mapping the whole store (measured, 1 GB corpus:
# whole-tree RSS 5.3 GB with Ray's 4 IO workers of each kind, 3.9 GB with one; 64 MB corpus: 2.9-3.0 GB either way).
LOCAL_RAY = {"object_store_memory": 256 << 20, "_system_config": {"max_io_workers": 1}}
SPILL_FACTOR = 4  # disk a local instance needs for spilled blocks, per byte of input (measured 4.1 at 1 GB)
NORMALISE_BATCH = 2048
# Ray Data's shuffle (SHUFFLE_V2) coalesces up to 1 GiB of input blocks per node into ONE map task by default:
# that task's memory then grows with the corpus up to 1 GiB and more (measured: 2.9x the peak memory for 16x the
# corpus). A few partitions' worth per map task keeps every shuffle's tasks bounded whatever the corpus.
SHUFFLE_BATCH_BYTES = 32 << 20
EXAMPLE_STATS = ("examples", "learned_tokens", "masked_tokens", "pad_tokens")  # per split, summed over partitions


class Progress:
    """Documents and bytes per stage, reported by the tasks once per batch; the driver logs a line every few seconds."""

    def __init__(self):
        self.stages: dict[str, list] = {}

    def add(self, stage: str, docs: int, nbytes: int) -> None:
        now = time.monotonic()
        s = self.stages.setdefault(stage, [0, 0, now, now])
        s[0] += docs
        s[1] += nbytes
        s[3] = now

    def snapshot(self) -> dict:
        return {k: (v[0], v[1], v[3] - v[2]) for k, v in self.stages.items()}


class _ActorProgress:
    def __init__(self, handle):
        self.handle = handle

    def add(self, stage: str, docs: int, nbytes: int) -> None:
        self.handle.add.remote(stage, docs, nbytes)


class _Reporter:
    """Logs the stages that moved, at most every `every` seconds while the pipeline runs (never per record)."""

    def __init__(self, snapshot: Callable[[], dict], log, every: float = 5.0):
        self.snapshot, self.log, self.every = snapshot, log, every
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._seen: dict[str, int] = {}

    def __enter__(self):
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.every):
            self.tick()

    def tick(self):
        try:
            snap = self.snapshot()
        except Exception:  # noqa: BLE001 - progress is best effort; the pipeline reports real failures
            return
        moved = [(k, v) for k, v in snap.items() if self._seen.get(k) != v[0]]
        self._seen.update({k: v[0] for k, v in moved})
        if moved:
            self.log("prepare: " + "; ".join(
                f"{stage} {docs:,} {'sequences' if stage == 'write' else 'documents'}, {nbytes / 2**20:.1f} MB"
                + (f", {nbytes / 2**20 / dt:.1f} MB/s" if dt > 1 else "") for stage, (docs, nbytes, dt) in moved))

    def say(self, msg: str) -> None:
        """A stage line, after the figures of the stages before it (so the log reads in order)."""
        self._catch_up()
        self.log(msg)

    def _catch_up(self) -> None:
        if time.monotonic() - self._t0 >= self.every:  # a run of a few seconds needs no figures on the way
            self.tick()

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if exc[0] is None:
            self._catch_up()  # the last figures


class Sources:
    """The inputs, expanded (bad globs fail here, before any work), with their total size, cut into read units."""

    def __init__(self, cfg):
        files: list[tuple[str, int]] = []
        self.builtin: list[str] = []
        for spec in cfg.inputs:
            if spec in BUILTIN:
                self.builtin += list(python_docs(cfg.max_chars))
                continue
            files += expand(spec)
        self.files = [uri for uri, _ in files]
        self.n_files = len(files)
        self.bytes = sum(size for _, size in files) + sum(len(d) for d in self.builtin)
        self.units = read_units(files, cfg.text_mode)
        # A function of the inputs and settings only, never of the cluster: the output depends on it.
        self.n_parts = max(1, math.ceil(self.bytes / (cfg.partition_mb * 2**20)))


def read_batch(batch: pa.Table, **kw) -> pa.Table:
    """Read units -> documents with their source (input URI) and record (raytrain/data/provenance.py)."""
    units = batch.to_pylist()
    got = [read_file(u["uri"], start=u["start"], stop=u["stop"], **kw) for u in units]
    rows = [r for g in got for r in g]
    return pa.table({"text": pa.array([t for t, _, _ in rows], pa.large_string()),
                     "utf8": pa.array([s for _, s, _ in rows], pa.string()),
                     "src": pa.array([u["uri"] for u, g in zip(units, got) for _ in g], pa.string()),
                     "rec": pa.array([r for _, _, r in rows], pa.int64())})


def builtin_table(docs: list[str]) -> pa.Table:
    return pa.table({"text": pa.array(docs, pa.large_string()), "utf8": pa.array(["ok"] * len(docs), pa.string()),
                     "src": pa.array([provenance.BUILTIN_SOURCE] * len(docs), pa.string()),
                     "rec": pa.array(np.arange(len(docs), dtype=np.int64))})


def _kept_docs(batch: pa.Table) -> pa.Table:
    b = batch.filter(pc.equal(batch.column("reason"), ""))
    return pa.table({"text": b.column("text"), "h": b.column("h"), "k": b.column("k"), "part": b.column("part"),
                     "val": b.column("val"), "marker": pa.array(np.zeros(b.num_rows, bool)),
                     "other": pa.array(np.zeros(b.num_rows, np.uint64)), "src": b.column("src"),
                     "rec": b.column("rec")})




def _sample_batch(batch: pa.Table, *, frac: float, seed: int) -> pa.Table:
    k = batch.column("k").to_numpy()
    u = stages.unit(k, seed, "tokenizer")
    keep = (pc.equal(batch.column("reason"), "").to_numpy(zero_copy_only=False)
            & ~batch.column("val").to_numpy(zero_copy_only=False) & (u < frac))
    b = batch.filter(pa.array(keep))
    return pa.table({"u": pa.array(u[keep]), "h": b.column("h"), "text": b.column("text")})


def _stats_batch(batch: pa.Table) -> pa.Table:
    return batch.filter(pc.equal(batch.column("kind"), "stats")).select(["stats"])


def tokenizer_sample(rows: list[dict], limit: int) -> list[str]:
    """The sample's documents, deterministic: smallest hash draws first, one copy each, bounded; in hash order."""
    rows = sorted(rows, key=lambda r: (r["u"], r["h"]))
    seen, picked, chars = set(), [], 0
    for r in rows:
        if r["h"] in seen:
            continue
        if (limit and len(picked) >= limit) or chars >= TOKENIZER_SAMPLE_CHARS:
            break
        seen.add(r["h"])
        picked.append(r)
        chars += len(r["text"])
    return [r["text"] for r in sorted(picked, key=lambda r: r["h"])]


def merge_stats(stats: list[dict], review_n: int) -> dict:
    """Per-partition statistics -> totals, bottom-k length samples and the review sample."""
    counts: Counter = Counter()
    splits: dict[str, dict] = {}
    rows_by_part: dict[str, dict[int, int]] = {"train": {}, "val": {}}
    for part, s in stats:
        counts.update(s["counts"])
        for name, x in s["splits"].items():
            t = splits.setdefault(name, {"documents": 0, "tokens": 0, "max": 0, "rows": 0, "lengths": [], "review": []})
            t["documents"] += x["documents"]
            t["tokens"] += x["tokens"]
            t["max"] = max(t["max"], x["max"])
            t["rows"] += x["rows"]
            for key in EXAMPLE_STATS:  # fine-tuning examples only
                if key in x:
                    t[key] = t.get(key, 0) + x[key]
            t["lengths"] = stages.bottom(t["lengths"] + [tuple(p) for p in x["lengths"]], MAX_LENGTH_SAMPLE)
            t["review"] = stages.bottom(t["review"] + [tuple(p) for p in x["review"]], review_n)
            rows_by_part[name][part] = x["rows"]
    offsets = {}
    for name, per in rows_by_part.items():
        acc, offsets[name] = 0, {}
        for p in sorted(per):
            offsets[name][p] = acc
            acc += per[p]
    near = neardup.merge([s["near"] for _, s in stats if "near" in s])
    docs = {name: sorted((e for _, s in stats for n, e in s.get("provenance", {}).items() if n == name and e),
                         key=lambda e: e["part"]) for name in ("train", "val")}
    return {"counts": counts, "splits": splits, "offsets": offsets, "near": near, "provenance_docs": docs}


def _stage_kwargs(cfg, src: Sources) -> dict:
    near = cfg.near_dup_threshold < 1.0
    bands, rows = minhash.lsh_params(cfg.near_dup_threshold, minhash.NUM_PERM) if near else (0, 0)
    return dict(min_chars=cfg.min_chars, max_doc_chars=cfg.max_doc_chars, near=near, bands=bands, rows=rows,
                seed=cfg.seed, n_parts=src.n_parts, val_fraction=cfg.val_fraction,
                contamination=getattr(src, "contamination", None))


def run(cfg, out: str, make_tokenizer: Callable[[Optional[list[str]]], tuple], log) -> dict:
    """Runs the stages; returns {counts, splits (merged stats), shards: {split: {fmt: [entries]}}, reused, written,
    tok, eot_id, engine}. make_tokenizer(sample or None) -> (tokenizer, eot_id); None: no sample needed."""
    src = Sources(cfg)
    engine = cfg.engine
    if engine == "auto":
        # Small inputs in this process even on a cluster: starting the pipeline costs more than they take.
        engine = "ray" if src.bytes >= LOCAL_MAX_BYTES else "local"
    # A local instance's disk must hold the spills: checked before it starts.
    ray_engine = use_ray(engine, LOCAL_RAY, before_local_start=lambda: check_spill_space(src.bytes, log))
    dc = cfg.decontaminate
    contamination = None
    if dc.tasks or dc.files:  # the evaluation data's n-grams, built here once (small beside any corpus)
        from raytrain.data.contamination import build_index

        contamination, per_source = build_index(tasks=dc.tasks, files=dc.files, include_path=dc.include_path,
                                                n=dc.ngram)
        log(f"prepare: dropping documents that share a {dc.ngram}-word n-gram with {contamination.documents:,} "
            f"evaluation documents ({', '.join(per_source)})")
    src.contamination = contamination
    log(f"prepare: {src.n_files + (1 if src.builtin else 0)} input(s) in {len(src.units) + (1 if src.builtin else 0)} "
        f"read unit(s), {src.bytes / 2**20:.1f} MB, "
        f"{src.n_parts} partition(s), engine {'ray' if ray_engine else 'local'}")
    with user_errors_from_ray():
        r = (_run_ray if ray_engine else _run_local)(cfg, src, out, make_tokenizer, log)
        # What the output was made from, for lineage (raytrain/lineage.py): one more read of each input file.
        r["inputs"] = provenance.input_digests(src.files, cfg.max_chars if src.builtin else None, ray_engine) \
            if cfg.provenance else None
    if contamination is not None:
        r["decontaminate"] = {"ngram": dc.ngram, "evaluation_documents": per_source,
                              "dropped": int(r["counts"].get("dropped_contaminated", 0))}
    kw = _stage_kwargs(cfg, src)
    r["near"] = ({"threshold": cfg.near_dup_threshold, "bands": kw["bands"], "rows": kw["rows"], **r["near"],
                  "s_curve": neardup.s_curve(cfg.near_dup_threshold, kw["bands"], kw["rows"])} if kw["near"] else None)
    return r


def spill_dir() -> str:
    """Where a local Ray instance spills object-store blocks: its temp directory, chosen as Ray chooses it."""
    return os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"


def check_spill_space(nbytes: int, log) -> None:
    """Fails before any work when the spill disk cannot hold what the pipeline parks there (measured: 4.1x the
    input at 1 GB, docs/BENCHMARKS.md); warns when it is tight. Running out midway loses hours, not seconds."""
    where = spill_dir()
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return  # Ray will say what is wrong with its temp directory
    need = SPILL_FACTOR * nbytes
    msg = (f"{free / 2**30:.1f} GB free in {where}, where Ray spills the pipeline's blocks; {nbytes / 2**30:.1f} GB "
           f"of input needs about {need / 2**30:.1f} GB there")
    if free < need / 2:
        raise UserError(f"prepare: {msg}: free space, or set RAY_TMPDIR to a directory on a larger disk")
    if free < need:
        log(f"prepare: warning: {msg}; it may run out midway")


def read_kw(cfg) -> dict:
    kw = {"text_field": cfg.text_field, "text_mode": cfg.text_mode, "invalid_utf8": cfg.invalid_utf8}
    if cfg.format != "text":
        kw["example"] = {"fmt": cfg.format, "fields": {k: getattr(cfg, k) for k in
                                                       ("prompt_field", "completion_field", "messages_field")}}
    return kw


def _finish(cfg, src, counts_rows, make_tokenizer, sample_fn, log):
    counts: Counter = Counter()
    kept_chars = 0
    for r in counts_rows:
        counts[r["what"]] += r["n"]
        kept_chars += r["chars"]
    n_kept = counts.pop("", 0)
    counts = Counter({k: v for k, v in counts.items() if v})
    counts["input"] = n_kept + sum(v for k, v in counts.items() if k.startswith("dropped_"))
    if not n_kept:
        raise UserError(f"no usable documents in inputs {cfg.inputs} (all empty or shorter than min_chars={cfg.min_chars})")
    sample = None
    if not cfg.tokenizer:
        # Draw about twice what the sample needs, in documents and in characters, so what reaches this process
        # is bounded however large the corpus or its documents (0 = "all" documents is still capped in characters).
        frac = min(1.0, 2.0 * TOKENIZER_SAMPLE_CHARS / max(1, kept_chars))
        if cfg.tokenizer_sample_docs:
            frac = min(frac, 2.0 * cfg.tokenizer_sample_docs / n_kept)
        sample = tokenizer_sample(sample_fn(frac), cfg.tokenizer_sample_docs)
        log(f"prepare: training the tokenizer on {len(sample):,} documents")
    tok, eot_id = make_tokenizer(sample)
    return counts, tok, eot_id, n_kept


def _run_local(cfg, src: Sources, out: str, make_tokenizer, log) -> dict:
    prog = Progress()
    kw = _stage_kwargs(cfg, src)
    with _Reporter(prog.snapshot, log) as rep:
        log = rep.say
        raw = [builtin_table(src.builtin)]
        raw += [read_batch(pa.Table.from_pylist([u]), **read_kw(cfg)) for u in src.units]
        raw = pa.concat_tables(raw)
        S = pa.concat_tables([stages.normalise_batch(raw.slice(i, NORMALISE_BATCH), progress=prog, **kw)
                              for i in range(0, max(raw.num_rows, 1), NORMALISE_BATCH)])
        counts, tok, eot_id, n_kept = _finish(cfg, src, stages.count_batch(S).to_pylist(), make_tokenizer,
                                      lambda frac: _sample_batch(S, frac=frac, seed=cfg.seed).to_pylist(), log)
        parts = [_kept_docs(S)]
        if kw["near"]:
            requests = stages.bucket_pairs(stages.explode_bands(S, n_groups=1), n_parts=src.n_parts)
            # one group for the whole corpus: attach_partners needs only each pair beside its document
            parts.append(stages.attach_partners(pa.concat_tables([stages.lookup_docs(S), requests]), n_parts=src.n_parts))
        docs = pa.concat_tables(parts)
        fin_kw = _finalize_kwargs(cfg, tok, eot_id, n_kept, out)
        part_col = docs.column("part").to_numpy()
        F = pa.concat_tables([stages.finalize_partition(docs.filter(pa.array(part_col == p)), progress=prog, **fin_kw)
                              for p in np.unique(part_col)])
        merged = merge_stats([(r["part"], json.loads(r["stats"])) for r in
                              F.filter(pc.equal(F.column("kind"), "stats")).select(["part", "stats"]).to_pylist()],
                             cfg.review_samples)
        _check_train(merged, cfg)
        rows = stages.assign_shards(F, offsets=merged["offsets"], shard_rows=cfg.shard_rows)
        keys = rows.column("key").to_numpy(zero_copy_only=False)
        written = [stages.write_shard_group(rows.filter(pa.array(keys == key)), progress=prog, **_write_kwargs(cfg, out))
                   for key in sorted(set(keys.tolist()))]
    return _result(merged, counts, pa.concat_tables(written).to_pylist() if written else [], tok, eot_id, "local")


def _finalize_kwargs(cfg, tok, eot_id, n_kept: int, out: str) -> dict:
    def cut(n, share):  # twice the expected need: the bottom-k of the whole split lies below it
        return 1.0 if share <= 0 else min(1.0, 2.0 * n / max(1.0, n_kept * share) + 1e-9)

    cutoffs = {"train": cut(MAX_LENGTH_SAMPLE, 1 - cfg.val_fraction), "val": cut(MAX_LENGTH_SAMPLE, cfg.val_fraction),
               "review": cut(max(cfg.review_samples, 100), 1 - cfg.val_fraction)}
    example = None
    if cfg.format != "text":
        from raytrain.data.examples import chat_template

        example = {"pack": cfg.pack, "too_long": cfg.too_long,
                   "chat_template": chat_template(cfg.chat_template, cfg.tokenizer) if cfg.format == "chat" else None}
    return dict(tok_json=tok.to_str(), eot_id=eot_id, window=cfg.seq_len + 1, pii=cfg.pii_scrub,
                review_n=cfg.review_samples, seed=cfg.seed, cutoffs=cutoffs, near_threshold=cfg.near_dup_threshold,
                example=example, out=out if cfg.provenance else None)


def _write_kwargs(cfg, out) -> dict:
    return dict(out=out, formats=list(cfg.formats), window=cfg.seq_len + 1, shard_rows=cfg.shard_rows,
                columns=1 if cfg.format == "text" else 3)


def _check_train(merged: dict, cfg) -> None:
    if not merged["splits"].get("train", {}).get("rows"):
        raise UserError(f"train split has fewer than seq_len+1={cfg.seq_len + 1} tokens; use more text or a smaller seq_len")


def _result(merged, counts, written_rows, tok, eot_id, engine) -> dict:
    shards: dict[str, dict[str, list]] = {"train": {}, "val": {}}
    spans: dict[str, list] = {"train": [], "val": []}
    reuse = {"train": [0, 0], "val": [0, 0]}
    for r in sorted(written_rows, key=lambda r: (r["split"], r["index"])):
        entries = json.loads(r["entries"])
        for fmt, entry in entries.items():
            shards[r["split"]].setdefault(fmt, []).append(entry)
        if json.loads(r["spans"]):
            spans[r["split"]].append(json.loads(r["spans"]))
        reuse[r["split"]][0] += r["reused"]
        reuse[r["split"]][1] += len(entries) - r["reused"]
    counts.update({k: v for k, v in merged["counts"].items() if v})
    return {"counts": counts, "splits": merged["splits"], "shards": shards, "reuse": reuse, "tok": tok,
            "eot_id": eot_id, "engine": engine, "near": merged["near"],
            "provenance": {split: {"documents": merged["provenance_docs"][split], "spans": spans[split]}
                           for split in ("train", "val")}}


def quiet_ray_data():
    """Ray Data's own logging (operator start lines, progress, a warning that bars are off, a second copy of any task
    error) kept out of our commands' output; failures still arrive as exceptions. Returns its DataContext."""
    import ray.data

    logging.getLogger("ray.data").setLevel(logging.CRITICAL)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # our own throttled progress lines instead of per-operator bars
    ctx.print_on_execution_start = False
    return ctx


def _run_ray(cfg, src: Sources, out: str, make_tokenizer, log) -> dict:
    import ray
    import ray.data

    ctx = quiet_ray_data()
    ctx.shuffle_input_batch_bytes = SHUFFLE_BATCH_BYTES
    # Sort-based shuffle: its intermediate blocks live in the object store (bounded, spilled to disk) and each
    # reduce task takes one partition. The default hash shuffle (SHUFFLE_V2) keeps every partition's blocks in
    # aggregator actors' heaps until the last input arrives, so their memory grew with the corpus (measured:
    # whole-tree PSS 1.88x for 16x the corpus with it, 1.29x with this; the output bytes are the same).
    ctx.shuffle_strategy = ray.data.context.ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    actor = ray.remote(Progress).options(num_cpus=0).remote()
    prog = _ActorProgress(actor)
    kw = _stage_kwargs(cfg, src)
    with _Reporter(lambda: ray.get(actor.snapshot.remote(), timeout=10), log) as rep:
        log = rep.say
        pieces = []
        if src.units:
            pieces.append(ray.data.from_items(src.units, override_num_blocks=len(src.units))
                          .map_batches(functools.partial(read_batch, **read_kw(cfg)), batch_size=1,
                                       batch_format="pyarrow"))
        if src.builtin:
            pieces.append(ray.data.from_arrow(builtin_table(src.builtin)))
        raw = pieces[0].union(*pieces[1:]) if len(pieces) > 1 else pieces[0]
        S = raw.map_batches(stages.normalise_batch, batch_size=NORMALISE_BATCH, batch_format="pyarrow",
                            fn_kwargs={**kw, "progress": prog}).materialize()
        counts, tok, eot_id, n_kept = _finish(
            cfg, src, S.map_batches(stages.count_batch, batch_size=None, batch_format="pyarrow").take_all(),
            make_tokenizer,
            lambda frac: S.map_batches(_sample_batch, batch_size=None, batch_format="pyarrow",
                                       fn_kwargs={"frac": frac, "seed": cfg.seed}).take_all(), log)
        docs = S.map_batches(_kept_docs, batch_size=None, batch_format="pyarrow")
        if kw["near"]:
            n_groups = max(1, src.n_parts)
            parts_kw = {"n_parts": src.n_parts}
            requests = (S.select_columns(["reason", "k", "bands"])
                        .map_batches(stages.explode_bands, batch_size=None, batch_format="pyarrow",
                                     fn_kwargs={"n_groups": n_groups})
                        .groupby("g").map_groups(stages.bucket_pairs, batch_format="pyarrow", fn_kwargs=parts_kw))
            # Each pair meets the text of its smaller-hash document here: the kept text goes through this shuffle
            # once, so finalize_partition can compute the pair's exact Jaccard (docs/DATA.md, near duplicates).
            pairs = (S.map_batches(stages.lookup_docs, batch_size=None, batch_format="pyarrow").union(requests)
                     .groupby("part").map_groups(stages.attach_partners, batch_format="pyarrow", fn_kwargs=parts_kw))
            docs = docs.union(pairs)
        log("prepare: de-duplicating, tokenizing and packing")
        F = docs.groupby("part").map_groups(stages.finalize_partition, batch_format="pyarrow",
                                            fn_kwargs={**_finalize_kwargs(cfg, tok, eot_id, n_kept, out), "progress": prog}
                                            ).materialize()
        stats_rows = F.map_batches(lambda b: b.filter(pc.equal(b.column("kind"), "stats")).select(["part", "stats"]),
                                   batch_size=None, batch_format="pyarrow").take_all()
        merged = merge_stats([(r["part"], json.loads(r["stats"])) for r in stats_rows], cfg.review_samples)
        _check_train(merged, cfg)
        log("prepare: writing shards")
        written = (F.map_batches(stages.assign_shards, batch_size=None, batch_format="pyarrow",
                                 fn_kwargs={"offsets": merged["offsets"], "shard_rows": cfg.shard_rows})
                   .groupby("key").map_groups(stages.write_shard_group, batch_format="pyarrow",
                                              fn_kwargs={**_write_kwargs(cfg, out), "progress": prog})
                   .take_all())
    ray.kill(actor)
    return _result(merged, counts, written, tok, eot_id, "ray")
