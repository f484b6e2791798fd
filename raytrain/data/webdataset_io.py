"""WebDataset tar shards of packed token windows: writing them (stock `webdataset.TarWriter`) and streaming them back.

One sample per packed window: key = the sample id (its row number in the split, as in the Parquet
shards), one member `<key>.tokens.npy` (int32, seq_len+1). The stock `webdataset` library and
`ray.data.read_webdataset` decode `.npy` members out of the box.
"""

from __future__ import annotations

import io
import tarfile
from typing import Iterator, Optional

import numpy as np

MEMBER = "tokens.npy"


def tar_bytes(rows: np.ndarray, first_id: int, extra: Optional[dict] = None) -> bytes:
    """A shard as bytes. Fixed mtime/owner: the same rows always give the same bytes (restartable writes). `extra`:
    more arrays with one row per sample ({name: [n, width]}), each a member `<key>.<name>.npy` (fine-tuning rows:
    loss_mask int8, segment_ids int32)."""
    import webdataset as wds

    buf = io.BytesIO()
    # mtime must be an int: a float one makes tarfile add a PAX header to every member (3x the size).
    with wds.TarWriter(buf, mtime=0, user="raytrain", group="raytrain") as w:
        for i, row in enumerate(rows):
            sample = {"__key__": f"{first_id + i:012d}", MEMBER: np.ascontiguousarray(row, dtype=np.int32)}
            for name, arr in (extra or {}).items():
                sample[f"{name}.npy"] = np.ascontiguousarray(arr[i], dtype=np.int8 if name == "loss_mask" else np.int32)
            w.write(sample)
    return buf.getvalue()


def iter_tar_rows(stream, window: int, batch: int = 1024, members: tuple[str, ...] = ("tokens",)) -> Iterator[np.ndarray]:
    """Rows from an open binary stream, read sequentially (tar stream mode: nothing is downloaded whole). Several
    `members` (fine-tuning rows: tokens, loss_mask, segment_ids): each row is theirs side by side [len * window]."""
    out: list[np.ndarray] = []
    names = tuple(f".{m}.npy" for m in members)
    got: dict[str, np.ndarray] = {}
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for info in tar:
            which = next((n for n in names if info.name.endswith(n)), None) if info.isreg() else None
            if which is None:
                continue
            row = np.load(io.BytesIO(tar.extractfile(info).read()), allow_pickle=False)
            if row.shape != (window,):
                raise ValueError(f"member {info.name} holds shape {row.shape}, expected ({window},)")
            got[which] = row
            if len(got) < len(names):
                continue
            row = got[names[0]] if len(names) == 1 else np.concatenate([got[n].astype(np.int32) for n in names])
            got = {}
            out.append(row)
            if len(out) == batch:
                yield np.stack(out).astype(np.int64, copy=False)
                out = []
    if out:
        yield np.stack(out).astype(np.int64, copy=False)
