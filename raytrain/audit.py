"""Append-only audit records that their writers cannot erase: each process writes its own JSONL segments, each once
and whole with a conditional write (never over an existing object), each naming the sha256 of the one before, its
first and last anchored; readers merge them and `verify` says whether they are complete and unedited.

On S3 the records live under the bucket's `audit/` prefix (`sealed`), where the roles that write them may create
objects only (cluster/iam/: no delete, no overwrite); with S3 Object Lock in compliance mode the original version of
every object survives any delete, and `verify` reads the versions (docs/SERVING.md: audit records).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from raytrain import storage
from raytrain.errors import UserError, first_line
from raytrain.rundir import AUDIT, CONFIG, RunDir, parse_jsonl

# A segment is written every SEGMENT_RECORDS records or SEGMENT_SECONDS, whichever comes first: a busy server
# writes one object per few hundred requests, a quiet one its records within seconds.
SEGMENT_RECORDS = 512
SEGMENT_SECONDS = 5.0
# Records held in memory while storage refuses writes; past this the oldest go, and a record counts them.
MAX_BUFFERED = 200_000
SUFFIX = ".jsonl"
WARN_EVERY_S = 60.0
HEADER = "audit_segment"  # the kind of a segment's first line: writer, seq, prev_sha256, records (not a record)
ANCHORS = "_anchors"  # <root>/_anchors/<writer>/first.json and last-<seq>.json: a writer's ends, each written once
PREFIX = "audit"  # on S3 every audit root lives under the bucket's audit/ prefix (`sealed`)


def writer_id() -> str:
    """host-pid-random: unique per process (and per writer), so no two writers ever name the same object."""
    host = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:48] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def segment_name(seq: int) -> str:
    return f"{seq:08d}{SUFFIX}"


def anchor_name(writer: str, which: str, seq: int) -> str:
    """A writer's anchor, relative to the audit root: `first` (its segment 0) or `last` (its newest at close)."""
    return f"{ANCHORS}/{writer}/first.json" if which == "first" else f"{ANCHORS}/{writer}/last-{seq:08d}.json"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def text_fields(name: str, text: Optional[str], keep_text: bool = False) -> dict:
    """{name_sha256, name_chars} of a text (and the text itself only when asked); {} when there is none."""
    if text is None:
        return {}
    out = {f"{name}_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), f"{name}_chars": len(text)}
    if keep_text:
        out[name] = text
    return out


class AuditWriter:
    """One process's records under `<root>/<writer id>/<seq:08d>.jsonl`: `record` only appends to memory (no
    storage call on the caller's path); a background thread writes the buffer as the next segment when
    `every` records are waiting, every `seconds`, or at once for a record marked `flush_now`; `close` (also at
    exit) writes the rest and anchors the last segment.

    Each segment starts with a header line {"kind": "audit_segment", writer, seq, prev_sha256 (the sha256 of
    segment seq-1, null for 0), records}; segment 0 is anchored by `_anchors/<writer>/first.json` and the last, at
    close, by `_anchors/<writer>/last-<seq>.json` (its sha256). Every object is created with a conditional write
    (`storage.write_once`): never over an existing one. A segment storage refused is retried under the same name
    with the same bytes, and a retry answered "already there" (S3: 412) counts as written: an earlier try landed."""

    def __init__(self, root: str, *, every: int = SEGMENT_RECORDS, seconds: float = SEGMENT_SECONDS):
        self.root = storage.absolute(root)
        self.every, self.seconds = max(1, int(every)), float(seconds)
        self._reset()
        atexit.register(self.close)

    def _reset(self) -> None:
        # Also after a fork: the child must not share the parent's writer id (it would name the same objects).
        self.id = writer_id()
        self._pid = os.getpid()
        self._lock = threading.Lock()  # the buffer: record() is called from any thread
        self._writing = threading.Lock()  # one segment write at a time, so segment numbers follow record order
        self._wake = threading.Event()
        self._buf: list[dict] = []
        self._pending: Optional[tuple[int, bytes]] = None  # a segment storage refused: retried as it is
        self._anchors: list[tuple[str, bytes]] = []  # anchors storage refused: retried as they are
        self._prev: Optional[str] = None  # the sha256 of the newest segment written
        self._seq, self._dropped, self._warned, self._last_anchored = 0, 0, 0.0, -1
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    @property
    def uri(self) -> str:
        """This writer's folder."""
        return storage.join(self.root, self.id)

    def record(self, kind: str, *, flush_now: bool = False, **fields: Any) -> dict:
        """Append one record {"time": epoch seconds, "kind": kind, **fields} (a `time` in fields wins)."""
        if os.getpid() != self._pid:
            self._reset()
        with self._lock:
            rec = {"time": time.time(), "kind": kind, **fields}
            self._buf.append(rec)
            if len(self._buf) > MAX_BUFFERED:
                del self._buf[0]
                self._dropped += 1
            due = flush_now or len(self._buf) >= self.every
            closed = self._closed
            if self._thread is None and not closed:
                self._thread = threading.Thread(target=self._run, name=f"raytrain-audit-{self.id}", daemon=True)
                self._thread.start()
        if closed:
            self.flush()  # after close (e.g. during shutdown) nothing would write it later
        elif due:
            self._wake.set()
        return rec

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.seconds)
            self._wake.clear()
            if not self._closed:
                self.flush(last=False)

    def _take(self) -> list[dict]:
        with self._lock:
            batch, self._buf = self._buf, []
            dropped, self._dropped = self._dropped, 0
        if dropped:
            batch.insert(0, {"time": time.time(), "kind": "audit_dropped", "records": dropped,
                             "reason": f"storage refused writes while more than {MAX_BUFFERED} records waited"})
        return batch

    def _segment(self, batch: list[dict]) -> bytes:
        head = {"time": time.time(), "kind": HEADER, "writer": self.id, "seq": self._seq, "prev_sha256": self._prev,
                "records": len(batch)}
        return "".join(json.dumps(r, default=str) + "\n" for r in [head, *batch]).encode("utf-8")

    def _anchor(self, which: str, seq: int) -> None:
        """Queue the anchor of segment `seq` (just written: its sha256 is `_prev`)."""
        body = {"time": time.time(), "kind": "audit_anchor", "anchor": which, "writer": self.id, "seq": seq,
                "sha256": self._prev, "host": socket.gethostname(), "pid": os.getpid()}
        self._anchors.append((anchor_name(self.id, which, seq), (json.dumps(body) + "\n").encode("utf-8")))
        if which == "last":
            self._last_anchored = seq

    def _put(self, name: str, data: bytes) -> None:
        # False ("already there"): only this writer names its objects, so an earlier try of these bytes landed
        # (its answer was lost); anything else there would break the chain, which `verify` reports.
        storage.write_once(storage.join(self.root, name), data)

    def _flush(self, last: bool) -> None:
        """Write refused anchors and segments first, then what is buffered, and with `last` anchor the newest segment
        as the last; raises what storage raised (all of it kept, to be retried)."""
        while self._anchors:
            self._put(*self._anchors[0])
            self._anchors.pop(0)
        for _ in range(2 if self._pending is not None else 1):  # a refused segment first, then what is buffered
            if self._pending is None:
                batch = self._take()
                if not batch:
                    break
                self._pending, self._seq = (self._seq, self._segment(batch)), self._seq + 1
            seq, data = self._pending
            self._put(storage.join(self.id, segment_name(seq)), data)
            self._pending, self._prev = None, sha256(data)
            if seq == 0:
                self._anchor("first", 0)
        if last and self._pending is None and self._last_anchored < self._seq - 1:
            self._anchor("last", self._seq - 1)
        while self._anchors:
            self._put(*self._anchors[0])
            self._anchors.pop(0)

    def flush(self, *, last: Optional[bool] = None) -> bool:
        """Write what is buffered as one segment now (after close, or with `last`: and anchor it as the last). False
        (and a warning on stderr at most once a minute) when storage refused: the records stay, to be retried by the
        next flush."""
        with self._writing:
            try:
                self._flush(self._closed if last is None else last)
            except Exception as e:  # noqa: BLE001 - storage of any kind: the records are kept and retried
                self._warn(e)
                return False
            return True

    def _warn(self, err: BaseException) -> None:
        if time.time() - self._warned >= WARN_EVERY_S:
            self._warned = time.time()
            print(f"[raytrain] audit: cannot write a segment under {self.uri} ({first_line(err)}); the records are "
                  "kept and retried", file=sys.stderr, flush=True)

    def close(self, *, raise_errors: bool = False) -> bool:
        """Stop the background thread, write the rest and anchor the last segment; True when nothing is left
        unwritten. `raise_errors`: a refusal raises (UserError) instead of a warning."""
        if os.getpid() != self._pid:
            return True  # a forked child that never recorded: the parent's records are the parent's to write
        self._closed = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)
        atexit.unregister(self.close)
        if raise_errors:
            with self._writing:
                self._flush(True)
            return True
        return self.flush()


