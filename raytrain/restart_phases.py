"""When the Train controller saw a fault, tore the worker group down and had a new one running: a restart's phases.

The controller side (`RestartClock`, a Ray Train callback) keeps the wall-clock time of each phase in the
cluster's key-value store (GCS), not in the run directory: nothing between a fault and the first resumed step
touches object storage. Rank 0 reads them after its first step (`read`) and puts them in its attempts.jsonl
line, next to the worker's own start-up phases (imports, engine, restore, first batch, first step).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Optional

from raytrain.internals.registry import gate
from raytrain.internals.ray import CONTROLLER_CALLBACKS, INTERNAL_KV, controller_callback_base, kv_del, kv_get, \
    kv_put, restarting_state, worker_group_callback_base

# Phase names, in order; each the time it ended.
PHASES = ("fault_detected", "group_torn_down", "group_starting", "workers_created", "group_up", "train_fn_started")


def _key(run_uri: str) -> str:
    return "restart-" + hashlib.sha1(run_uri.encode()).hexdigest()[:12]


def read(run_uri: str) -> Optional[dict]:
    """The newest worker group start's phases ({phase: unix time}); None when the controller kept none."""
    if not gate(INTERNAL_KV):
        return None
    try:
        raw = kv_get(_key(run_uri))
    except Exception:  # noqa: BLE001 - a diagnostic: never the reason a run fails
        return None
    return json.loads(raw) if raw else None


def forget(run_uri: str) -> None:
    """At the end of a run (driver side): the key goes with it."""
    if not gate(INTERNAL_KV):
        return
    try:
        kv_del(_key(run_uri))
    except Exception:  # noqa: BLE001 - Ray already shut down: the store went with it
        pass


def make_clock(run_uri: str):
    """The callback to pass in RunConfig(callbacks=...): runs inside the controller actor. None where Ray's
    controller internals are not the version it was written for (restart phases are then not recorded)."""
    if not (gate(CONTROLLER_CALLBACKS) and gate(INTERNAL_KV)):
        return None

    class RestartClock(controller_callback_base(), worker_group_callback_base()):
        def __init__(self):
            self.phases: dict = {}

        def _mark(self, phase: str, publish: bool = False) -> None:
            self.phases[phase] = round(time.time(), 3)
            if publish:
                try:
                    kv_put(_key(run_uri), json.dumps(self.phases).encode())
                except Exception:  # noqa: BLE001 - a diagnostic only
                    pass

        def after_controller_state_update(self, previous_state, current_state) -> None:
            if isinstance(current_state, restarting_state()):
                self.phases = {}
                self._mark("fault_detected")

        def after_worker_group_shutdown(self, worker_group_context) -> None:
            if "fault_detected" in self.phases:
                self._mark("group_torn_down")

        def before_worker_group_start(self, worker_group_context) -> None:
            self._mark("group_starting")

        def before_init_train_context(self, workers) -> dict:
            self._mark("workers_created")  # resources placed, worker processes up; next: context, process group
            return {}

        def after_worker_group_start(self, worker_group) -> None:
            self._mark("group_up")

        def after_worker_group_training_start(self, worker_group) -> None:
            self._mark("train_fn_started", publish=True)

    return RestartClock()
