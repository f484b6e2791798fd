"""WebDataset tar shards of packed token windows: writing them (stock `webdataset.TarWriter`) and streaming them back.

One sample per packed window: key = the sample id (its row number in the split, as in the Parquet
shards), one member `<key>.tokens.npy` (int32, seq_len+1). The stock `webdataset` library and
`ray.data.read_webdataset` decode `.npy` members out of the box.
"""

from __future__ import annotations

import io
import tarfile
from typing import Iterator

import numpy as np

MEMBER = "tokens.npy"


def tar_bytes(rows: np.ndarray, first_id: int) -> bytes:
    """A shard as bytes. Fixed mtime/owner: the same rows always give the same bytes (restartable writes)."""
    import webdataset as wds

    buf = io.BytesIO()
    # mtime must be an int: a float one makes tarfile add a PAX header to every member (3x the size).
    with wds.TarWriter(buf, mtime=0, user="raytrain", group="raytrain") as w:
        for i, row in enumerate(rows):
            w.write({"__key__": f"{first_id + i:012d}", MEMBER: np.ascontiguousarray(row, dtype=np.int32)})
    return buf.getvalue()


def iter_tar_rows(stream, window: int, batch: int = 1024) -> Iterator[np.ndarray]:
    """Rows from an open binary stream, read sequentially (tar stream mode: nothing is downloaded whole)."""
    out: list[np.ndarray] = []
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for info in tar:
            if not info.isreg() or not info.name.endswith("." + MEMBER):
                continue
            row = np.load(io.BytesIO(tar.extractfile(info).read()), allow_pickle=False)
            if row.shape != (window,):
                raise ValueError(f"member {info.name} holds shape {row.shape}, expected ({window},)")
            out.append(row)
            if len(out) == batch:
                yield np.stack(out).astype(np.int64, copy=False)
                out = []
    if out:
        yield np.stack(out).astype(np.int64, copy=False)
