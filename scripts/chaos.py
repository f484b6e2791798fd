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
import subprocess
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
    from raytrain.rundir import METRICS, RunDir

    recs = RunDir(run_uri).read_jsonl(METRICS)
    return {r["step"]: r for r in recs if "loss" in r}


class Harness:
    """A local multi-node cluster made of `ray start` processes, and the node events workers request.

    Nodes are separate `ray start --block` process groups on 127.0.0.1, so a node can be killed whole
    (raylet and its workers) from any thread, as a lost spot instance would be. Each worker node has a
    `trainer` resource (one training worker per node) and a `chaos_node_K` resource naming it.
    """

    def __init__(self, drain_deadline_s: float, *, notices: bool = False):
        self.deadline_s = drain_deadline_s
        self.nodes: dict[int, subprocess.Popen] = {}
        # --notices: each worker node's reclaim notice comes from a fake AWS metadata endpoint of its own, read by that
        # node's notice watcher (raytrain/notice_watcher.py), which drains it as on a cloud VM.
        self.notices = notices
        self.metadata: dict[int, object] = {}
        self.watchers: dict[int, subprocess.Popen] = {}
        self.watcher_logs: dict[int, str] = {}
        self.log_dir = tempfile.mkdtemp(prefix="raytrain-chaos-watchers-")
        self.data_nodes: list[subprocess.Popen] = []
        self.log: list[dict] = []
        self.done: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ray = os.path.join(os.path.dirname(sys.executable), "ray")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"

    def _start(self, args: list[str]) -> subprocess.Popen:
        # Several nodes on one host: every per-node port is chosen here, or two nodes starting together
        # race for Ray's fixed defaults (the dashboard agent's 52365) and one raylet dies on bind().
        ports = [f"--{name}={_free_port()}" for name in (
            "node-manager-port", "object-manager-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
            "runtime-env-agent-port", "metrics-export-port")]
        return subprocess.Popen([self._ray, "start", "--block", "--node-ip-address=127.0.0.1",
                                 "--disable-usage-stats", "--min-worker-port=0", "--max-worker-port=0", *ports,
                                 *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def up(self) -> "Harness":
        self.head = self._start(["--head", f"--port={self.port}", "--num-cpus=2", "--include-dashboard=false"])
        _wait(lambda: _ray_ok(self.address), 60, "the head node did not start")
        return self

    def add_node(self) -> int:
        """Start a worker node and wait until it has joined. One at a time: `ray start`s racing on one
        host pick the same raylet socket name in the shared session directory, and one dies on bind()."""
        import ray

        k = len(self.nodes)
        self.nodes[k] = self._start([f"--address={self.address}", "--num-cpus=1",
                                     f"--resources={json.dumps({'trainer': 1, f'chaos_node_{k}': 1})}"])
        _wait(lambda: any(n["Alive"] and f"chaos_node_{k}" in n["Resources"] for n in ray.nodes()), 180,
              f"worker node {k} did not join")
        if self.notices:
            self._watch_notices(k)
        return k

    def _watch_notices(self, k: int) -> None:
        """Node k's metadata endpoint (a spot instance, no notice yet) and its notice watcher, polling every second."""
        from fake_metadata import FakeMetadata

        node_id = self._node_id(k)
        self.metadata[k] = md = FakeMetadata("aws")
        log = os.path.join(self.log_dir, f"notice-watcher-{k}.log")
        with open(log, "w") as out:
            self.watchers[k] = subprocess.Popen(
                [sys.executable, "-m", "raytrain.notice_watcher", "--address", self.address, "--node-id", node_id,
                 "--interval", "1"], env={**os.environ, "RAYTRAIN_METADATA_URL": md.url},
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.watcher_logs[k] = log

    def add_data_node(self) -> None:
        """A CPU-only data node (the `data` resource: data.reader=ray's read tasks run there and only there)."""
        import ray

        # Known by its id: a node killed just before may be marked dead while this one joins (a count stays even).
        before = {n["NodeID"] for n in ray.nodes()}
        self.data_nodes.append(self._start([f"--address={self.address}", "--num-cpus=1",
                                            f"--resources={json.dumps({'data': 1000})}"]))
        _wait(lambda: any(n["Alive"] and n["NodeID"] not in before and n["Resources"].get("data")
                          for n in ray.nodes()), 180, "the data node did not join")

    def _node_index(self, node_id: str) -> int:
        import ray

        for n in ray.nodes():
            if n["NodeID"] == node_id:
                return next(int(r.rsplit("_", 1)[1]) for r in n["Resources"] if r.startswith("chaos_node_"))
        raise KeyError(node_id)

    def drain_node(self, k: int, deadline_s: float, node_id: str | None = None) -> None:
        """A spot interruption notice: Ray drains node k for preemption with a deadline (the node's watcher, on the
        notice its metadata endpoint announces, with --notices; else this harness); the node goes then."""
        if self.notices:
            from raytrain.ckpt.layout import timestamp  # (AWS's instance-action time: ISO 8601, UTC)

            self.metadata[k].set(action={"action": "terminate", "time": timestamp(time.time() + deadline_s)})
        else:
            import ray
            from ray.core.generated import autoscaler_pb2

            gcs = ray._raylet.GcsClient(address=self.address)
            gcs.drain_node(node_id or self._node_id(k),
                           autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                           "chaos drill: spot interruption notice", int((time.time() + deadline_s) * 1000))
        threading.Timer(deadline_s + 1, self.kill_node, args=(k,)).start()

    @staticmethod
    def _node_id(k: int) -> str:
        """The Ray node id of worker node k (alive)."""
        import ray

        return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and f"chaos_node_{k}" in n["Resources"])

    def kill_node(self, k: int) -> None:
        """The node disappears at once: raylet and every process on it (its notice watcher too)."""
        self._kill(self.nodes[k])
        if k in self.watchers:
            self._kill(self.watchers.pop(k))
            self.metadata.pop(k).close()

    @staticmethod
    def _kill(node: subprocess.Popen) -> None:
        import signal

        try:
            os.killpg(node.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _run(self):
        while not self._stop.is_set():
            for req in glob.glob(self.marker + "*.request"):
                if req in self.done:
                    continue
                self.done.add(req)
                ev = json.load(open(req))
                try:
                    self._carry_out(req, ev, time.time())
                except Exception as e:  # noqa: BLE001 - said in the result; the drill's later events still run
                    self.log.append({"action": ev["action"], "error": f"{type(e).__name__}: {e}", "time": time.time()})
            time.sleep(0.2)

    def _carry_out(self, req: str, ev: dict, t: float) -> None:
        """One node event a worker requested."""
        if ev["action"] == "REMOVE_DATA_NODE":
            # Lost without notice, its read tasks' outputs with it; the replacement an autoscaler would bring
            # comes once it is gone (until then the pipeline has nowhere to run).
            self._kill(self.data_nodes[-1])
            self.add_data_node()
            self.log.append({"action": ev["action"], "time": t})
            return
        # "at": when the event itself happened (the node joined, was killed, got its notice), for timings from it.
        if ev["action"] == "ADD_NODE":  # capacity comes back (an elastic run grows onto it)
            self.add_node()
            open(req[:-len(".request")] + ".ack", "w").close()
            self.log.append({"action": ev["action"], "time": t, "at": time.time()})
            return
        k = self._node_index(ev["node_id"])
        if ev["action"] == "REMOVE_NODE":
            if ev.get("replace", True):
                self.add_node()  # the replacement an autoscaler would bring
            at = time.time()
            self.kill_node(k)
        else:
            # The notice first, then the replacement: a node joining takes tens of seconds on a loaded
            # machine, and a notice that late found the run already past the drained step.
            at = time.time()
            self.drain_node(k, self.deadline_s, node_id=ev["node_id"])
            open(req[:-len(".request")] + ".ack", "w").close()
            if ev.get("replace", True):
                self.add_node()
        self.log.append({"action": ev["action"], "node_id": ev["node_id"], "time": t, "at": at})

    def watch(self, marker: str) -> "Harness":
        self.marker = marker
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def down(self):
        import signal

        self._stop.set()
        for k in list(self.nodes):
            self.kill_node(k)
        for node in self.data_nodes:
            self._kill(node)
        if getattr(self, "head", None) is not None:
            try:
                os.killpg(self.head.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray_ok(address: str) -> bool:
    import socket

    host, port = address.split(":")
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
        return True
    except OSError:
        return False


def _wait(cond, timeout: float, what: str) -> None:
    t = time.time() + timeout
    while not cond():
        if time.time() > t:
            raise RuntimeError(what)
        time.sleep(0.5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="prepared dataset directory (with train/ and val/)")
    ap.add_argument("--storage", required=True, help="checkpoint storage URI (s3://... for a real drill)")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4, help="checkpoint interval")
    ap.add_argument("--kills", type=int, default=3, help="SIGKILLs of worker processes at random steps")
    # Node events may repeat (--lose-node-at 4 --lose-node-at 9): the elastic bench takes medians over them.
    ap.add_argument("--remove-node-at", type=int, action="append", default=[],
                    help="remove a worker's node at this step (a replacement joins first)")
    ap.add_argument("--lose-node-at", type=int, action="append", default=[],
                    help="remove a worker's node at this step with no replacement (spot capacity gone)")
    ap.add_argument("--add-node-at", type=int, action="append", default=[], help="a worker node joins at this step")
    ap.add_argument("--add-node-hold", type=float, default=0.0,
                    help="the step that adds a node lasts until it joined and this many seconds more")
    ap.add_argument("--nodes", type=int, default=2, help="worker nodes (one `trainer` slot each) at the start")
    ap.add_argument("--drain-at", type=int, action="append", default=[],
                    help="drain a worker's node for preemption at this step (a replacement joins after the notice)")
    ap.add_argument("--reclaim-at", type=int, action="append", default=[],
                    help="drain a worker's node for preemption at this step with no replacement")
    ap.add_argument("--remove-data-node-at", type=int, default=0,
                    help="add a CPU-only data node (data.reader=ray reads there) and remove it at this step")
    ap.add_argument("--drain-deadline", type=float, default=20.0, help="seconds from the drain to the node's end")
    ap.add_argument("--notices", action="store_true",
                    help="drains come from each node's notice watcher, reading a fake AWS metadata endpoint")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", action="store_true", help="also run without faults and compare")
    ap.add_argument("--baseline-run", default=None,
                    help="compare with this finished run of the same model, data, batch and steps instead of "
                         "training the baseline here (the test suite's session reference run)")
    ap.add_argument("--name", default="chaos")
    ap.add_argument("--out", default=None)
    ap.add_argument("override", nargs="*", help="extra dotted config overrides")
    args = ap.parse_args(argv)

    # Before Ray is imported, which reads them. Ray's token authentication: the nodes
    # and this driver must agree on the mode.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    # Drains polled every second (Ray Train's default: 5 s), so a drill's drain costs seconds less; Ray passes it on
    # to the controller and the workers.
    os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1")
    from raytrain.ray_auth import ensure_token

    ensure_token()  # its `ray start` nodes refuse to start without a token
    import ray

    from raytrain.trainer import train

    harness = Harness(args.drain_deadline, notices=args.notices)
    marker = os.path.join(tempfile.mkdtemp(prefix="raytrain-chaos-"), "event")
    rng = random.Random(args.seed)
    busy = {*args.remove_node_at, *args.drain_at, *args.reclaim_at, args.remove_data_node_at, *args.lose_node_at,
            *args.add_node_at}
    kill_steps = sorted(rng.sample([s for s in range(2, args.steps) if s not in busy], args.kills))
    events = [{"step": s, "rank": rng.randrange(2), "signal": "SIGKILL"} for s in kill_steps]
    # Rank 1's node, never rank 0's (whose records the drill reads).
    events += [{"step": s, "rank": 1, "signal": "REMOVE_NODE"} for s in args.remove_node_at]
    events += [{"step": s, "rank": 1, "signal": "DRAIN_NODE"} for s in args.drain_at]
    events += [{"step": s, "rank": 1, "signal": "DRAIN_NODE", "replace": False} for s in args.reclaim_at]
    events += [{"step": s, "rank": 1, "signal": "REMOVE_NODE", "replace": False} for s in args.lose_node_at]
    events += [{"step": s, "rank": 0, "signal": "ADD_NODE", "hold_s": args.add_node_hold} for s in args.add_node_at]
    if args.remove_data_node_at:
        events.append({"step": args.remove_data_node_at, "rank": 0, "signal": "REMOVE_DATA_NODE"})
    events.sort(key=lambda e: e["step"])
    result: dict = {"events": events}
    try:
        harness.up()
        ray.init(address=harness.address, log_to_driver=True)
        for _ in range(args.nodes):
            harness.add_node()
        if args.remove_data_node_at:
            harness.add_data_node()
        harness.watch(marker)
        if args.baseline and not args.baseline_run:
            cfg = _cfg(args, args.name + "-baseline", [])
            t = time.time()
            train(cfg, log=lambda *_: None)
            result["baseline_wall_s"] = time.time() - t
            args.baseline_run = cfg.run_uri
        if args.baseline_run:
            result["baseline"] = {s: {"loss": r["loss"], "crc": (r.get("batch_crc32"), r.get("content_checksum"))}
                                  for s, r in _records(args.baseline_run).items()}
        cfg = _cfg(args, args.name, [])
        t = time.time()
        summary = train(cfg, log=lambda *_: None, inject={"events": events, "marker": marker})
        result["chaos_wall_s"] = time.time() - t
        recs = _records(cfg.run_uri)
        result["chaos"] = {s: {"loss": r["loss"], "crc": (r.get("batch_crc32"), r.get("content_checksum"))}
                           for s, r in recs.items()}
        result["summary"] = summary
        result["run_uri"] = cfg.run_uri
        result["recovery"] = _recovery(cfg.run_uri, events, marker)
        result["harness"] = harness.log
        result["notice_watchers"] = {k: open(p).read() for k, p in harness.watcher_logs.items()}
    finally:
        ray.shutdown()
        harness.down()
    if args.baseline_run:
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
             if args.baseline_run else ""))
    return 0


def _recovery(run_uri: str, events: list[dict], marker: str) -> list[dict]:
    """Per fault: when it fired, the step the run resumed from, steps lost, seconds to the next step.

    Read from the run's history: every attempt's metrics lines carry wall-clock times; the resumed
    attempt's first line after the fault tells where it restarted.
    """
    from raytrain.rundir import ATTEMPTS, METRICS, RunDir

    hist = RunDir(run_uri).read_jsonl(ATTEMPTS)
    metrics = RunDir(run_uri).read_jsonl(METRICS)
    out = []
    for i, e in enumerate(events):
        fired = f"{marker}.{i}"
        if not os.path.exists(fired) or e["signal"] in ("REMOVE_DATA_NODE", "ADD_NODE"):  # (no worker is lost)
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
