"""Fault injection for tests and chaos drills: every injected fault is described and carried out here.

`inject` (passed to `trainer.train`, or as JSON in RAYTRAIN_FAULT_INJECT for a submitted job) is one of
    {"crash_at_step": N, "rank": r, "signal": "SIGKILL", "marker": path}         one event
    {"events": [{"step": N, "rank": r, "signal": ...}, ...], "marker": dir}      several
    {"nan_at_step": N, "rank": r}                                                a NaN loss on that step's batch
    {"snapshot_delay_s": x}             every memory snapshot stalls x seconds longer (a slow copy)
    {"memory_apply_fails": r}           rank r cannot apply its host-memory snapshot (checked before the restore)
    {"memory_fetch_fails": r}           rank r's host-memory snapshot must come from another node's actor and none
                                        sends it (as when its node was lost and the holders' nodes go too)
    {"snapshot_ab_window": W}           no fault: memory snapshots skipped in every other window of W steps
                                        (steps W+1..2W, 3W+1..4W, ...), the benchmark's A/B in one run
    {"count_host_reads": path}          no fault: rank 0 appends each step's host reads of tensor values by
                                        raytrain's code to path (worker/host_reads.py)
Signals: any signal name (SIGTERM goes through the worker's real handler: a preemption checkpoint;
SIGKILL dies on the spot), "STALL" with "seconds" (the rank hangs), "REMOVE_NODE" / "DRAIN_NODE" (carried
out on this worker's node by scripts/chaos.py; "replace": false on a REMOVE_NODE: no node replaces it, as when spot
capacity is gone), "REMOVE_DATA_NODE" (the cluster's CPU-only data node, by scripts/chaos.py), "ADD_NODE" (a worker
node joins, by scripts/chaos.py; the run trains on). A marker file per event makes each fire once, so the
restarted worker trains on past that step.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Callable, Optional

from raytrain.errors import UserError
from raytrain.internals.ray import preemption_poll_s

ENV = "RAYTRAIN_FAULT_INJECT"


def from_env() -> Optional[dict]:
    """The driver's injection from RAYTRAIN_FAULT_INJECT (a job submitted with `ray job submit`)."""
    text = os.environ.get(ENV)
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{ENV} is not JSON ({e}); unset it, or see raytrain/faults.py for its forms") from None


class Faults:
    """This rank's injected faults: `after_step(step)` fires the step's events, `loss(position, loss)` poisons."""

    def __init__(self, inject: Optional[dict], *, rank: int, global_batch: int):
        inject = inject or {}
        self.rank = rank
        events = inject.get("events") or ([{"step": inject["crash_at_step"], "rank": inject.get("rank", 0),
                                            "signal": inject.get("signal", "SIGKILL")}]
                                          if inject.get("crash_at_step") else [])
        self.marker = inject.get("marker")
        self.several = bool(inject.get("events"))
        self.mine = [(i, e) for i, e in enumerate(events) if e.get("rank", 0) == rank] if self.marker else []
        nan_step = inject.get("nan_at_step")
        # Tied to the data position, like real bad data: once that window is skipped it never comes back.
        self.nan_position = (nan_step - 1) * global_batch if nan_step and rank == inject.get("rank", 0) else None
        self.ab_window = int(inject.get("snapshot_ab_window") or 0)
        self.apply_fails = inject.get("memory_apply_fails") == rank
        self.fetch_fails = inject.get("memory_fetch_fails") == rank
        self.snapshot_delay_s = float(inject.get("snapshot_delay_s") or 0.0)
        self.host_reads_path = inject.get("count_host_reads")

    def memory_apply(self) -> None:
        """Raises on the rank told to fail applying its memory snapshot."""
        if self.apply_fails:
            raise RuntimeError(f"injected: rank {self.rank} cannot apply its memory snapshot")

    def snapshots_paused(self, step: int) -> bool:
        """True in the windows of a snapshot A/B measurement that run without memory snapshots."""
        return bool(self.ab_window) and ((step - 1) // self.ab_window) % 2 == 1

    def loss(self, position: int, loss):
        """The loss, made NaN on the batch that step `nan_at_step` of an uninterrupted run trains on."""
        return loss * float("nan") if position == self.nan_position else loss

    def after_step(self, step: int, log: Callable[[str], None]) -> None:
        for i, e in self.mine:
            fired = f"{self.marker}.{i}" if self.several else self.marker
            if step == e["step"] and not os.path.exists(fired):
                with open(fired, "w") as f:
                    f.write(str(time.time()))  # when it fired: recovery time is measured from here
                sig = e.get("signal", "SIGKILL")
                log(f"injected {sig} at step {step} (rank {self.rank})")
                _fire(sig, e, fired)


def _fire(sig: str, event: dict, fired: str) -> None:
    if sig in ("REMOVE_DATA_NODE", "ADD_NODE"):  # carried out by the chaos harness; this rank trains on
        with open(fired + ".request", "w") as f:
            json.dump({"action": sig}, f)
        if sig == "ADD_NODE":
            # A tiny drill's steps are milliseconds: the step lasts until the node has joined and "hold_s" more, so
            # that the run is still going when an elastic controller grows onto it.
            for _ in range(3000):
                if os.path.exists(fired + ".ack"):
                    break
                time.sleep(0.1)
            time.sleep(float(event.get("hold_s", 0)))
        return
    if sig in ("REMOVE_NODE", "DRAIN_NODE"):
        # Node-level events are carried out by the chaos harness on this worker's node; a removed node
        # takes this process with it.
        import ray

        with open(fired + ".request", "w") as f:
            json.dump({"action": sig, "node_id": ray.get_runtime_context().get_node_id(),
                       "replace": event.get("replace", True)}, f)
        if sig == "REMOVE_NODE":
            time.sleep(300)
            return
        # Ray relays a drain to the workers within its poll interval (5 s by default): this step lasts long enough
        # for the notice to arrive during the run, as on a real cluster.
        for _ in range(600):
            if os.path.exists(fired + ".ack"):
                break
            time.sleep(0.1)
        time.sleep(preemption_poll_s() + 3)
    elif sig == "STALL":
        time.sleep(event.get("seconds", 60))  # a hung rank: its peers wait in the next collective
    else:
        os.kill(os.getpid(), getattr(signal, sig))