def check_writable(root: str, kind: str = "audit_check", **fields: Any) -> None:
    """Prove that audit records can be written under `root` before anything depends on it: one record, written now
    by a writer of its own (a segment, its first and last anchor); raises UserError where storage refuses. Nothing
    is deleted afterwards (the roles that write audit records may not delete)."""
    w = AuditWriter(root, every=1 << 30, seconds=3600)
    w.record(kind, **fields)
    w.close(raise_errors=True)


def segments(root: str) -> list[tuple[str, int, str]]:
    """(writer, seq, uri) of every segment under an audit root; files being written (temp names) and anchors are
    not segments."""
    out = []
    for writer in storage.list_dir(root):
        if writer == ANCHORS:
            continue
        for name in storage.list_dir(storage.join(root, writer)):
            stem = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else ""
            if stem.isdigit():
                out.append((writer, int(stem), storage.join(root, writer, name)))
    return out


def read(root: str) -> list[dict]:
    """Every record of every writer, merged by (time, writer, segment), each with its "writer" and "segment"
    (segment headers are not records). A line that does not parse (a torn segment) is skipped, never an error; a
    missing root reads as none."""
    root = storage.absolute(root)
    if not storage.exists(root):
        return []
    segs = segments(root)
    # Object stores answer one GET at a time per connection: read the segments side by side.
    with ThreadPoolExecutor(max_workers=8 if storage.is_remote(root) else 1) as pool:
        texts = list(pool.map(lambda s: storage.read_bytes(s[2]).decode("utf-8", errors="replace"), segs))
    keyed = []
    for (writer, seq, _), text in zip(segs, texts):
        for i, rec in enumerate(parse_jsonl(text)):
            if i == 0 and rec.get("kind") == HEADER:
                continue
            t = rec.get("time")
            t = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0
            keyed.append(((t, writer, seq, i), {**rec, "writer": writer, "segment": seq}))
    keyed.sort(key=lambda kv: kv[0])
    return [rec for _, rec in keyed]


