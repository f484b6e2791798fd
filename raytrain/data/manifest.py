"""Reading and checking a prepared split's manifest.json before any training step uses it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Optional

import pyarrow.fs as pafs

from raytrain import storage
from raytrain.errors import UserError

MANIFEST = "manifest.json"
FORMATS = ("parquet", "webdataset")
SUFFIX = {"parquet": ".parquet", "webdataset": ".tar"}


def shards_by_format(m: dict) -> dict[str, list]:
    """{format: [shard records]}; manifests before WebDataset support held one list of Parquet shards."""
    shards = m["shards"]
    return {m.get("format", "parquet"): shards} if isinstance(shards, list) else dict(shards)


@dataclass(frozen=True)
class Split:
    """A prepared split: shard URIs in their canonical order with row counts."""

    uri: str
    shard_uris: tuple[str, ...]
    shard_rows: tuple[int, ...]
    seq_len: int
    vocab_size: int
    eot_id: int
    tokenizer_uri: str
    format: str = "parquet"
    # ("tokens",) for text; fine-tuning examples add ("loss_mask", "segment_ids") (raytrain/data/examples.py)
    columns: tuple[str, ...] = ("tokens",)

    @property
    def num_samples(self) -> int:
        return sum(self.shard_rows)

    @property
    def row_width(self) -> int:
        """Values per row as the reader returns it: the columns' seq_len + 1 values each, side by side."""
        return (self.seq_len + 1) * len(self.columns)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    @staticmethod
    def from_dict(d: dict) -> "Split":
        return Split(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})


def load_split(uri: str, what: str = "data", checksums: bool = False, fmt: Optional[str] = None) -> Split:
    """Read and check a split's `fmt` shards (None: the first format it was prepared with). Missing / incomplete / empty splits, missing shards, size (or,
    with checksums, sha256) mismatches are a one-line UserError naming the shard."""
    uri = storage.absolute(uri)
    murl = storage.join(uri, MANIFEST)
    if not storage.exists(uri):
        raise UserError(f"{what}: dataset not found at {uri} (run `raytrain prepare` first, or fix the path)")
    if not storage.exists(murl):
        raise UserError(f"{what}: {uri} has no {MANIFEST}; it is not a prepared split or its preparation did not finish")
    try:
        m = json.loads(storage.read_text(murl))
        by_format = shards_by_format(m)
        fmt = fmt or m.get("format") or next(iter(by_format))
        if fmt not in by_format:
            raise UserError(f"{what}: {uri} was not prepared as {fmt} (it has {', '.join(by_format)}); set "
                            f"data.format to one of those or prepare with formats=[{fmt}]")
        shards = by_format[fmt]
        seq_len, vocab, eot = int(m["seq_len"]), int(m["vocab_size"]), int(m["eot_id"])
        columns = tuple(str(c) for c in m.get("columns", ["tokens"]))
        shards = [{"path": str(s["path"]), "rows": int(s["rows"]), "bytes": int(s["bytes"]),
                   "sha256": s.get("sha256")} for s in shards]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{what}: {murl} is not a valid manifest (bad or missing {e})") from None
    if not shards or sum(s["rows"] for s in shards) == 0:
        raise UserError(f"{what}: dataset at {uri} is empty (0 sequences); prepare it from more text")
    fs, base = storage.resolve(uri)
    infos = {i.base_name: i for i in fs.get_file_info(pafs.FileSelector(base, recursive=False))}
    for s in shards:
        info = infos.get(s["path"])
        if info is None:
            raise UserError(f"{what}: shard {storage.join(uri, s['path'])} listed in the manifest is missing")
        if info.size != s["bytes"]:
            raise UserError(f"{what}: shard {storage.join(uri, s['path'])} has {info.size} bytes, manifest says {s['bytes']}")
        if checksums and s["sha256"]:
            digest = hashlib.sha256(storage.read_bytes(storage.join(uri, s["path"]))).hexdigest()
            if digest != s["sha256"]:
                raise UserError(f"{what}: shard {storage.join(uri, s['path'])} is corrupt (sha256 differs from the "
                                f"manifest); prepare the dataset again or restore the shard")
    tok = m.get("tokenizer", "../tokenizer.json")
    tok_uri = storage.join(uri.rsplit("/", 1)[0], tok.removeprefix("../")) if tok.startswith("../") else storage.join(uri, tok)
    return Split(
        uri=uri,
        shard_uris=tuple(storage.join(uri, s["path"]) for s in shards),
        shard_rows=tuple(int(s["rows"]) for s in shards),
        seq_len=seq_len,
        vocab_size=vocab,
        eot_id=eot,
        tokenizer_uri=tok_uri,
        format=fmt,
        columns=columns,
    )
