"""The in-run fallback for the cloud's reclaim notice: on a node whose own notice watcher does not run (a cluster not
built from raytrain's VM configs), the run's local rank 0 reads the instance metadata and drains its node in time.

The same Watcher as the node's own (raytrain/notice_watcher.py), in a daemon thread of the worker for the attempt's
life, polling every POLL_S. It looks for a metadata endpoint only where the firmware names a cloud (or
RAYTRAIN_METADATA_URL is set), so off a cloud it makes no request at all; the drain then reaches every rank as any
drain does (raytrain/worker/preemption.py).
"""

from __future__ import annotations

import threading
from typing import Optional

from raytrain.console import say

POLL_S = 5.0  # as the node's own watcher: an AWS notice gives 120 s, GCP's 30 s


class NodeNotices:
    """Started by the worker on its node's local rank 0; close() ends the thread at its next poll."""

    def __init__(self, *, enabled: bool):
        self._stop = threading.Event()
        self.watching: Optional[str] = None  # the cloud watched, when this node's fallback runs
        if not enabled:
            return
        import ray
        import ray.train

        from raytrain.notice_watcher import Watcher, detect_here, node_watcher_running, ray_drain

        if ray.train.get_context().get_local_rank() != 0 or node_watcher_running():
            return
        md = detect_here()
        if md is None:
            return
        ctx = ray.get_runtime_context()
        address, node_id = ctx.gcs_address, ctx.get_node_id()
        watcher = Watcher(md, drain=lambda s, msg: ray_drain(s, msg, address, node_id), interval_s=POLL_S, log=say)
        self.watching = md.cloud
        threading.Thread(target=watcher.run, kwargs={"stop": self._stop.is_set}, daemon=True,
                         name="raytrain-node-notices").start()

    def close(self) -> None:
        self._stop.set()
