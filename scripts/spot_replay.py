#!/usr/bin/env python
"""Replay a spot capacity trace on a static local multi-node cluster and print the goodput ledger of the run.

    python scripts/spot_replay.py TRACE.json --data data/python-docs --storage /tmp/replay \\
        --segment 0:24 --tick-s 15 --max-nodes 4 --notice-every 2 --fixed 'scaling.num_workers=[1,4]' \\
        batch.global_batch_size=24 run.max_steps=100000

TRACE.json is in the format of SkyPilot's public spot traces: {"metadata": {"gap_seconds": 300}, "data": [nodes
available at each tick, ...]}. The cluster is `ray start` nodes on this machine, one `trainer` slot each (one training
worker per node, as one GPU box per worker), and no autoscaler: nothing refills what the trace takes away. Each tick
lasts --tick-s seconds (the trace's time compressed). When the trace falls, nodes leave: every --notice-every-th
one with a notice (drained for preemption, --notice-s before it goes), the others without (killed at once); when it
rises, nodes join. The run is `raytrain train` against that cluster with the given overrides, ended when the segment
ends. With --fixed the same segment is replayed again, on a fresh cluster, with scaling.num_workers fixed at the
range's MAX. Prints, per run: the steps done, goodput and its ledger (raytrain/goodput.py), and writes --out JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chaos import Harness  # noqa: E402 - the static cluster of the chaos drill


def load_trace(path: str, segment: str | None, max_nodes: int) -> tuple[list[int], float]:
    """(nodes available per tick, capped at max_nodes; the trace's seconds per tick)."""
    with open(path) as f:
        trace = json.load(f)
    data = [int(v) for v in trace["data"]]
    if segment:
        lo, hi = (int(x) if x else None for x in segment.split(":"))
        data = data[lo:hi]
    if not data:
        raise SystemExit(f"spot_replay: {path} has no ticks in segment {segment!r}")
    return [max(0, min(v, max_nodes)) for v in data], float(trace.get("metadata", {}).get("gap_seconds", 300))


class Follower:
    """Moves the cluster's node count along the trace, one tick every tick_s seconds, in a thread of its own."""

    def __init__(self, harness: Harness, ticks: list[int], tick_s: float, notice_every: int, notice_s: float):
        self.h, self.ticks, self.tick_s = harness, ticks, tick_s
        self.notice_every, self.notice_s = notice_every, notice_s
        self.alive: list[int] = []  # harness node indexes, oldest first
        self.removed = 0
        self.log: list[dict] = []
        self.done = threading.Event()

    def set_nodes(self, target: int) -> None:
        while len(self.alive) > target:
            k = self.alive.pop()  # the newest leaves first (the oldest hosts rank 0 longest)
            self.removed += 1
            noticed = bool(self.notice_every) and self.removed % self.notice_every == 0
            if noticed:
                self.h.drain_node(k, self.notice_s)
            else:
                self.h.kill_node(k)
            self.log.append({"time": time.time(), "node": k, "left": "notice" if noticed else "no notice"})
        while len(self.alive) < target:
            k = self.h.add_node()
            self.alive.append(k)
            self.log.append({"time": time.time(), "node": k, "joined": True})

    def run(self) -> None:
        t0 = time.time()
        for i, target in enumerate(self.ticks):
            self.log.append({"time": time.time(), "tick": i, "nodes": target})
            self.set_nodes(target)
            time.sleep(max(0.0, t0 + (i + 1) * self.tick_s - time.time()))
        self.done.set()


def replay(args, label: str, overrides: list[str], *, steady: bool = False, stop_at: int | None = None) -> dict:
    """One run on a fresh cluster following the trace (steady: MAX nodes throughout, until the run finishes or passes
    step `stop_at`); its steps, ledger and per-step records."""
    from chaos import _records

    from raytrain.config import load_config
    from raytrain.goodput import format_ledger, ledger
    from raytrain.rundir import METRICS, RunDir

    ticks, _ = load_trace(args.trace, args.segment, args.max_nodes)
    if steady:
        ticks = [args.max_nodes] * (len(ticks) * 10)
    h = Harness(args.notice_s).up()
    follower = Follower(h, ticks, args.tick_s, args.notice_every, args.notice_s)
    name = f"{args.name}-{label}"
    ov = [f"data.train={args.data}/train", f"data.val={args.data}/val", f"checkpoint.storage={args.storage}",
          f"run.name={name}", "scaling.resources_per_worker={trainer: 1}", "scaling.cpus_per_worker=1",
          "run.log_every=1", "run.eval_every=0", f"scaling.address={h.address}", *overrides]
    run_uri = load_config(args.config, ov).run_uri
    try:
        import ray

        ray.init(address=h.address, log_to_driver=False)  # the harness reads the node list
        follower.set_nodes(ticks[0])
        thread = threading.Thread(target=follower.run, daemon=True)
        thread.start()
        env = {**os.environ, "RAY_ADDRESS": h.address, "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}
        log = open(os.path.join(args.logs, f"{name}.log"), "w")
        proc = subprocess.Popen([sys.executable, "-m", "raytrain", "train", "--config", args.config, *ov],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None and not follower.done.is_set() and not _passed(run_uri, stop_at):
            time.sleep(1)
        ended_by = "run finished" if proc.poll() is not None else \
            "trace ended" if follower.done.is_set() else f"passed step {stop_at}"
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # the driver's end (its `ended` event), as a person's Ctrl-C
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    finally:
        import ray

        ray.shutdown()
        h.down()
    steps = max((r["step"] for r in RunDir(run_uri).read_jsonl(METRICS) if "loss" in r), default=0)
    g = ledger(run_uri)
    print(f"== {label}: {steps} steps ({ended_by}); " + (format_ledger(g) if g else "no ledger"), flush=True)
    return {"label": label, "run_uri": run_uri, "steps": steps, "ended_by": ended_by, "ledger": g,
            "nodes": follower.log, "records": {s: {"loss": r["loss"], "crc": (r.get("batch_crc32"),
                                                                               r.get("content_checksum"))}
                                               for s, r in _records(run_uri).items()}}


def _passed(run_uri: str, step: int | None) -> bool:
    """The run's heartbeat is past `step` (None: never)."""
    if step is None:
        return False
    from raytrain.rundir import PROGRESS, RunDir

    try:
        return int((RunDir(run_uri).read_json(PROGRESS) or {}).get("step", 0)) > step
    except Exception:  # noqa: BLE001 - not written yet
        return False


def compare(run: dict, base: dict) -> dict:
    """A replayed run's steps against the uninterrupted run's: every step once, the same rows (batch and content
    checksums), the losses' largest difference."""
    r, b = run["records"], base["records"]
    common = sorted(set(r) & set(b))
    return {"steps_compared": len(common), "every_step": sorted(r) == list(range(1, len(r) + 1)) and set(r) <= set(b),
            "same_batches": all(r[k]["crc"] == b[k]["crc"] for k in common),
            "max_loss_diff": max((abs(r[k]["loss"] - b[k]["loss"]) for k in common), default=None)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="capacity trace JSON: {metadata: {gap_seconds}, data: [nodes per tick]}")
    ap.add_argument("--data", required=True, help="prepared dataset directory (train/ and val/)")
    ap.add_argument("--storage", required=True, help="checkpoint storage (a local path is shared by the local nodes)")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--segment", default=None, help="ticks START:END of the trace")
    ap.add_argument("--tick-s", type=float, default=15.0, help="seconds each tick lasts here")
    ap.add_argument("--max-nodes", type=int, default=4, help="the trace's counts are capped at this")
    ap.add_argument("--notice-every", type=int, default=2, help="every k-th node that leaves is drained first (0: none)")
    ap.add_argument("--notice-s", type=float, default=10.0, help="a drained node goes this long after its notice")
    ap.add_argument("--fixed", action="store_true", help="also replay with scaling.num_workers fixed at MAX")
    ap.add_argument("--fixed-only", action="store_true", help="only the fixed-size replay")
    ap.add_argument("--baseline", action="store_true", help="also run uninterrupted on MAX nodes and compare the "
                    "elastic run's steps with it (set run.max_steps so that the elastic run finishes in the segment)")
    ap.add_argument("--name", default="replay")
    ap.add_argument("--out", default=None)
    ap.add_argument("override", nargs="*", help="dotted overrides of the run (scaling.num_workers=[MIN,MAX], ...)")
    args = ap.parse_intermixed_args(argv)  # the trace first, the overrides last, options anywhere
    args.logs = os.path.dirname(os.path.abspath(args.out)) if args.out else os.getcwd()
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    from raytrain.config import load_config
    from raytrain.ray_auth import ensure_token

    ensure_token()
    cfg = load_config(args.config, list(args.override))
    runs = [] if args.fixed_only else [replay(args, "elastic", list(args.override))]
    # The elastic run's largest size, as that run trains it there: the same micro-batch and accumulation.
    top = max(cfg.sizes())
    mb, acc = cfg.sizes()[top]
    at_top = [*args.override, f"scaling.num_workers={top}", f"batch.micro_batch_size={mb}",
              f"batch.gradient_accumulation_steps={acc}"]
    if args.fixed or args.fixed_only:
        runs.append(replay(args, "fixed", at_top))
    if args.baseline:
        done = max((r["steps"] for r in runs if r["label"] == "elastic"), default=None)
        base = replay(args, "baseline", at_top, steady=True, stop_at=done)
        for r in runs:
            r["vs_baseline"] = compare(r, base)
            print(f"{r['label']} vs uninterrupted: {r['vs_baseline']}", flush=True)
        runs.append(base)
    ticks, gap = load_trace(args.trace, args.segment, args.max_nodes)
    result = {"trace": args.trace, "segment": args.segment, "ticks": ticks, "trace_gap_s": gap, "tick_s": args.tick_s,
              "runs": runs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print("steps done: " + ", ".join(f"{r['label']} {r['steps']}" for r in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
