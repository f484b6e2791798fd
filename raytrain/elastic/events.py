"""An elastic run's size events (started at N, waiting for capacity, capacity back, growing), from the controller to
the driver: the controller keeps them in the cluster's key-value store (no storage request on a restart's path), the
driver says each one once and appends it to the run's elastic.jsonl (the goodput ledger reads them there)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import Callable, Optional

from raytrain.internals.registry import gate
from raytrain.internals.ray import INTERNAL_KV, kv_del, kv_get, kv_put
from raytrain.rundir import ELASTIC, RunDir

KEEP = 64  # events held in the store: a driver reads every few seconds, so it never misses one


def key(run_uri: str) -> str:
    return "elastic-" + hashlib.sha1(run_uri.encode()).hexdigest()[:12]


class Publisher:
    """Controller side: numbered events into the store (pickled into the controller with its policies)."""

    def __init__(self, run_uri: str):
        self.key, self.events, self.seq = key(run_uri), [], 0

    def __call__(self, event: dict) -> None:
        if not gate(INTERNAL_KV):
            return
        self.seq += 1
        self.events = (self.events + [{"seq": self.seq, **event}])[-KEEP:]
        try:
            kv_put(self.key, json.dumps(self.events).encode())
        except Exception:  # noqa: BLE001 - a report only: never the reason a decision fails
            pass


class Relay:
    """Driver side: a thread that says each new event once and appends it to <run>/elastic.jsonl, after the driver's
    own `submitted` (when `raytrain train` was called) and before its `ended` (the goodput ledger's two ends)."""

    def __init__(self, run_uri: str, say: Callable[[str], None], *, submitted: float, interval_s: float = 2.0):
        self.run_uri, self.say, self.interval_s, self.submitted = run_uri, say, interval_s, submitted
        self.key, self.seen = key(run_uri), 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def poll(self) -> None:
        if not gate(INTERNAL_KV):
            return
        raw = kv_get(self.key)
        for ev in json.loads(raw) if raw else []:
            if ev["seq"] <= self.seen:
                continue
            self.seen = ev["seq"]
            RunDir(self.run_uri).append_jsonl(ELASTIC, ev)
            line = describe(ev)
            if line:
                self.say(line)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a report only: never the reason a run fails
                pass

    def __enter__(self) -> "Relay":
        RunDir(self.run_uri).append_jsonl(ELASTIC, {"event": "submitted", "time": round(self.submitted, 3)})
        self._thread = threading.Thread(target=self._run, name="raytrain-elastic-events", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind, value, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self.poll()
            kv_del(self.key)
        except Exception:  # noqa: BLE001 - Ray already shut down: the store went with it
            pass
        RunDir(self.run_uri).append_jsonl(ELASTIC, {"event": "ended", "time": round(time.time(), 3),
                                                    "ok": kind is None})


def describe(ev: dict) -> Optional[str]:
    """The console line of an event."""
    kind = ev.get("event")
    if kind == "waiting":
        return (f"[raytrain] waiting for capacity: the live nodes hold {ev['room']} worker(s), below "
                f"scaling.num_workers' MIN {ev['min']}; training resumes when nodes return")
    if kind == "capacity_back":
        return f"[raytrain] capacity back after {ev['waited_s']:.0f} s: starting {ev['workers']} workers"
    if kind == "grow":
        return f"[raytrain] growing {ev['from']} -> {ev['to']} workers (nodes joined)"
    if kind == "grow_checkpoint":
        got = f"checkpoint at step {ev['step']}" if ev.get("step") is not None else "no checkpoint in time (the newest)"
        return f"[raytrain] before growing: {got}, after {ev['waited_s']:.1f} s"
    if kind == "started":
        return f"[raytrain] worker group up: {ev['workers']} workers"
    if kind == "reclaimed":
        return (f"[raytrain] node(s) reclaimed with notice ({', '.join('..' + n[-8:] for n in ev['nodes'])}): "
                "restarting on the nodes that stay, from the notice's checkpoint")
    if kind == "lost_node":
        return f"[raytrain] node(s) lost ({', '.join('..' + n[-8:] for n in ev['nodes'])}): charged to run.max_preemptions"
    return None