def sealed(uri: str) -> str:
    """Where the audit records that belong beside `uri` live: on S3 the same key under the bucket's `audit/` prefix
    (s3://B/runs/x/audit -> s3://B/audit/runs/x/audit), a prefix the roles that write audit records may only add
    to; a local path stays where it is."""
    if not uri.startswith("s3://"):
        return uri
    bucket, _, key = storage.absolute(uri)[len("s3://"):].partition("/")
    if key == PREFIX or key.startswith(PREFIX + "/"):
        return f"s3://{bucket}/{key}"
    return f"s3://{bucket}/{PREFIX}/{key}"


def run_root(run_uri: str) -> str:
    """A run's audit root: `<run>/audit` (on S3: `s3://B/audit/<run key>/audit`, `sealed`)."""
    return sealed(legacy_run_root(run_uri))


def legacy_run_root(run_uri: str) -> str:
    """`<run>/audit`: where a run's records were on S3 too before they moved under `audit/` (read, never written)."""
    return RunDir(run_uri).uri(AUDIT)


def serve_root(model_uri: str) -> str:
    """`raytrain serve`'s default audit root: `<served model directory>.audit`, beside the model, never inside it
    (replicas download a model directory whole, and an exported model stays as exported); on S3 `sealed`."""
    return sealed(legacy_serve_root(model_uri))


def legacy_serve_root(model_uri: str) -> str:
    return model_uri.rstrip("/") + "." + AUDIT


_RUN_WRITERS: dict[str, AuditWriter] = {}
_RUN_LOCK = threading.Lock()


