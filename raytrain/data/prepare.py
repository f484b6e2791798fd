"""`raytrain prepare`: documents -> byte-level BPE tokenizer -> packed sequences -> Parquet / WebDataset shards + manifest.

Layout written under `out`:
    tokenizer.json
    prepare.yaml                the resolved settings
    train/shard-00000.parquet   columns: sample_id int64, tokens fixed_size_list<int32>[seq_len+1]
    train/shard-00000.tar       WebDataset: <sample_id>.tokens.npy per sample, same rows in the same order
    train/_written/             one record per shard file written (sha256 of its rows and of its bytes):
                                a re-run skips shard files already written and verified
    train/manifest.json         written last: a split without it is incomplete and is refused
    val/...
    report.json, report.md, doc_lengths.png, review_sample.jsonl
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from collections import Counter
from typing import Any, Literal, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from pydantic import Field, ValidationError

from raytrain import storage
from raytrain.config import _format_error, _Section, apply_overrides, check_key, load_yaml, parse_overrides
from raytrain.data import manifest as mf
from raytrain.data.inputs import iter_documents
from raytrain.data.webdataset_io import tar_bytes
from raytrain.data.quality import clean_documents
from raytrain.data.report import review_sample, write_report
from raytrain.errors import UserError

EOT = "<|endoftext|>"
WRITTEN = "_written"  # per-shard write records, for restartable writing
SHARD_LAYOUT = 1  # bump when the bytes written for the same rows change, so re-runs rewrite old shards


class PrepareConfig(_Section):
    inputs: list[str] = Field(default_factory=lambda: ["python-docs"], min_length=1,
                              description="local or s3:// files, globs or directories of .txt / .jsonl / .parquet, or the built-in corpus 'python-docs'")
    out: str = Field("data/python-docs", description="output dataset URI (local path or s3://)")
    formats: list[Literal["parquet", "webdataset"]] = Field(default_factory=lambda: ["parquet"], min_length=1,
                                                           description="shard formats to write (both allowed; same samples, same order)")
    tokenizer: Optional[str] = Field(None, description="existing tokenizer.json, or a local Hugging Face tokenizer directory, to use instead of training one")
    vocab_size: int = Field(2048, ge=260)
    special_tokens: list[str] = Field(default_factory=list, description="extra special tokens for a trained tokenizer (eot_token is always one)")
    eot_token: str = Field(EOT, description="end-of-text token placed between packed documents")
    tokenizer_sample_docs: int = Field(0, ge=0, description="train the tokenizer on this many train documents drawn with the seed; 0: all")
    seq_len: int = Field(128, ge=2)
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    shard_rows: int = Field(1024, ge=1)
    text_mode: Literal["file", "line"] = Field("file", description="plain-text inputs: one document per file, or per non-blank line")
    invalid_utf8: Literal["replace", "drop"] = Field("replace", description="documents with invalid UTF-8: replace the bad bytes (U+FFFD) or drop the document (counted)")
    engine: Literal["auto", "local", "ray"] = Field("auto", description="read inputs as a Ray Data pipeline (ray), in this process (local), or ray when connected to a cluster (auto)")
    min_chars: int = Field(1, ge=0, description="documents shorter than this (after normalising) are dropped (counted)")
    max_doc_chars: int = Field(0, ge=0, description="documents longer than this are dropped (counted); 0: no limit")
    near_dup_threshold: float = Field(0.9, gt=0.0, le=1.0, description="MinHash Jaccard above which a document is a near duplicate; 1.0 disables")
    pii_scrub: bool = Field(False, description="replace e-mail addresses, phone numbers and IPv4 addresses (counted)")
    review_samples: int = Field(20, ge=0, description="documents written to review_sample.jsonl for a person to read")
    text_field: str = Field("text", description="JSONL field / Parquet column holding the text")
    max_chars: int = Field(3_000_000, ge=1, description="cap on the built-in corpus size")
    seed: int = Field(0, ge=0, lt=2**32)


def load_prepare_config(path: Optional[str], overrides: list[str]) -> PrepareConfig:
    tree: dict[str, Any] = {}
    if path:
        try:
            tree = load_yaml(open(path).read()) or {}
        except OSError as e:
            raise UserError(f"cannot read {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise UserError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(tree, dict):
            raise UserError(f"{path}: top level must be a mapping of prepare keys (inputs:, out:, ...)")
    ov = parse_overrides(overrides)
    for key in ov:
        check_key(key, PrepareConfig)
    tree = apply_overrides(tree, ov)
    try:
        return PrepareConfig.model_validate(tree)
    except ValidationError as e:
        raise UserError(_format_error(e).replace("config key", "prepare key")) from None


def train_tokenizer(docs: list[str], vocab_size: int, special_tokens: list[str] = (EOT,)):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(dict.fromkeys(special_tokens)),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def load_tokenizer(uri: str):
    """A tokenizer.json (local or s3://) or a local Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer

    uri = storage.absolute(uri)
    if not storage.is_remote(uri) and os.path.isdir(uri):
        if os.path.exists(os.path.join(uri, "tokenizer.json")):
            uri = os.path.join(uri, "tokenizer.json")
        else:
            from transformers import AutoTokenizer

            try:
                hf = AutoTokenizer.from_pretrained(uri, local_files_only=True)
            except Exception as e:  # noqa: BLE001 - transformers raises many kinds
                raise UserError(f"tokenizer {uri}: not a Hugging Face tokenizer directory ({str(e).splitlines()[0]})") from None
            if not getattr(hf, "is_fast", False):
                raise UserError(f"tokenizer {uri}: only fast (tokenizers-backed) tokenizers are supported")
            return hf.backend_tokenizer
    try:
        return Tokenizer.from_str(storage.read_text(uri))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed file
        raise UserError(f"tokenizer {uri}: not a tokenizer.json ({str(e).splitlines()[0]})") from None


def pack(token_lists: list[list[int]], eot_id: int, window: int) -> np.ndarray:
    """Join documents with EOT and cut into windows of seq_len+1 (input + shifted target). Tail dropped."""
    flat = np.fromiter(
        (t for ids in token_lists for t in (*ids, eot_id)), dtype=np.int32,
        count=sum(len(ids) + 1 for ids in token_lists),
    )
    n = len(flat) // window
    return flat[: n * window].reshape(n, window)


def _encode(fmt: str, chunk: np.ndarray, start: int, window: int) -> bytes:
    if fmt == "webdataset":
        return tar_bytes(chunk, start)
    table = pa.table({
        "sample_id": pa.array(np.arange(start, start + len(chunk), dtype=np.int64)),
        "tokens": pa.FixedSizeListArray.from_arrays(pa.array(chunk.reshape(-1)), window),
    })
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def _already_written(split_uri: str, name: str, content: str) -> Optional[dict]:
    """The manifest entry of a shard file an earlier run wrote from the same rows, if its bytes still check out."""
    rec_uri = storage.join(split_uri, WRITTEN, name + ".json")
    try:
        rec = json.loads(storage.read_text(rec_uri))
        if rec.get("content") != content:
            return None
        data = storage.read_bytes(storage.join(split_uri, name))
    except (UserError, ValueError):
        return None
    return rec["entry"] if hashlib.sha256(data).hexdigest() == rec["entry"]["sha256"] else None


def write_split(rows: np.ndarray, split_uri: str, cfg: PrepareConfig, extra: dict, log=print) -> dict:
    window = rows.shape[1] if rows.size else cfg.seq_len + 1
    shards: dict[str, list] = {fmt: [] for fmt in dict.fromkeys(cfg.formats)}
    reused = written = 0
    for i, start in enumerate(range(0, len(rows), cfg.shard_rows)):
        chunk = np.ascontiguousarray(rows[start:start + cfg.shard_rows], dtype=np.int32)
        # What the shard file holds: its rows, where they start, and how they are encoded.
        rows_digest = hashlib.sha256(chunk.tobytes()).hexdigest()
        for fmt in shards:
            name = f"shard-{i:05d}{mf.SUFFIX[fmt]}"
            content = f"{fmt}:{SHARD_LAYOUT}:{start}:{window}:{rows_digest}"
            entry = _already_written(split_uri, name, content)
            if entry is not None:
                reused += 1
            else:
                data = _encode(fmt, chunk, start, window)
                uri = storage.join(split_uri, name)
                storage.write_bytes(uri, data)
                entry = {"path": name, "uri": uri, "rows": len(chunk), "tokens": int(chunk.size),
                         "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                # The record follows the shard: a kill between the two only costs rewriting that shard.
                storage.write_text(storage.join(split_uri, WRITTEN, name + ".json"),
                                   json.dumps({"content": content, "entry": entry}))
                written += 1
            shards[fmt].append(entry)
    if reused:
        log(f"prepare: {split_uri}: {reused} shard file(s) already written and verified, {written} written")
    manifest = {
        "format": next(iter(shards)),
        "formats": list(shards),
        "seq_len": cfg.seq_len,
        "num_samples": int(len(rows)),
        "num_tokens": int(rows.size),
        "shards": shards,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
        "prepare": cfg.model_dump(mode="json"),
    }
    # Manifest last: its presence is what makes the split complete.
    storage.write_text(storage.join(split_uri, mf.MANIFEST), json.dumps(manifest, indent=1))
    return manifest


def prepare(cfg: PrepareConfig, log=print) -> dict:
    out = storage.absolute(cfg.out)
    # Re-running over an earlier output: its manifests go first, so a crash midway can never leave an
    # old manifest vouching for new shards.
    for split in ("train", "val"):
        storage.delete_file(storage.join(out, split, mf.MANIFEST))
    read_counts: Counter = Counter()
    raw = iter_documents(cfg.inputs, read_counts, cfg.text_field, cfg.text_mode, cfg.invalid_utf8, cfg.max_chars,
                         cfg.engine, log)
    docs, clean_counts = clean_documents(raw, cfg.min_chars, cfg.max_doc_chars, cfg.near_dup_threshold,
                                         cfg.pii_scrub, cfg.seed)
    counts: Counter = Counter({"input": clean_counts.pop("input", 0) + read_counts["dropped_invalid_utf8"]})
    counts.update({k: v for k, v in read_counts.items() if v})
    counts.update(clean_counts)
    log("prepare: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    if not docs:
        raise UserError(f"no usable documents in inputs {cfg.inputs} (all empty or shorter than min_chars={cfg.min_chars})")

    # Split by document, deterministically from the seed, so no document is in both splits.
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(docs))
    n_val = int(round(len(docs) * cfg.val_fraction))
    if cfg.val_fraction > 0 and len(docs) >= 2:
        n_val = max(1, n_val)
    val_idx, train_idx = set(order[:n_val].tolist()), order[n_val:]
    train_docs = [docs[i] for i in sorted(train_idx.tolist())]
    val_docs = [docs[i] for i in sorted(val_idx)]

    if cfg.tokenizer:
        tok = load_tokenizer(cfg.tokenizer)
    else:
        sample = train_docs
        if cfg.tokenizer_sample_docs and cfg.tokenizer_sample_docs < len(train_docs):
            pick = np.random.default_rng([cfg.seed, 7]).choice(len(train_docs), cfg.tokenizer_sample_docs, replace=False)
            sample = [train_docs[i] for i in sorted(pick.tolist())]
        tok = train_tokenizer(sample, cfg.vocab_size, [cfg.eot_token, *cfg.special_tokens])
    eot_id = tok.token_to_id(cfg.eot_token)
    if eot_id is None:
        raise UserError(f"tokenizer has no {cfg.eot_token} token; set eot_token= to its end-of-text token")
    storage.write_text(storage.join(out, "tokenizer.json"), tok.to_str())
    storage.write_text(storage.join(out, "prepare.yaml"), yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))

    window = cfg.seq_len + 1
    extra = {"vocab_size": tok.get_vocab_size(), "eot_id": eot_id, "tokenizer": "../tokenizer.json"}
    report: dict[str, Any] = {"out": out, "documents": counts["input"], "kept": len(docs),
                              "vocab_size": tok.get_vocab_size()}
    doc_lengths: dict[str, list[int]] = {}
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        ids = [e.ids for e in tok.encode_batch(split_docs)] if split_docs else []
        doc_lengths[split] = [len(x) for x in ids]
        rows = pack(ids, eot_id, window) if ids else np.zeros((0, window), np.int32)
        if split == "train" and len(rows) == 0:
            raise UserError(f"train split has fewer than seq_len+1={window} tokens; use more text or a smaller seq_len")
        m = write_split(rows, storage.join(out, split), cfg, {**extra, "documents": len(split_docs)}, log)
        n_shards = len(m["shards"][m["format"]])
        report[split] = {"documents": len(split_docs), "samples": m["num_samples"], "tokens": m["num_tokens"],
                         "shards": n_shards}
        log(f"prepare: {split}: {len(split_docs)} documents -> {m['num_samples']} sequences of {window} tokens "
            f"in {n_shards} shard(s) per format ({', '.join(m['formats'])}) at {storage.join(out, split)}")
    data_report = write_report(out, counts, doc_lengths, report,
                               review_sample(train_docs, cfg.review_samples, cfg.seed), cfg.seed)
    report["filters"] = dict(counts)
    report["ks_train_val_doc_tokens"] = data_report["ks_train_val_doc_tokens"]
    return report
