#!/usr/bin/env python
"""Chaos drill: a 2-worker run on a local multi-node Ray cluster, with worker kills, a node removal
and/or a preemption drain, checked against the same run without faults.

    .venv/bin/python scripts/chaos.py --data data/python-docs --storage s3://bucket/chaos \
        --steps 24 --kills 3 --remove-node-at 14 --baseline --out chaos.json

Each training worker gets a node of its own (`trainer` resource), so removing a node takes one rank
with it, as a lost spot instance does. Faults fire at steps drawn from --seed (SIGKILL of a worker
process, or a node event carried out here: removal, or a drain with reason PREEMPTION and a deadline,
after which the node is removed). A spare node is added as an autoscaler would. The result JSON has
per-step losses and batch fingerprints of both runs, kill-to-resume seconds and steps lost per fault.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(args, name: str, extra: list[str]):
    from raytrain.config import load_config

    return load_config(args.config, [
        f"data.train={args.data}/train", f"data.val={args.data}/val", f"checkpoint.storage={args.storage}",
        f"run.name={name}", f"run.max_steps={args.steps}", f"checkpoint.every_n_steps={args.every}",
        "run.log_every=1", "run.eval_every=0", "scaling.num_workers=2", "scaling.cpus_per_worker=1",
        "scaling.resources_per_worker={trainer: 1}", "run.max_failures=20", "checkpoint.keep_last=2",
        *args.override, *extra])


def _records(run_uri: str) -> dict[int, dict]:
    from raytrain import storage

    recs = [json.loads(x) for x in storage.read_text(storage.join(run_uri, "metrics.jsonl")).splitlines()]
    return {r["step"]: r for r in recs if "loss" in r}


class Harness:
    """Carries out node events that workers request (see worker.loop._crash_hook)."""

    def __init__(self, cluster, marker: str, drain_deadline_s: float):
        self.cluster, self.marker, self.deadline_s = cluster, marker, drain_deadline_s
        self.done: set[str] = set()
        self.log: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def add_spare(self):
        return self.cluster.add_node(num_cpus=1, resources={"trainer": 1})

    def _node(self, node_id: str):
        return next(n for n in self.cluster.worker_nodes if n.node_id == node_id)

    def _run(self):
        while not self._stop.is_set():
            for req in glob.glob(self.marker + "*.request"):
                if req in self.done:
                    continue
                self.done.add(req)
                ev = json.load(open(req))
                node = self._node(ev["node_id"])
                t = time.time()
                if ev["action"] == "REMOVE_NODE":
                    self.add_spare()  # the replacement the autoscaler would bring
                    self.cluster.remove_node(node, allow_graceful=False)
                else:
                    import ray
                    from ray.core.generated import autoscaler_pb2

                    gcs = ray._raylet.GcsClient(address=self.cluster.gcs_address)
                    deadline_ms = int((time.time() + self.deadline_s) * 1000)
                    gcs.drain_node(node.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   "chaos drill: spot interruption notice", deadline_ms)
                    self.add_spare()
                    threading.Timer(self.deadline_s + 1, self.cluster.remove_node, args=(node, False)).start()
                self.log.append({"action": ev["action"], "node_id": node.node_id, "time": t})
            time.sleep(0.2)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="prepared dataset directory (with train/ and val/)")
    ap.add_argument("--storage", required=True, help="checkpoint storage URI (s3://... for a real drill)")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4, help="checkpoint interval")
    ap.add_argument("--kills", type=int, default=3, help="SIGKILLs of worker processes at random steps")
    ap.add_argument("--remove-node-at", type=int, default=0, help="remove a worker's node at this step")
    ap.add_argument("--drain-at", type=int, default=0, help="drain a worker's node for preemption at this step")
    ap.add_argument("--drain-deadline", type=float, default=20.0, help="seconds from the drain to the node's end")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", action="store_true", help="also run without faults and compare")
    ap.add_argument("--name", default="chaos")
    ap.add_argument("--out", default=None)
    ap.add_argument("override", nargs="*", help="extra dotted config overrides")
    args = ap.parse_args(argv)

    import ray
    from ray.cluster_utils import Cluster

    from raytrain.trainer import train

    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"trainer": 1})
    ray.init(address=cluster.address, log_to_driver=True)
    marker = os.path.join(tempfile.mkdtemp(prefix="raytrain-chaos-"), "event")
    harness = Harness(cluster, marker, args.drain_deadline).start()
    rng = random.Random(args.seed)
    busy = {args.remove_node_at, args.drain_at}
    kill_steps = sorted(rng.sample([s for s in range(2, args.steps) if s not in busy], args.kills))
    events = [{"step": s, "rank": rng.randrange(2), "signal": "SIGKILL"} for s in kill_steps]
    if args.remove_node_at:
        events.append({"step": args.remove_node_at, "rank": 1, "signal": "REMOVE_NODE"})
    if args.drain_at:
        events.append({"step": args.drain_at, "rank": 1, "signal": "DRAIN_NODE"})
    events.sort(key=lambda e: e["step"])
    result: dict = {"events": events}
    try:
        if args.baseline:
            cfg = _cfg(args, args.name + "-baseline", [])
            t = time.time()
            train(cfg, log=lambda *_: None)
            result["baseline_wall_s"] = time.time() - t
            result["baseline"] = {s: {"loss": r["loss"], "crc": r.get("batch_crc32")} for s, r in _records(cfg.run_uri).items()}
        cfg = _cfg(args, args.name, [])
        t = time.time()
        summary = train(cfg, log=lambda *_: None, inject={"events": events, "marker": marker})
        result["chaos_wall_s"] = time.time() - t
        recs = _records(cfg.run_uri)
        result["chaos"] = {s: {"loss": r["loss"], "crc": r.get("batch_crc32")} for s, r in recs.items()}
        result["summary"] = summary
        result["recovery"] = _recovery(cfg.run_uri, events, marker)
    finally:
        harness.stop()
        ray.shutdown()
        cluster.shutdown()
    if args.baseline:
        b, c = result["baseline"], result["chaos"]
        result["same_batches"] = all(b[s]["crc"] == c[s]["crc"] for s in b) and set(b) == set(c)
        result["max_loss_diff"] = max(abs(b[s]["loss"] - c[s]["loss"]) for s in b)
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    rec = result["recovery"]
    print(f"chaos: {len(events)} faults, {summary['restarts']} restarts, steps {summary['steps']}; "
          + "; ".join(f"{r['signal']}@{r['step']}: resumed at step {r['resumed_from']} "
                      f"(lost {r['steps_lost']}), first step after {r['seconds_to_first_step']:.1f}s" for r in rec)
          + (f"; same batches: {result['same_batches']}, max |loss diff| {result['max_loss_diff']:.2e}"
             if args.baseline else ""))
    return 0


def _recovery(run_uri: str, events: list[dict], marker: str) -> list[dict]:
    """Per fault: when it fired, the step the run resumed from, steps lost, seconds to the next step.

    Read from the run's history: every attempt's metrics lines carry wall-clock times; the resumed
    attempt's first line after the fault tells where it restarted.
    """
    from raytrain import storage

    hist = [json.loads(x) for x in storage.read_text(storage.join(run_uri, "attempts.jsonl")).splitlines()]
    metrics = [json.loads(x) for x in storage.read_text(storage.join(run_uri, "metrics.jsonl")).splitlines()]
    out = []
    for i, e in enumerate(events):
        fired = f"{marker}.{i}"
        if not os.path.exists(fired):
            continue
        t = float(open(fired).read() or 0)
        after = [h for h in hist if h["time"] > t]
        first = after[0] if after else None
        # Work lost = steps done before the fault took effect that must be redone. A drain is noticed a
        # little after it is sent; the run checkpoints then and trains no further steps until the node goes.
        done = e["step"]
        if e["signal"] == "DRAIN_NODE":
            done = next((r["step"] for r in metrics if r.get("preemption_checkpoint") and r["step"] >= e["step"]),
                        e["step"])
        out.append({**e, "fired_at": t, "resumed_from": first["resumed_step"] if first else None,
                    "steps_lost": done - first["resumed_step"] if first else None,
                    "seconds_to_first_step": first["first_step_time"] - t if first and first.get("first_step_time") else float("nan")})
    return out


if __name__ == "__main__":
    sys.exit(main())