def run_event(run_uri: str, kind: str, **fields: Any) -> dict:
    """Record one run-level event (submit, resume, resize, rollback, export) in the run's audit root, written now as a
    segment of its own by this process's writer for the run. Never raises for storage: a refused write is
    kept, warned about and retried (background, and at exit). Returns the record."""
    root = storage.absolute(run_root(run_uri))
    with _RUN_LOCK:
        w = _RUN_WRITERS.get(root)
        if w is None:
            w = _RUN_WRITERS[root] = AuditWriter(root)
    rec = w.record(kind, **fields)
    w.flush()
    return rec


def close_run_writers() -> bool:
    """Write and anchor what run_event's writers of this process hold now (also done at exit): for a process whose
    storage goes away before it ends. True when nothing is left unwritten."""
    with _RUN_LOCK:
        writers = list(_RUN_WRITERS.values())
        _RUN_WRITERS.clear()
    return all([w.close() for w in writers])


# --- verify: are a run's (or a deployment's) records complete and unedited? --------------------------------------

_NAME = re.compile(rf"^(?:{ANCHORS}/([^/]+)/(first|last-(\d{{8}}))\.json|([^/]+)/(\d{{8}}){re.escape(SUFFIX)})$")
VERSION_NOTES = {
    "versioned": "every object version read",
    "unversioned": "the bucket keeps no object versions: a deleted segment shows only as a gap (production buckets: "
                   "S3 Object Lock in compliance mode)",
    "unlisted": "object versions not read (s3:ListBucketVersions refused to these credentials)",
    "local": "local storage: no object versions",
}


@dataclass
class Found:
    """One audit object as `verify` found it."""

    current: Optional[bytes]  # what a reader gets now; None: deleted
    original: Optional[bytes]  # its first version (where the bucket keeps versions), else what is there now
    original_version: Optional[str] = None
    versions: int = 1  # versions written (delete markers not counted)
    marker: Optional[str] = None  # the delete marker that hides it now

    @property
    def truth(self) -> Optional[bytes]:
        return self.original if self.original is not None else self.current


@dataclass
class Verdict:
    ok: bool
    problems: list[str]
    summary: str


def _load_versions(root: str, key: str, vs: list[dict]) -> Found:
    """A key's versions (newest first, then its delete markers) as what is there now and what was written first."""
    kept = [v for v in vs if not v["deleted"]]
    top = next((v for v in vs if v["latest"]), None)
    marker = top["version_id"] if top is not None and top["deleted"] else None
    if not kept:
        return Found(None, None, None, 0, marker)
    uri, first = storage.join(root, key), kept[-1]["version_id"]
    if len(kept) == 1 and marker is None:  # the usual case: one version, there now (a plain GET)
        data = storage.read_bytes(uri)
        return Found(data, data, first)
    original = storage.read_version(uri, first)  # S3 takes "null" too: a version written before versioning
    current = None if marker else storage.read_version(uri, kept[0]["version_id"])
    return Found(current, original, first, len(kept), marker)


def _listed_keys(root: str) -> list[str]:
    keys = [f"{w}/{segment_name(seq)}" for w, seq, _ in segments(root)]
    for w in storage.list_dir(storage.join(root, ANCHORS)):
        keys += [f"{ANCHORS}/{w}/{n}" for n in storage.list_dir(storage.join(root, ANCHORS, w))]
    return [k for k in keys if _NAME.match(k)]


def inventory(root: str) -> tuple[dict[str, Found], str]:
    """Every segment and anchor under an audit root ({key relative to root: Found}) and how they were read: "versioned"
    (every version listed, deleted ones too), "unversioned", "unlisted" (versions refused) or "local"."""
    mode, versions = "local", None
    if storage.is_remote(root):
        try:
            versions = storage.object_versions(root)
            mode = "versioned" if any(v["version_id"] != "null" for v in versions or []) else "unversioned"
        except UserError as e:
            if not str(e).startswith("access denied"):
                raise
            mode = "unlisted"
    with ThreadPoolExecutor(max_workers=8 if storage.is_remote(root) else 1) as pool:
        if versions is None:
            keys = _listed_keys(root) if storage.exists(root) else []
            found = pool.map(lambda k: Found(storage.read_bytes(storage.join(root, k)), None), keys)
        else:
            by: dict[str, list[dict]] = {}
            for v in versions:
                if _NAME.match(v["key"]):
                    by.setdefault(v["key"], []).append(v)
            keys = sorted(by)
            found = pool.map(lambda k: _load_versions(root, k, by[k]), keys)
        return dict(zip(keys, found)), mode


