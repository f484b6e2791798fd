"""`raytrain prepare`: documents -> byte-level BPE tokenizer -> packed sequences -> Parquet shards + manifest.

Layout written under `out`:
    tokenizer.json
    prepare.yaml                the resolved settings
    train/shard-00000.parquet   columns: sample_id int64, tokens fixed_size_list<int32>[seq_len+1]
    train/manifest.json         written last: a split without it is incomplete and is refused
    val/...
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from pydantic import Field, ValidationError

from raytrain import storage
from raytrain.config import _format_error, _Section, apply_overrides, check_key, load_yaml, parse_overrides
from raytrain.data import manifest as mf
from raytrain.data.corpus import iter_documents
from raytrain.data.quality import clean_documents
from raytrain.data.report import review_sample, write_report
from raytrain.errors import UserError

EOT = "<|endoftext|>"


class PrepareConfig(_Section):
    inputs: list[str] = Field(default_factory=lambda: ["python-docs"], min_length=1,
                              description="files, globs, directories or the built-in corpus 'python-docs'")
    out: str = Field("data/python-docs", description="output dataset URI (local path or s3://)")
    tokenizer: Optional[str] = Field(None, description="existing tokenizer.json to use instead of training one")
    vocab_size: int = Field(2048, ge=260)
    seq_len: int = Field(128, ge=2)
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    shard_rows: int = Field(1024, ge=1)
    min_chars: int = Field(1, ge=0, description="documents shorter than this (after normalising) are dropped (counted)")
    max_doc_chars: int = Field(0, ge=0, description="documents longer than this are dropped (counted); 0: no limit")
    near_dup_threshold: float = Field(0.9, gt=0.0, le=1.0, description="MinHash Jaccard above which a document is a near duplicate; 1.0 disables")
    pii_scrub: bool = Field(False, description="replace e-mail addresses, phone numbers and IPv4 addresses (counted)")
    review_samples: int = Field(20, ge=0, description="documents written to review_sample.jsonl for a person to read")
    text_field: str = "text"
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


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def pack(token_lists: list[list[int]], eot_id: int, window: int) -> np.ndarray:
    """Join documents with EOT and cut into windows of seq_len+1 (input + shifted target). Tail dropped."""
    flat = np.fromiter(
        (t for ids in token_lists for t in (*ids, eot_id)), dtype=np.int32,
        count=sum(len(ids) + 1 for ids in token_lists),
    )
    n = len(flat) // window
    return flat[: n * window].reshape(n, window)


def write_split(rows: np.ndarray, split_uri: str, cfg: PrepareConfig, extra: dict) -> dict:
    shards = []
    window = rows.shape[1] if rows.size else cfg.seq_len + 1
    for i, start in enumerate(range(0, len(rows), cfg.shard_rows)):
        chunk = rows[start:start + cfg.shard_rows]
        table = pa.table({
            "sample_id": pa.array(np.arange(start, start + len(chunk), dtype=np.int64)),
            "tokens": pa.FixedSizeListArray.from_arrays(pa.array(chunk.reshape(-1)), window),
        })
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        data = buf.getvalue()
        name = f"shard-{i:05d}.parquet"
        storage.write_bytes(storage.join(split_uri, name), data)
        shards.append({"path": name, "rows": len(chunk), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {
        "format": "parquet",
        "seq_len": cfg.seq_len,
        "num_samples": int(len(rows)),
        "num_tokens": int(rows.size),
        "shards": shards,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }
    # Manifest last: its presence is what makes the split complete.
    storage.write_text(storage.join(split_uri, mf.MANIFEST), json.dumps(manifest, indent=1))
    return manifest


def prepare(cfg: PrepareConfig, log=print) -> dict:
    out = storage.absolute(cfg.out)
    # Re-running over an earlier output: its manifests go first, so a crash midway can never leave an
    # old manifest vouching for new shards.
    for split in ("train", "val"):
        fs, path = storage.resolve(storage.join(out, split, mf.MANIFEST))
        try:
            fs.delete_file(path)
        except (FileNotFoundError, OSError):
            pass
    docs, counts = clean_documents(iter_documents(cfg.inputs, cfg.text_field, cfg.max_chars), cfg.min_chars,
                                   cfg.max_doc_chars, cfg.near_dup_threshold, cfg.pii_scrub, cfg.seed)
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
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(storage.read_text(storage.absolute(cfg.tokenizer)))
    else:
        tok = train_tokenizer(train_docs, cfg.vocab_size)
    eot_id = tok.token_to_id(EOT)
    if eot_id is None:
        raise UserError(f"tokenizer has no {EOT} token; add it as a special token")
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
        m = write_split(rows, storage.join(out, split), cfg, {**extra, "documents": len(split_docs)})
        report[split] = {"documents": len(split_docs), "samples": m["num_samples"], "tokens": m["num_tokens"],
                         "shards": len(m["shards"])}
        log(f"prepare: {split}: {len(split_docs)} documents -> {m['num_samples']} sequences of {window} tokens "
            f"in {len(m['shards'])} shard(s) at {storage.join(out, split)}")
    data_report = write_report(out, counts, doc_lengths, report,
                               review_sample(train_docs, cfg.review_samples, cfg.seed), cfg.seed)
    report["filters"] = dict(counts)
    report["ks_train_val_doc_tokens"] = data_report["ks_train_val_doc_tokens"]
    return report
