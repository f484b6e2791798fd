"""Where `raytrain prepare` reads documents from: local or s3:// files and globs of plain text (one document per
file or per line), JSONL (a text field) and Parquet (a text column), listed in a fixed order; one file's documents
with invalid UTF-8 replaced or dropped; whether prepare runs on Ray; our one-line errors out of Ray tasks.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import io
import json
import logging
import os
from pathlib import Path
from typing import Optional

from raytrain import storage
from raytrain.errors import UserError

_GLOB = set("*?[")
READ_RANGE_BYTES = 32 << 20  # larger splittable files are read in pieces of this size by separate tasks


def kind(uri: str) -> str:
    name = uri.rsplit("/", 1)[-1].lower()
    return "jsonl" if name.endswith((".jsonl", ".ndjson")) else "parquet" if name.endswith(".parquet") else "text"


def expand(spec: str) -> list[tuple[str, int]]:
    """(file, size in bytes) for the files named by a path, directory or glob (local or s3://), sorted, so the
    order never depends on listing. Sizes come with the listing: no request per file."""
    if storage.is_remote(spec):
        fs, path = storage.resolve(spec)
        cut = min((path.index(c) for c in _GLOB if c in path), default=None)
        import pyarrow.fs as pafs

        try:
            info = fs.get_file_info(path) if cut is None else None
            if info is not None and info.type == pafs.FileType.File:
                return [(spec, info.size or 0)]
            base = path if cut is None else path[:cut].rsplit("/", 1)[0]
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        except OSError as e:
            raise UserError(f"input {spec!r}: cannot list it ({str(e).strip().splitlines()[0]})") from None
        files = sorted(("s3://" + i.path, i.size or 0) for i in infos if i.type == pafs.FileType.File
                       and (cut is None or fnmatch.fnmatchcase(i.path, path)))
    else:
        paths = []
        for p in sorted(Path(p) for p in glob.glob(str(Path(spec).expanduser()), recursive=True)):
            paths.extend(sorted(str(q.absolute()) for q in p.rglob("*") if q.is_file()) if p.is_dir()
                         else [str(p.absolute())])
        files = [(p, _size(p)) for p in paths]
    if not files:
        raise UserError(f"input {spec!r} matches no files")
    return files


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0  # unreadable files are named when they are read


def read_units(files: list[tuple[str, int]], text_mode: str) -> list[dict]:
    """The pieces of the input one task reads: {uri, start, stop}. JSONL, line-per-document text and Parquet
    files above READ_RANGE_BYTES are cut into byte ranges (a range reads the lines, or the Parquet row groups,
    that start in it), so one large file is read by many tasks, none holding more than about a range; stop -1:
    the whole file. Where a document lands downstream depends on its content only, so the cut never shows."""
    units = []
    for uri, size in files:
        k = kind(uri)
        splittable = k in ("jsonl", "parquet") or (k == "text" and text_mode == "line")
        if not splittable or size <= READ_RANGE_BYTES:
            units.append({"uri": uri, "start": 0, "stop": -1})
            continue
        units += [{"uri": uri, "start": a, "stop": min(size, a + READ_RANGE_BYTES)}
                  for a in range(0, size, READ_RANGE_BYTES)]
    return units


def _decode(data: bytes, invalid_utf8: str) -> tuple[Optional[str], str]:
    try:
        return data.decode("utf-8"), "ok"
    except UnicodeDecodeError:
        if invalid_utf8 == "drop":
            return None, "dropped"
        return data.decode("utf-8", errors="replace"), "replaced"


def read_file(uri: str, text_field: str = "text", text_mode: str = "file", invalid_utf8: str = "replace",
              start: int = 0, stop: int = -1, example: Optional[dict] = None) -> list[tuple[Optional[str], str, int]]:
    """Documents of one file, or of its byte range [start, stop) (see read_units), as (text or None if dropped,
    utf-8 status, record: the byte offset of its line, the Parquet row, 0 for a whole file). Bad files are a UserError naming them (and the line, for JSONL). `example` ({fmt, fields}):
    JSONL records are fine-tuning examples, each one document (raytrain/data/examples.py)."""
    k = kind(uri)
    if example is not None and k != "jsonl":
        raise UserError(f"input {uri}: format={example['fmt']} reads JSONL files (.jsonl) only")
    if k == "parquet":
        return _read_parquet(uri, text_field, start, stop)
    try:
        data, first = (storage.read_bytes(uri), 0) if stop < 0 else storage.read_line_range(uri, start, stop)
    except UserError as e:
        raise UserError(f"input {uri}: cannot read it ({e})") from None
    if k == "text" and text_mode == "file":
        return [(*_decode(data, invalid_utf8), 0)]

    def where(n: int) -> str:  # lines before this range are counted only when there is an error to name
        return f"{uri}:{n + (storage.count_lines(uri, first) if first else 0)}"

    out = []
    offset = first  # the record's locator: where its line starts in the file (cheap, unlike a line number)
    for lineno, raw in enumerate(io.BytesIO(data), 1):
        at, offset = offset, offset + len(raw)
        text, status = _decode(raw, invalid_utf8)
        if text is None:
            out.append((None, status, at))
            continue
        if not text.strip():  # blank lines separate documents; they are not documents
            continue
        if k == "text":
            out.append((text.rstrip("\r\n"), status, at))
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError:
            raise UserError(f"input {where(lineno)}: not valid JSON") from None
        if example is not None and isinstance(rec, dict):
            from raytrain.data.examples import record_to_doc

            out.append((record_to_doc(rec, fmt=example["fmt"], fields=example["fields"], where=where(lineno)), status, at))
            continue
        if not isinstance(rec, dict) or text_field not in rec:
            raise UserError(f"input {where(lineno)}: record has no {text_field!r} field (set text_field=...)")
        out.append((str(rec[text_field]), status, at))
    return out


def _read_parquet(uri: str, text_field: str, start: int, stop: int) -> list[tuple[Optional[str], str, int]]:
    import pyarrow.parquet as pq

    fs, path = storage.resolve(uri)
    try:
        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            if text_field not in pf.schema_arrow.names:
                raise UserError(f"input {uri}: Parquet file has no column {text_field!r} (columns: "
                                f"{', '.join(pf.schema_arrow.names)}); set text_field=...")
            groups = range(pf.num_row_groups)
            if stop >= 0:  # the row groups whose first page lies in the range: each in exactly one range
                groups = [g for g in groups if start <= _row_group_offset(pf.metadata.row_group(g)) < stop]
            first_row = [0]
            for g in range(pf.num_row_groups):
                first_row.append(first_row[-1] + pf.metadata.row_group(g).num_rows)
            rows = [r for g in groups for r in range(first_row[g], first_row[g + 1])]
            col = pf.read_row_groups(list(groups), columns=[text_field])[text_field]
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - any pyarrow failure means the file is unreadable
        raise UserError(f"input {uri}: not a readable Parquet file ({str(e).strip().splitlines()[0]})") from None
    return [("" if v is None else str(v), "ok", r) for v, r in zip(col.to_pylist(), rows)]


def _row_group_offset(rg) -> int:
    c = rg.column(0)
    return c.dictionary_page_offset if c.has_dictionary_page and c.dictionary_page_offset else c.data_page_offset


@contextlib.contextmanager
def user_errors_from_ray():
    """Our one-line errors raised inside Ray tasks reach the user as that one line, not Ray's wrapped traceback."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - unwrap our one-line errors from Ray tasks
        msg = _user_error_in(e)
        if msg:
            raise UserError(msg) from None
        raise


def _user_error_in(err: BaseException) -> Optional[str]:
    """A UserError raised inside a Ray task arrives wrapped; find its one line."""
    marker = "UserError: "
    while err is not None:
        if isinstance(err, UserError) and marker not in str(err):
            return str(err)
        if marker in str(err):
            return str(err).split(marker, 1)[1].strip().splitlines()[0]
        err = err.__cause__ or err.__context__
    return None


def use_ray(engine: str, local_init: Optional[dict] = None, before_local_start=None) -> bool:
    """Whether to run on Ray, connecting first if needed (raytrain.ray_connect). For a fresh local instance:
    before_local_start() is called first (it may refuse with a UserError), then ray.init gets local_init's
    arguments."""
    if engine == "local":
        return False  # without importing ray (a second of start-up)
    from raytrain import ray_connect

    if ray_connect.already_connected():
        return True
    address = ray_connect.resolve()
    if engine == "auto" and (address is None or ray_connect.is_jobs_api(address)):
        # auto runs on Ray only where a cluster is named; the Jobs API address (what `ray job submit` uses,
        # and `local_cluster.sh env` exports) names none a driver can join, so auto reads here, in this process.
        return False
    ray_connect.check_address("prepare", prefix=f"engine={engine}, but ")
    ray_connect.connect("prepare", local_options=local_init, before_local_start=before_local_start,
                        worker_logs=False, logging_level=logging.ERROR)
    return True
