"""Elastic mechanisms, each repeated: a node lost without notice (a same-size restart onto a replacement vs a shrink
onto the nodes left), a reclaim with notice (a shrink), a node joining (a grow); steps redone and seconds without
steps, medians, by phase.

Runs scripts/chaos.py on a static local cluster of `ray start` nodes (one `trainer` slot each), host-memory snapshots
every step (and their peer copies), storage checkpoints rare, for each ZeRO stage asked:
  fixed     scaling.num_workers=N, --repeats nodes lost without notice, a replacement joining first
  elastic   scaling.num_workers=[1,N], --repeats times: a node lost for good (N -> N-1), a node joining (-> N); then
            --repeats reclaims with notice (N -> N-1), each followed by a join
Prints one line per mechanism (median, each value, steps redone) and the median seconds per phase of the fault
mechanisms; --json keeps every figure.

Usage: .venv/bin/python scripts/bench_elastic.py --data data/python-docs --storage s3://bucket/bench \
           [--workers 3] [--repeats 3] [--zero 2,3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY = ["model.n_layer=1", "model.hidden_size=32", "model.n_head=2", "model.seq_len=32", "batch.micro_batch_size=4",
        "optim.lr=3e-3", "optim.warmup_steps=2", "data.eval_samples=16", "checkpoint.memory_every_n_steps=1",
        "checkpoint.memory_peer_every_n_steps=1"]
GAP = 6  # steps between two events: the group trains a few steady steps after each restart


def _chaos(tmp: str, name: str, args: list[str], overrides: list[str]) -> dict:
    """One scripts/chaos.py run (its own cluster); its result, with the run directory's URI."""
    out = os.path.join(tmp, name + ".json")
    cmd = [sys.executable, str(ROOT / "scripts" / "chaos.py"), "--out", out, "--kills", "0", "--name", name, *args,
           *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed: " + (proc.stdout[-2000:] + proc.stderr[-2000:]))
    return json.loads(Path(out).read_text())


def _restarts(run_uri: str, fired: list[tuple[str, float]]) -> list[dict]:
    """Per event (signal, when it fired): the next worker group's resumed step, the previous group's last step
    (steps redone between them), seconds from the event to the first step and from the last step to it, by phase."""
    from benchkit.parts import restart_phases

    from raytrain.rundir import ATTEMPTS, METRICS, RunDir

    attempts = RunDir(run_uri).read_jsonl(ATTEMPTS)
    # When each kept step ended (a step that was redone has no line: the heartbeat's time of it stands in).
    ended = {int(r["step"]): r["time"] for r in RunDir(run_uri).read_jsonl(METRICS) if "loss" in r}
    rows = []
    for signal, t in fired:
        att = min((a for a in attempts if a["time"] > t), key=lambda a: a["time"], default=None)
        if att is None or not att.get("first_step_time"):
            rows.append({"signal": signal, "missing": True})
            continue
        prev = att.get("previous_progress") or {}
        last = prev.get("step")
        rows.append({"signal": signal, "world_size": att["world_size"], "resumed_step": att["resumed_step"],
                     "last_step": last, "redone": None if last is None else last - att["resumed_step"],
                     "event_to_first_step_s": round(att["first_step_time"] - t, 3),
                     "without_steps_s": round(att["first_step_time"] - ended.get(last, prev.get("step_time", 0)), 3)
                     if last is not None else None,
                     "phases": restart_phases(att, t)})
    return rows


def _fired(result: dict) -> list[tuple[str, float]]:
    """(signal, time) of each node event the harness carried out, in order: when the node was killed, got its
    notice or had joined."""
    return [(h["action"], h["at"]) for h in result.get("harness", []) if "error" not in h]


def _summary(label: str, rows: list[dict], key: str) -> dict:
    vals = [r[key] for r in rows if r.get(key) is not None]
    redone = [r["redone"] for r in rows if r.get("redone") is not None]
    med = statistics.median(vals) if vals else None
    print(f"  {label:46} median {med if med is None else round(med, 2)} s of "
          f"{', '.join(f'{v:.1f}' for v in vals)}; steps redone {redone}", flush=True)
    return {"mechanism": label, "median_s": med, "values_s": vals, "redone": redone, "measure": key}


def _phases(label: str, rows: list[dict]) -> dict:
    names = [n for n in (rows[0]["phases"] if rows else {}) if all(n in r.get("phases", {}) for r in rows)]
    med = {n: round(statistics.median(r["phases"][n] for r in rows), 2) for n in names}
    print(f"  {label:46} median by phase: " + ", ".join(f"{n} {v:.2f}" for n, v in med.items()), flush=True)
    return med


def bench(data: str, storage: str, tmp: str, *, workers: int, repeats: int, zero: int) -> dict:
    common = ["--data", data, "--storage", f"{storage}/z{zero}", "--every", "1000", *TINY,
              f"deepspeed.zero_stage={zero}", "run.max_failures=0", f"run.max_preemptions={4 * repeats}"]
    if zero == 3:
        common[common.index("--every") + 1] = str(GAP)  # ZeRO-3 changes size through a storage checkpoint
    steps_fixed = GAP * (repeats + 1)
    t = time.time()
    fixed_events = []
    for i in range(repeats):
        fixed_events += ["--remove-node-at", str(GAP * (i + 1))]
    fixed = _chaos(tmp, f"fixed-z{zero}", ["--nodes", str(workers), "--steps", str(steps_fixed), *fixed_events,
                                           *common[:4]], common[4:] + [f"scaling.num_workers={workers}"])
    print(f"  (fixed run {time.time() - t:.0f} s)", flush=True)
    events, step = [], 0
    for kind in ("--lose-node-at", "--reclaim-at"):
        for _ in range(repeats):
            step += GAP
            events += [kind, str(step)]
            step += GAP
            events += ["--add-node-at", str(step)]
    t = time.time()
    elastic = _chaos(tmp, f"elastic-z{zero}", ["--nodes", str(workers), "--steps", str(step + GAP), *events,
                                               "--add-node-hold", "8", *common[:4]],
                     common[4:] + [f"scaling.num_workers=[1,{workers}]", "batch.global_batch_size=12",
                                   "scaling.resize_monitor_s=2", "scaling.grow_stable_s=2"])
    print(f"  (elastic run {time.time() - t:.0f} s)", flush=True)
    f_rows = _restarts(fixed["run_uri"], _fired(fixed))
    e_rows = _restarts(elastic["run_uri"], _fired(elastic))
    lost = [r for r in e_rows if r["signal"] == "REMOVE_NODE"]
    reclaim = [r for r in e_rows if r["signal"] == "DRAIN_NODE"]
    grow = [r for r in e_rows if r["signal"] == "ADD_NODE"]
    print(f"ZeRO-{zero}, {workers} nodes:")
    out = {"zero": zero, "workers": workers, "fixed": f_rows, "elastic": e_rows, "figures": [
        _summary(f"lost node, same-size restart ({workers} -> {workers})", f_rows, "event_to_first_step_s"),
        _summary(f"lost node, shrink ({workers} -> {workers - 1})", lost, "event_to_first_step_s"),
        _summary(f"reclaim with notice, shrink ({workers} -> {workers - 1})", reclaim, "without_steps_s"),
        _summary(f"grow ({workers - 1} -> {workers}), time without steps", grow, "without_steps_s")]}
    out["phases"] = {"same-size restart": _phases("same-size restart", f_rows), "shrink": _phases("shrink", lost)}
    out["same_batches"] = {"fixed": fixed.get("same_batches"), "elastic": elastic.get("same_batches")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--storage", required=True, help="checkpoint storage URI (a local directory or s3://...)")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--zero", default="2", help="ZeRO stages, comma-separated")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    load = os.getloadavg()
    print(f"bench_elastic: {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load {load[0]:.2f} "
          f"{load[1]:.2f} {load[2]:.2f}", flush=True)
    results = {"time": time.time(), "cpus": os.cpu_count(), "load_before": load, "runs": []}
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-elastic-") as tmp:
        for z in (int(z) for z in args.zero.split(",")):
            results["runs"].append(bench(args.data, args.storage, tmp, workers=args.workers, repeats=args.repeats,
                                         zero=z))
    results["load_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
