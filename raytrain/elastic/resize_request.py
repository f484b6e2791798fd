"""Before a running group is restarted at a larger size: the controller asks rank 0 for a checkpoint at the next step
boundary and waits for it, so growing redoes no step. Both ways through the cluster's key-value store (no storage
request, no actor call on a worker's step path): the controller puts a request, a thread on rank 0 reads it (once a
second), the ranks agree on it in the step's all-reduce like a preemption notice, and rank 0 answers once the
checkpoint is committed. The controller waits at most `wait_s`; without an answer it grows from the newest checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import Optional

from raytrain.internals.registry import gate
from raytrain.internals.ray import INTERNAL_KV, kv_del, kv_get, kv_put

POLL_S = 1.0  # rank 0 looks for a request this often (one small key-value read)


def _keys(run_uri: str) -> tuple[str, str]:
    h = hashlib.sha1(run_uri.encode()).hexdigest()[:12]
    return f"resize-ask-{h}", f"resize-done-{h}"


def ask(run_uri: str, wait_s: float) -> Optional[int]:
    """Controller side: ask for a checkpoint now and wait for it; the step it was committed at, or None (no answer
    within wait_s, or no key-value store)."""
    if not gate(INTERNAL_KV):
        return None
    ask_key, done_key = _keys(run_uri)
    t = time.time()
    try:
        kv_put(ask_key, json.dumps({"time": t}).encode())
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            raw = kv_get(done_key)
            done = json.loads(raw) if raw else None
            if done and done.get("asked") == t:
                return int(done["step"])
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - the resize goes ahead from the newest checkpoint
        return None
    finally:
        # Answered or not, the request ends with the wait: a group started later never takes it for its own (the
        # controller starts no group while it waits here).
        try:
            kv_del(ask_key)
        except Exception:  # noqa: BLE001
            pass
    return None


class Listener:
    """Rank 0's side: a thread that sets `event` when a request arrives (a request lives only while the controller
    waits for its answer, so one seen is this group's)."""

    def __init__(self, run_uri: str, event: threading.Event, *, enabled: bool):
        self.ask_key, self.done_key = _keys(run_uri)
        self.event, self.asked = event, None
        self._stop = threading.Event()
        self._thread = None
        if enabled and gate(INTERNAL_KV):
            self._thread = threading.Thread(target=self._run, name="raytrain-resize-request", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                raw = kv_get(self.ask_key)
            except Exception:  # noqa: BLE001 - Ray shutting down: nothing to ask any more
                return
            req = json.loads(raw) if raw else None
            if req and req["time"] != self.asked:
                self.asked = req["time"]
                self.event.set()

    def answer(self, step: int) -> None:
        """The requested checkpoint is committed at `step`."""
        if self.asked is None:
            return
        try:
            kv_put(self.done_key, json.dumps({"asked": self.asked, "step": step}).encode())
        except Exception:  # noqa: BLE001 - the controller grows from the newest checkpoint after its wait
            pass

    def close(self) -> None:
        self._stop.set()
