#!/usr/bin/env python
"""Reclaim a worker node of a local (fake_multinode) Ray cluster the way a spot interruption does.

With `--notice SECONDS` the node is first drained through Ray's drain API with reason PREEMPTION and
a deadline SECONDS from now - what raytrain's notice watcher (raytrain/notice_watcher.py) does on a node when the
cloud announces an interruption (AWS gives 2 minutes, GCP 30 s) - and killed at the deadline; without it the node dies at once, like a
reclaim whose notice never arrived. "Dies" means its raylet and every process under it get SIGKILL:
nothing shuts down cleanly on a machine that is taken away. The autoscaler then sees a node that
stopped heartbeating, terminates it and launches a replacement if work is still waiting.

    python scripts/preempt.py                    # a spot node running a Ray Train worker, no notice
    python scripts/preempt.py --notice 20        # drain, 20 s notice, then kill
    python scripts/preempt.py --node-id fff...01 --address 127.0.0.1:6391

Killing needs the node's processes on this machine, which is the point of the fake cluster; on a real
cloud cluster use the provider's own interruption drill (AWS FIS, `gcloud compute instances simulate-
maintenance-event`). Prints one JSON line describing what was done.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import psutil


def _default_address() -> str:
    return os.environ.get("RAYTRAIN_GCS_ADDRESS") or f"127.0.0.1:{os.environ.get('RAYTRAIN_CLUSTER_PORT', '6391')}"


_GCS_PORT: list[str] = []  # this cluster's GCS port, set by main()


def _raylet_pid(node_id: str) -> int | None:
    """The raylet of a node of THIS cluster: its command line carries `--node_id=<hex>` and our GCS port
    (fake node ids repeat across clusters - fff...01 in every one - so the id alone can pick another's)."""
    flag = f"--node_id={node_id}"
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if flag in cmd and (not _GCS_PORT or any(a.startswith("--gcs-address=") and a.rsplit(":", 1)[-1] == _GCS_PORT[0]
                                                     for a in cmd)):
                return p.info["pid"]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def pick_node(node_type: str) -> dict:
    """The alive worker node to reclaim: one with the `node_type` resource that hosts a Ray Train
    worker if any does (the interesting case), else any such node."""
    import ray
    from ray.util.state import list_actors

    nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(node_type, 0) > 0]
    if not nodes:
        raise SystemExit(f"preempt: no alive node with resource {node_type!r}; is a job running on the cluster?")
    try:
        busy = {a["node_id"] for a in list_actors(filters=[("class_name", "=", "RayTrainWorker"),
                                                           ("state", "=", "ALIVE")], timeout=10)}
    except Exception:  # noqa: BLE001 - the state API is a preference, not a requirement
        busy = set()
    # The fake nodes are local processes: a node whose raylet has a `ray::RayTrainWorker` process under
    # it hosts a training worker. This does not depend on the state API answering in time.
    busy |= {n["NodeID"] for n in nodes if _hosts_train_worker(n["NodeID"])}
    nodes.sort(key=lambda n: (n["NodeID"] not in busy, n["NodeID"]))
    return {**nodes[0], "hosts_train_worker": nodes[0]["NodeID"] in busy}


def _hosts_train_worker(node_id: str) -> bool:
    return any(t.startswith("ray::RayTrainWorker") for t in _titles(node_id))


def _titles(node_id: str) -> list[str]:
    """Process titles under a local node's raylet (Ray names workers `ray::<Actor>`)."""
    pid = _raylet_pid(node_id)
    if pid is None:
        return []
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in kids:
        try:
            out.append(" ".join(p.cmdline())[:60])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def drain(address: str, node_id: str, notice_s: float, message: str) -> bool:
    """Ray's drain API with reason PREEMPTION and a deadline: what raytrain's notice watcher asks on a
    cloud interruption notice. Returns whether the GCS accepted it."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=address)
    deadline_ms = int(time.time() * 1000 + notice_s * 1000)
    accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   message, deadline_ms)
    if not accepted:
        print(f"preempt: drain not accepted ({why}); killing anyway", file=sys.stderr)
    return bool(accepted)


def kill_node(node_id: str) -> list[int]:
    """SIGKILL the node's raylet and everything under it (workers, agents), children first."""
    pid = _raylet_pid(node_id)
    if pid is None:
        raise SystemExit(f"preempt: no raylet for node {node_id} on this machine (only local fake nodes can be killed)")
    root = psutil.Process(pid)
    procs = root.children(recursive=True) + [root]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in procs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default=_default_address(),
                    help="GCS address host:port (default: 127.0.0.1:$RAYTRAIN_CLUSTER_PORT, as local_cluster.sh uses)")
    ap.add_argument("--node-id", help="hex id of the node to reclaim (default: pick a busy --node-type node)")
    ap.add_argument("--node-type", default="spot", help="custom resource that marks reclaimable nodes (default spot)")
    ap.add_argument("--wait-busy", type=float, default=0.0, metavar="SECONDS",
                    help="wait up to this long for a node that runs a Ray Train worker (default: take any node at once)")
    ap.add_argument("--notice", type=float, default=None, metavar="SECONDS",
                    help="drain with reason PREEMPTION and this deadline first, kill at the deadline")
    args = ap.parse_args(argv)
    _GCS_PORT[:] = [args.address.rsplit(":", 1)[-1]]

    # The clusters we start use token authentication; Ray reads the mode when first imported.
    from raytrain.ray_auth import ensure_token

    ensure_token(create=False)
    import ray

    ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
    try:
        node = next((n for n in ray.nodes() if n["NodeID"] == args.node_id), None) if args.node_id \
            else pick_node(args.node_type)
        t_end = time.time() + args.wait_busy
        while not args.node_id and not node["hosts_train_worker"] and time.time() < t_end:
            time.sleep(1)  # a worker group being (re)started: its actors are not placed yet
            node = pick_node(args.node_type)
        if args.wait_busy and not node.get("hosts_train_worker"):
            seen = {n["NodeID"][-6:]: _titles(n["NodeID"]) for n in ray.nodes() if n["Alive"]}
            raise SystemExit(f"preempt: no node runs a Ray Train worker after {args.wait_busy:g}s; processes per node: {seen}")
        if node is None:
            raise SystemExit(f"preempt: no node {args.node_id} in the cluster at {args.address}")
    finally:
        ray.shutdown()
    node_id = node["NodeID"]
    event = {"event": "preemption", "node_id": node_id, "address": args.address, "notice_s": args.notice,
             "resources": node["Resources"], "hosts_train_worker": node.get("hosts_train_worker"),
             "t_notice": None, "drain_accepted": None}
    if args.notice is not None:
        event["t_notice"] = time.time()
        event["drain_accepted"] = drain(args.address, node_id, args.notice,
                                        f"spot interruption drill: reclaimed in {args.notice:g}s")
        time.sleep(args.notice)
    event["t_kill"] = time.time()
    event["killed_pids"] = kill_node(node_id)
    print(json.dumps(event), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