def _version_problems(root: str, found: dict[str, Found]) -> list[str]:
    out = []
    for key, f in sorted(found.items()):
        uri = storage.join(root, key)
        kept = f"its original version {f.original_version} was found ({_describe(f.original)})"
        if f.marker is not None:
            out.append(f"DELETED {uri}: a delete marker ({f.marker}) hides it; " +
                       (kept if f.original is not None else "no version of it is left"))
        elif f.versions > 1:
            out.append(f"EDITED {uri}: overwritten after it was written ({f.versions} versions); {kept}")
    return out


def _describe(data: Optional[bytes]) -> str:
    if data is None:
        return "nothing"
    head, records = _header(data)
    what = f"{records} records, " if head is not None else ""
    return f"{what}{len(data)} bytes, sha256 {sha256(data)[:16]}.."


def _header(data: bytes) -> tuple[Optional[dict], int]:
    """A segment's chain header (None: written before segments were chained, or not a segment) and its records."""
    lines = [ln for ln in data.decode("utf-8", errors="replace").splitlines() if ln.strip()]
    try:
        head = json.loads(lines[0]) if lines else None
    except ValueError:
        head = None
    if not isinstance(head, dict) or head.get("kind") != HEADER:
        return None, len(lines)
    return head, len(lines) - 1


def _anchor_problem(uri: str, anchor: Optional[bytes], writer: str, seq: int, seg: Optional[bytes],
                    seg_uri: str) -> Optional[tuple[str, str]]:
    """What is wrong between a writer's anchor and the segment it anchors, if anything: (the object, the line)."""
    try:
        a = json.loads(anchor or b"")
    except ValueError:
        a = None
    if not isinstance(a, dict) or a.get("writer") != writer or a.get("seq") != seq:
        return uri, f"EDITED {uri}: not the anchor of writer {writer}'s segment {seq}"
    if seg is not None and a.get("sha256") != sha256(seg):
        return seg_uri, f"EDITED {seg_uri}: its sha256 is not the one its {a.get('anchor')} anchor ({uri}) names"
    return None


@dataclass
class _Tally:
    writers: int = 0
    segments: int = 0
    records: int = 0
    unclosed: int = 0
    legacy: int = 0
    problems: list[str] = field(default_factory=list)
    named: set[str] = field(default_factory=set)

    def bad(self, uri: str, line: str) -> None:
        """One problem line per object: the first found names it."""
        if uri not in self.named:
            self.named.add(uri)
            self.problems.append(line)


def _check_writer(root: str, writer: str, found: dict[str, Found], reported: set[str], tally: _Tally) -> None:
    """One writer's chain: segments 0..N all there, each naming the sha256 of the one before, segment 0 and the
    last anchored as the anchors say (the original versions where the bucket kept them)."""
    segs = {int(m.group(5)): f.truth for k, f in found.items() if (m := _NAME.match(k)) and m.group(4) == writer}
    segs = {s: d for s, d in segs.items() if d is not None}
    lasts = {int(m.group(3)): k for k in found if (m := _NAME.match(k)) and m.group(1) == writer and m.group(3)}
    first = anchor_name(writer, "first", 0)
    heads = {s: _header(d) for s, d in segs.items()}
    if segs and all(h is None for h, _ in heads.values()) and first not in found and not lasts:
        tally.legacy += len(segs)  # written before segments were chained: nothing to check them against
        return
    tally.writers += 1
    seg_uri = lambda s: storage.join(root, writer, segment_name(s))  # noqa: E731
    for s in range(max([*segs, *lasts, 0]) + 1):
        if s not in segs:
            if f"{writer}/{segment_name(s)}" not in reported:
                tally.bad(seg_uri(s), f"MISSING {seg_uri(s)}: segment {s} of writer {writer} is gone (the writer's "
                          "chain or its anchors name it)")
            continue
        head, records = heads[s]
        tally.segments, tally.records = tally.segments + 1, tally.records + records
        prev = sha256(segs[s - 1]) if s - 1 in segs else None
        if head is None or head.get("writer") != writer or head.get("seq") != s or head.get("records") != records:
            tally.bad(seg_uri(s), f"EDITED {seg_uri(s)}: its header does not describe it (writer {writer}, segment "
                      f"{s}, {records} records)")
        elif (s == 0 and head.get("prev_sha256") is not None) or (prev is not None and head["prev_sha256"] != prev):
            edited = seg_uri(max(0, s - 1))
            tally.bad(edited, f"EDITED {edited}: its sha256 is not the one segment {s} names")
    for name, seq in ([(first, 0)] if first in found or segs else []) + [(k, s) for s, k in sorted(lasts.items())]:
        f, uri = found.get(name), storage.join(root, name)
        if f is None or f.truth is None:
            if name not in reported:
                tally.bad(uri, f"MISSING {uri}: writer {writer}'s first anchor is gone (deleted, or the writer "
                          "stopped between writing segment 0 and anchoring it)")
            continue
        problem = _anchor_problem(uri, f.truth, writer, seq, segs.get(seq), seg_uri(seq))
        if problem:
            tally.bad(*problem)
    if not lasts or max(lasts) < max(segs, default=-1):
        tally.unclosed += 1


