"""Append-only audit records: each process writes its own JSONL segments, each once and whole; readers merge them."""

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
from typing import Any, Optional

from raytrain import storage
from raytrain.errors import first_line
from raytrain.rundir import AUDIT, RunDir, parse_jsonl

# A segment is written every SEGMENT_RECORDS records or SEGMENT_SECONDS, whichever comes first: a busy server
# writes one object per few hundred requests, a quiet one its records within seconds.
SEGMENT_RECORDS = 512
SEGMENT_SECONDS = 5.0
# Records held in memory while storage refuses writes; past this the oldest go, and a record counts them.
MAX_BUFFERED = 200_000
SUFFIX = ".jsonl"
WARN_EVERY_S = 60.0


def writer_id() -> str:
    """host-pid-random: unique per process (and per writer), so no two writers ever name the same object."""
    host = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:48] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def segment_name(seq: int) -> str:
    return f"{seq:08d}{SUFFIX}"


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
    exit) writes the rest. A segment storage refused is retried under the same name with the same bytes, so a
    retry never rewrites an object with different content and no record is lost."""

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
        self._pending: Optional[tuple[int, str]] = None  # a segment storage refused: retried as it is
        self._seq, self._dropped, self._warned = 0, 0, 0.0
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
                self.flush()

    def _take(self) -> list[dict]:
        with self._lock:
            batch, self._buf = self._buf, []
            dropped, self._dropped = self._dropped, 0
        if dropped:
            batch.insert(0, {"time": time.time(), "kind": "audit_dropped", "records": dropped,
                             "reason": f"storage refused writes while more than {MAX_BUFFERED} records waited"})
        return batch

    def flush(self) -> bool:
        """Write what is buffered as one segment now. False (and a warning on stderr at most once a minute) when
        storage refused: the records stay, to be retried by the next flush."""
        with self._writing:
            retry = self._pending is not None
            for _ in range(2 if retry else 1):  # a refused segment first, then what is buffered
                if self._pending is None:
                    batch = self._take()
                    if not batch:
                        return True
                    text = "".join(json.dumps(r, default=str) + "\n" for r in batch)
                    self._pending, self._seq = (self._seq, text), self._seq + 1
                seq, text = self._pending
                try:
                    storage.write_text(storage.join(self.uri, segment_name(seq)), text)
                except Exception as e:  # noqa: BLE001 - storage of any kind: the records are kept and retried
                    self._warn(e)
                    return False
                self._pending = None
            return True

    def _warn(self, err: BaseException) -> None:
        if time.time() - self._warned >= WARN_EVERY_S:
            self._warned = time.time()
            print(f"[raytrain] audit: cannot write a segment under {self.uri} ({first_line(err)}); the records are "
                  "kept and retried", file=sys.stderr, flush=True)

    def close(self) -> bool:
        """Stop the background thread and write the rest; True when nothing is left unwritten."""
        if os.getpid() != self._pid:
            return True  # a forked child that never recorded: the parent's records are the parent's to write
        self._closed = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)
        ok = self.flush()
        atexit.unregister(self.close)
        return ok


def segments(root: str) -> list[tuple[str, int, str]]:
    """(writer, seq, uri) of every segment under an audit root; files being written (temp names) are not segments."""
    out = []
    for writer in storage.list_dir(root):
        for name in storage.list_dir(storage.join(root, writer)):
            stem = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else ""
            if stem.isdigit():
                out.append((writer, int(stem), storage.join(root, writer, name)))
    return out


def read(root: str) -> list[dict]:
    """Every record of every writer, merged by (time, writer, segment), each with its "writer" and "segment".
    A line that does not parse (a torn segment) is skipped, never an error; a missing root reads as none."""
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
            t = rec.get("time")
            t = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0
            keyed.append(((t, writer, seq, i), {**rec, "writer": writer, "segment": seq}))
    keyed.sort(key=lambda kv: kv[0])
    return [rec for _, rec in keyed]


def run_root(run_uri: str) -> str:
    """A run's audit root: `<run>/audit`."""
    return RunDir(run_uri).uri(AUDIT)


def serve_root(model_uri: str) -> str:
    """`raytrain serve`'s default audit root: `<served model directory>.audit`, beside the model, never inside it
    (replicas download a model directory whole, and an exported model stays as exported)."""
    return model_uri.rstrip("/") + "." + AUDIT


_RUN_WRITERS: dict[str, AuditWriter] = {}
_RUN_LOCK = threading.Lock()


def run_event(run_uri: str, kind: str, **fields: Any) -> dict:
    """Record one run-level event (submit, resume, resize, rollback, export) in `<run>/audit`, written now as a
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
