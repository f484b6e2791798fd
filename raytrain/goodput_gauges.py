"""Driver side: a live run's goodput ledger on Ray's Prometheus endpoint (raytrain_goodput_ratio, raytrain_badput_seconds
by kind, ...), recomputed every metrics.goodput_every_s from what the run directory's files gained since."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from raytrain import storage
from raytrain.rundir import RunDir, parse_jsonl

# name -> (help, extra label)
GAUGES: dict[str, tuple[str, Optional[str]]] = {
    "raytrain_goodput_ratio": ("productive seconds / wall seconds of the run so far (the goodput ledger)", None),
    "raytrain_badput_seconds": ("wall seconds of the run so far by kind of badput (label kind: raytrain report)",
                                "kind"),
    "raytrain_productive_seconds": ("wall seconds of steps that count, so far", None),
    "raytrain_run_wall_seconds": ("wall seconds from the run's first submission to now (or its end)", None),
    "raytrain_world_size": ("training workers of the run now (an elastic run's size; 0 while it waits)", None),
}


class TailReader:
    """RunDir.read_jsonl for files that grow at their end: a file read before is read again only from where it ended
    (one ranged read, which also checks that the bytes before it are still the same); a file rewritten otherwise
    (a resume drops the lines past the resumed step) is read whole again. Cost per poll: what was appended."""

    PROBE = 64  # bytes before the old end compared with what was read then

    def __init__(self, run_uri: str):
        self.rd = RunDir(run_uri)
        self._seen: dict[str, tuple[int, bytes, list[dict]]] = {}  # name -> (size, its last PROBE bytes, records)

    def read_jsonl(self, name: str) -> list[dict]:
        uri = self.rd.uri(name)
        size = storage.size(uri)
        if size is None:
            self._seen.pop(name, None)
            return []
        old = self._seen.get(name)
        if old is not None and size >= old[0]:
            start = max(0, old[0] - self.PROBE)
            data = storage.read_range(uri, start, size)
            if data[:old[0] - start] == old[1]:
                return self._keep(name, old[0], old[1], old[2], data[old[0] - start:])
        return self._keep(name, 0, b"", [], storage.read_bytes(uri))

    def _keep(self, name: str, size: int, tail: bytes, recs: list[dict], new: bytes) -> list[dict]:
        """Records up to the last newline are kept (with where they end); a line still being written is parsed
        for this answer only, and read again next time."""
        cut = new.rfind(b"\n") + 1
        if cut:
            recs = recs + parse_jsonl(new[:cut].decode("utf-8", "replace"))
            size, tail = size + cut, (tail + new[:cut])[-self.PROBE:]
        self._seen[name] = (size, tail, recs)
        return recs + parse_jsonl(new[cut:].decode("utf-8", "replace")) if cut < len(new) else recs


class GoodputGauges:
    """The gauges of one run, set from its ledger every `every_s` seconds by a thread of its own and set again every
    second in between (Ray drops a gauge not set for two report intervals); `close(final)` sets the final ledger."""

    def __init__(self, run_uri: str, run_name: str, *, every_s: float):
        from ray.util.metrics import Gauge

        self.run_uri, self.every_s = run_uri, every_s
        self.tags = {"run": run_name}
        self.reader = TailReader(run_uri)
        self._g = {name: Gauge(name, description=help_, tag_keys=("run",) + ((extra,) if extra else ()))
                   for name, (help_, extra) in GAUGES.items()}
        self._last: dict[tuple[str, str], tuple[float, dict]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="raytrain-goodput")
        self._thread.start()

    def _loop(self) -> None:
        due = time.monotonic() + min(self.every_s, 10.0)  # the first values soon after submission
        while not self._stop.wait(1.0):
            if time.monotonic() >= due:
                self.update()
                due = time.monotonic() + self.every_s
            self._refresh()

    def update(self, g: Optional[dict[str, Any]] = None) -> None:
        """Set the gauges from `g`, else from the ledger read now (never raises: accounting must not stop a run)."""
        if g is None:
            from raytrain.goodput import ledger

            try:
                g = ledger(self.run_uri, reader=self.reader)
            except Exception as e:  # noqa: BLE001 - one warning, then quiet; the next poll tries again
                if not self._warned:
                    self._warned = True
                    print(f"[raytrain] warning: goodput gauges not updated ({type(e).__name__}: {e})", flush=True)
                return
        if g is None:
            return
        sec = g["seconds"]
        self._set("raytrain_goodput_ratio", g["goodput"])
        self._set("raytrain_run_wall_seconds", g["wall_s"])
        self._set("raytrain_productive_seconds", sec.get("productive", 0.0))
        for kind, s in sec.items():
            if kind != "productive":
                self._set("raytrain_badput_seconds", s, kind=kind)
        if g.get("sizes"):
            self._set("raytrain_world_size", g["sizes"][-1][1])

    def _set(self, name: str, value: Optional[float], **extra: str) -> None:
        if value is None:  # not known yet (the run's first seconds: no wall time to divide by)
            return
        tags = {**self.tags, **extra}
        with self._lock:
            self._last[(name, extra.get("kind", ""))] = (float(value), tags)
        self._g[name].set(float(value), tags=tags)

    def _refresh(self) -> None:
        with self._lock:
            items = list(self._last.items())
        for (name, _), (value, tags) in items:
            self._g[name].set(value, tags=tags)

    def close(self, final: Optional[dict[str, Any]] = None) -> None:
        """Stop polling; the run's final ledger (when there is one) is the gauges' last value."""
        self._stop.set()
        self._thread.join(timeout=30)
        if final is not None:
            self.update(final)
