"""Writing one shard of packed rows as Parquet and / or WebDataset files, restartably: a record of what each file
holds (and its sha256) is written after it, and a re-run skips files whose record and bytes still check out."""

from __future__ import annotations

import hashlib
import io
import json
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain import storage
from raytrain.data import manifest as mf
from raytrain.data.webdataset_io import tar_bytes
from raytrain.errors import UserError

WRITTEN = "_written"  # per-shard write records, for restartable writing
SHARD_LAYOUT = 1  # bump when the bytes written for the same rows change, so re-runs rewrite old shards


def encode(fmt: str, chunk: np.ndarray, start: int, window: int, columns: int = 1) -> bytes:
    """A shard's bytes. columns 3: fine-tuning rows, chunk [n, 3 * window] = tokens | loss_mask | segment_ids, one
    column (Parquet) or one member (WebDataset) each."""
    from raytrain.data.examples import COLUMNS

    parts = {name: chunk[:, i * window:(i + 1) * window] for i, name in enumerate(COLUMNS[:columns])}
    if fmt == "webdataset":
        return tar_bytes(parts["tokens"], start, extra={k: v for k, v in parts.items() if k != "tokens"})
    types = {"tokens": pa.int32(), "loss_mask": pa.int8(), "segment_ids": pa.int32()}
    table = pa.table({
        "sample_id": pa.array(np.arange(start, start + len(chunk), dtype=np.int64)),
        **{k: pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(v).reshape(-1)).cast(types[k]), window)
           for k, v in parts.items()},
    })
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def already_written(split_uri: str, name: str, content: str) -> Optional[dict]:
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


def write_shard(split_uri: str, index: int, start: int, chunk: np.ndarray, formats: list[str],
                columns: int = 1) -> tuple[dict, int]:
    """({format: manifest entry}, how many files were reused) for shard `index` holding rows start.. of the split."""
    chunk = np.ascontiguousarray(chunk, dtype=np.int32)
    window = chunk.shape[1] // columns
    # What the shard file holds: its rows, where they start, and how they are encoded.
    rows_digest = hashlib.sha256(chunk.tobytes()).hexdigest()
    entries, reused = {}, 0
    for fmt in dict.fromkeys(formats):
        name = f"shard-{index:05d}{mf.SUFFIX[fmt]}"
        content = f"{fmt}:{SHARD_LAYOUT}:{start}:{window}:{rows_digest}" + (f":{columns}" if columns > 1 else "")
        entry = already_written(split_uri, name, content)
        if entry is not None:
            reused += 1
        else:
            data = encode(fmt, chunk, start, window, columns)
            uri = storage.join(split_uri, name)
            storage.write_bytes(uri, data)
            entry = {"path": name, "uri": uri, "rows": len(chunk), "tokens": len(chunk) * window,
                     "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            # The record follows the shard: a kill between the two only costs rewriting that shard.
            storage.write_text(storage.join(split_uri, WRITTEN, name + ".json"),
                               json.dumps({"content": content, "entry": entry}))
        entries[fmt] = entry
    return entries, reused