def _writers(found: dict[str, Found]) -> list[str]:
    out = set()
    for key in found:
        m = _NAME.match(key)
        out.add(m.group(1) or m.group(4))
    return sorted(out)


def _has_records(root: str) -> bool:
    """Whether anything was ever written under `root` as an audit root (deleted objects' versions count)."""
    try:
        versions = storage.object_versions(root)
    except UserError:
        versions = None
    if versions is not None:
        return any(_NAME.match(v["key"]) for v in versions)
    return storage.exists(root) and bool(segments(root) or storage.list_dir(storage.join(root, ANCHORS)))


def locate(target: str) -> tuple[str, str, str]:
    """(what the target is: "run", "model" or "audit root"; its audit root; where its records were before audit
    records moved under the bucket's audit/ prefix). UserError when there is neither the target nor any record."""
    t = storage.absolute(target)
    run = ("run", run_root(t), legacy_run_root(t))
    if storage.exists(RunDir(t).uri(CONFIG)):
        return run
    candidates = [run, ("model", serve_root(t), legacy_serve_root(t)), ("audit root", sealed(t), t)]
    for what, root, legacy in candidates:
        if _has_records(root) or (legacy != root and _has_records(legacy)):
            return what, root, legacy
    if storage.exists(t):
        return candidates[1]
    raise UserError(f"not found: {target}: no run, model or audit records there (looked for audit records in "
                    f"{run[1]} and {candidates[1][1]})")


def verify(target: str) -> Verdict:
    """Whether the audit records of a run, a served model or an audit root are complete and unedited: every writer's
    segments 0..N there, each naming the sha256 of the one before, its first and last (at close) segment as its
    anchors say; on a versioned bucket every version read, so that a deleted or overwritten object is named with its
    original version. Records written before segments were chained (or under the old location) are counted, not
    vouched for."""
    what, root, legacy = locate(target)
    found, mode = inventory(root)
    tally = _Tally(problems=_version_problems(root, found))
    reported = {k for k, f in found.items() if f.marker is not None or f.versions > 1}
    for writer in _writers(found):
        _check_writer(root, writer, found, reported, tally)
    if storage.is_remote(legacy) and legacy != root and storage.exists(legacy):
        tally.legacy += len(segments(legacy))
    notes = [VERSION_NOTES[mode]] if found else []
    if tally.legacy:
        notes.append(f"{_n(tally.legacy, 'segment')} written before audit records were chained and sealed (under "
                     f"{legacy}): not verified")
    where = f"{what} {target}: audit records {root}"
    figures = f"{_n(tally.writers, 'writer')}, {_n(tally.segments, 'segment')}, {_n(tally.records, 'record')}"
    if tally.unclosed:
        figures += (f" ({tally.unclosed} of the writers not closed: stopped without closing, or still writing; "
                    "their newest segment is not anchored)")
    if tally.problems:
        return Verdict(False, tally.problems, f"NOT intact: {where}: {_n(len(tally.problems), 'problem')}; "
                       f"{figures}; " + "; ".join(notes))
    if not tally.writers:
        return Verdict(False, [], f"NOT verified: {where}: no chained audit records"
                       + "".join(f"; {n}" for n in notes))
    return Verdict(True, [], f"intact: {where}: {figures}, each segment chained to the one before it, every "
                   "writer's first segment anchored; " + "; ".join(notes))


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"
