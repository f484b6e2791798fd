"""What a run cost: node time by market from Ray's node list, preemptions, lost steps, checkpoint time, money, Young-Daly.

Two halves. During a run the driver keeps a `NodeRecorder` polling `ray.nodes()` and writing the
run's `nodes.json` (each node's type, market, first / last time seen alive, and whether it died while
the run went on). Afterwards `raytrain cost RUN_URI` reads that file with the run's attempts.jsonl,
metrics.jsonl (checkpoint stall times, step rate), summary.json and checkpoint manifests, prices it
with the `cost` config section, and prints the checkpoint interval that minimises expected lost time
(Young-Daly: sqrt(2 x checkpoint cost x mean time between interruptions)).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from raytrain import storage
from raytrain.rundir import ATTEMPTS, METRICS, NODES, SUMMARY, RunDir
from raytrain.errors import UserError
from raytrain.worker.interval import young_daly_s

def node_market(node: dict) -> str:
    """spot / on-demand for a `ray.nodes()` entry: Ray's market label where the cloud launcher sets it,
    else the `spot` / `ondemand` resource that raytrain's cluster configs give every worker type. A
    node with neither (a head, a laptop) is on-demand."""
    labels = node.get("Labels") or {}
    market = str(labels.get("ray.io/market-type", "")).lower()
    if market:
        return "spot" if "spot" in market else "on-demand"
    res = node.get("Resources") or {}
    return "spot" if res.get("spot", 0) > 0 else "on-demand"


def node_type(node: dict) -> str:
    labels = node.get("Labels") or {}
    for key in ("ray.io/node-group", "ray.io/node-type-name"):
        if labels.get(key):
            return str(labels[key])
    res = node.get("Resources") or {}
    if "node:__internal_head__" in res:
        return "head"
    return "spot" if res.get("spot", 0) > 0 else ("ondemand" if res.get("ondemand", 0) > 0 else "worker")


class NodeRecorder:
    """Driver-side: every `interval_s`, note which Ray nodes are alive; write nodes.json to the run dir.

    A node seen alive and later not (dead or gone) while the run went on is counted as lost: on a spot
    cluster that is an interruption. Started before `trainer.fit()`, stopped after it.
    """

    def __init__(self, run_uri: str, interval_s: float = 5.0):
        self.run_uri, self.interval_s = run_uri, interval_s
        self.nodes: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._t_start = time.time()
        uri = storage.join(run_uri, NODES)
        if storage.exists(uri):  # a resubmitted run adds to the same record
            try:
                self.nodes = {n["node_id"]: n for n in json.loads(storage.read_text(uri))["nodes"]}
            except (ValueError, KeyError):
                self.nodes = {}

    def poll(self) -> None:
        import ray

        now = round(time.time(), 3)
        for n in ray.nodes():
            nid = n["NodeID"]
            rec = self.nodes.get(nid)
            if n.get("Alive"):
                if rec is None:
                    rec = self.nodes[nid] = {"node_id": nid, "type": node_type(n), "market": node_market(n),
                                             "resources": {k: v for k, v in (n.get("Resources") or {}).items()
                                                           if not k.startswith("node:")},
                                             "first_seen": now, "lost": False}
                rec["last_seen"] = now
            elif rec is not None and not rec["lost"] and rec.get("last_seen", 0) >= self._t_start:
                rec["lost"], rec["lost_at"] = True, now
        # Nodes that vanished from the list entirely count as lost too.
        alive_or_known = {n["NodeID"] for n in ray.nodes()}
        for nid, rec in self.nodes.items():
            if nid not in alive_or_known and not rec["lost"] and rec.get("last_seen", 0) >= self._t_start:
                rec["lost"], rec["lost_at"] = True, now

    def write(self) -> None:
        storage.write_text(storage.join(self.run_uri, NODES),
                           json.dumps({"nodes": sorted(self.nodes.values(), key=lambda r: r["first_seen"])}, indent=1))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
                self.write()
            except Exception:  # noqa: BLE001 - accounting must never take a training run down
                pass

    def __enter__(self) -> "NodeRecorder":
        try:
            self.poll()
        except Exception:  # noqa: BLE001
            pass
        self._thread = threading.Thread(target=self._run, name="raytrain-node-recorder", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        try:
            self.poll()
            self.write()
        except Exception:  # noqa: BLE001
            pass


def _node_hours_by_size(run_uri: str, nodes: list[dict]) -> dict[int, dict[str, float]]:
    """Worker node-hours by the run's world size at the time and by market: each attempt of the goodput ledger, from
    its start (or restart) to its last step, against each node's time alive (nodes.json)."""
    from raytrain.goodput import ledger

    g = ledger(run_uri)
    out: dict[int, dict[str, float]] = {}
    for a in (g or {}).get("attempts", []):
        row = out.setdefault(int(a["world_size"] or 0), {})
        for n in nodes:
            if n["type"] == "head":
                continue
            t = min(a["end"], n.get("last_seen", n["first_seen"])) - max(a["start"], n["first_seen"])
            if t > 0:
                row[n["market"]] = row.get(n["market"], 0.0) + t / 3600
    return out


def _committed_time(run_uri: str, step: int) -> Optional[float]:
    """When the checkpoint at `step` was committed (its manifest), if it is still there."""
    from raytrain.ckpt.layout import MANIFEST, dir_name, parse_timestamp

    uri = storage.join(run_uri, dir_name(step), MANIFEST)
    if not storage.exists(uri):
        return None
    try:
        # UTC, as written: a local-time conversion is an hour off wherever the zone has daylight saving.
        return parse_timestamp(json.loads(storage.read_text(uri))["committed"])
    except (ValueError, KeyError):
        return None


@dataclass
class Prices:
    spot_per_hour: float
    on_demand_per_hour: float
    head_per_hour: float

    def of(self, rec: dict) -> float:
        if rec["type"] == "head":
            return self.head_per_hour
        return self.spot_per_hour if rec["market"] == "spot" else self.on_demand_per_hour


def _lost_steps(resumed: int, lost_s: float, t_fail: float, beat: Optional[dict], step_s: Optional[float]) -> dict:
    """Steps trained past the resumed checkpoint and thrown away.

    From the failed attempt's heartbeat when it left one: the step it reached, plus the whole steps it
    could have done unrecorded (a new step is written within `every_s`), unless the beat says the loop
    had stopped (stuck, saving, or waiting on a dead peer: that time was not spent on steps). Heartbeats
    say so themselves (`stalled`, written as soon as the loop stops); older ones are judged by their age
    alone, which misses a stop that began less than `every_s` before the last write. Else lost time at
    the median step rate, which overstates steps when the attempt was slow or stuck before it failed.
    """
    if beat:
        every = float(beat.get("every_s", 2.0))
        stuck = bool(beat["stalled"]) if "stalled" in beat else \
            beat["time"] - beat.get("step_time", beat["time"]) > max(every, 3 * (step_s or 0))
        unseen = 0 if (stuck or not step_s) else int(min(max(0.0, t_fail - beat["time"]), every) / step_s)
        seen = max(0, beat["step"] - resumed)
        # Never more than the lost time allows at the run's pace.
        cap = max(seen, round(lost_s / step_s)) if step_s else seen
        return {"lost_steps": min(seen + unseen, cap), "lost_steps_from": "heartbeat"}
    return {"lost_steps": round(lost_s / step_s) if step_s else None, "lost_steps_from": "time"}


def report(run_uri: str, prices: Prices, mtbf_s: Optional[float] = None,
           prior_mtbf_s: Optional[float] = None) -> dict[str, Any]:
    """Everything `raytrain cost` prints, as numbers. MTBF: `mtbf_s` if given, else the one observed,
    else `prior_mtbf_s` (the run's `checkpoint.mtbf_s`, what an auto interval starts from)."""
    if not storage.exists(run_uri):
        raise UserError(f"run directory not found: {run_uri}")
    rd = RunDir(run_uri)
    summary = rd.read_json(SUMMARY) or {}
    nodes = (rd.read_json(NODES) or {}).get("nodes", [])
    attempts = rd.read_jsonl(ATTEMPTS)
    metrics = rd.read_jsonl(METRICS)
    if not (summary or nodes or attempts or metrics):
        raise UserError(f"{run_uri} has no summary.json, nodes.json, attempts.jsonl or metrics.jsonl: not a raytrain run")

    by_market: dict[str, dict[str, float]] = {}
    for n in nodes:
        hours = max(0.0, n.get("last_seen", n["first_seen"]) - n["first_seen"]) / 3600
        row = by_market.setdefault(n["market"] if n["type"] != "head" else "on-demand (head)",
                                   {"nodes": 0, "node_hours": 0.0, "cost": 0.0, "on_demand_cost": 0.0})
        row["nodes"] += 1
        row["node_hours"] += hours
        row["cost"] += hours * prices.of(n)
        row["on_demand_cost"] += hours * (prices.head_per_hour if n["type"] == "head" else prices.on_demand_per_hour)
    spent = sum(r["cost"] for r in by_market.values())
    on_demand = sum(r["on_demand_cost"] for r in by_market.values())
    lost_nodes = [n for n in nodes if n.get("lost") and n["type"] != "head"]

    # Seconds per step: median logged token rate (robust to the warm-up window), else wall / steps.
    steps = summary.get("steps") or max((r.get("step", 0) for r in metrics), default=0)
    step_s = None
    tok_rates = sorted(r["tokens_per_s"] for r in metrics if isinstance(r.get("tokens_per_s"), (int, float)))
    if tok_rates and summary.get("tokens_seen") and steps:
        step_s = summary["tokens_seen"] / steps / tok_rates[len(tok_rates) // 2]
    elif summary.get("wall_s") and steps:
        step_s = summary["wall_s"] / steps

    # Restarts and the work each one threw away: steps trained after the checkpoint it resumed from,
    # up to the failure (node loss seen by the recorder, else the restart itself).
    restarts = []
    for prev, cur in zip(attempts, attempts[1:]):
        t_fail = cur["time"]
        lost_in_between = [n["lost_at"] for n in lost_nodes if prev.get("first_step_time", prev["time"]) <= n["lost_at"] <= cur["time"]]
        if lost_in_between:
            t_fail = min(lost_in_between)
        beat = cur.get("previous_progress")
        if beat and beat.get("time", 0) < prev["time"]:
            beat = None  # older than the failed attempt (it died before its first beat): not its progress
        if beat:
            # The failed attempt's own heartbeat: it failed before the next write was due (or earlier,
            # when a node loss stopped another rank while rank 0 kept beating).
            t_fail = min(t_fail, beat["time"] + float(beat.get("refresh_s", beat.get("every_s", 2.0))))
        t_ckpt = _committed_time(run_uri, cur["resumed_step"]) if cur["resumed_step"] else None
        t_from = max(t for t in (t_ckpt, prev.get("first_step_time"), prev["time"]) if t is not None)
        lost_s = max(0.0, t_fail - t_from)
        restarts.append({"resumed_step": cur["resumed_step"], "lost_s": round(lost_s, 1),
                         **_lost_steps(cur["resumed_step"], lost_s, t_fail, beat, step_s),
                         "recovery_s": round(cur.get("first_step_time", cur["time"]) - t_fail, 1)})

    by_size = _node_hours_by_size(run_uri, nodes)
    ckpt_costs = [r["ckpt_stall_s"] for r in metrics if isinstance(r.get("ckpt_stall_s"), (int, float))]
    ckpt_cost_s = sum(ckpt_costs) / len(ckpt_costs) if ckpt_costs else None
    preemptions = max(len(lost_nodes), len(restarts))
    run_s = (max((n.get("last_seen", 0) for n in nodes), default=0) - min((n["first_seen"] for n in nodes), default=0)) \
        if nodes else (summary.get("wall_s") or 0)
    observed_mtbf = run_s / preemptions if preemptions else None
    mtbf = mtbf_s or observed_mtbf or prior_mtbf_s
    yd_s = young_daly_s(ckpt_cost_s, mtbf) if (ckpt_cost_s and mtbf) else None
    return {
        "run_uri": run_uri, "steps": steps, "by_market": by_market, "by_size": by_size, "cost": spent, "on_demand_cost": on_demand,
        "savings": on_demand - spent, "preemptions": preemptions, "nodes_lost": len(lost_nodes),
        "restarts": restarts, "lost_steps": sum(r["lost_steps"] or 0 for r in restarts),
        "checkpoints": len(ckpt_costs), "checkpoint_cost_s": ckpt_cost_s,
        "checkpoint_time_s": sum(ckpt_costs), "step_s": step_s, "mtbf_s": mtbf,
        "mtbf_source": "given" if mtbf_s else "observed" if observed_mtbf else "checkpoint.mtbf_s" if prior_mtbf_s else None,
        "young_daly_s": yd_s, "young_daly_steps": max(1, round(yd_s / step_s)) if (yd_s and step_s) else None,
        "prices": prices.__dict__,
    }


def format_report(r: dict) -> str:
    def money(x: float) -> str:
        return f"${x:,.4f}" if x < 1 else f"${x:,.2f}"

    lines = [f"cost of run {r['run_uri']} ({r['steps']} steps)",
             f"  {'market':18} {'nodes':>5} {'node-hours':>11} {'cost':>10} {'on-demand':>10}"]
    for market, row in sorted(r["by_market"].items()):
        lines.append(f"  {market:18} {row['nodes']:>5} {row['node_hours']:>11.4f} {money(row['cost']):>10} "
                     f"{money(row['on_demand_cost']):>10}")
    if not r["by_market"]:
        lines.append("  (no nodes.json: node time was not recorded for this run)")
    if r.get("by_size"):
        lines.append("  worker node-hours by the run's size: " + "; ".join(
            f"{w} workers: " + ", ".join(f"{m} {h:.4f}" for m, h in sorted(row.items())) for w, row in
            sorted(r["by_size"].items())))
    p = r["prices"]
    lines += [f"  spent {money(r['cost'])}; the same node time on on-demand {money(r['on_demand_cost'])} "
              f"(saved {money(r['savings'])}); prices per hour: spot {p['spot_per_hour']}, on-demand "
              f"{p['on_demand_per_hour']}, head {p['head_per_hour']} (cost.* config)",
              f"  preemptions {r['preemptions']} (worker nodes lost {r['nodes_lost']}, restarts {len(r['restarts'])}); "
              f"lost steps {r['lost_steps']}"]
    for i, x in enumerate(r["restarts"], 1):
        how = "from its heartbeat" if x.get("lost_steps_from") == "heartbeat" else "estimated from the median step rate"
        lines.append(f"    restart {i}: resumed at step {x['resumed_step']}, lost {x['lost_s']}s of work "
                     f"({x['lost_steps']} steps, {how}), back training {x['recovery_s']}s after the failure")
    ck = r["checkpoint_cost_s"]
    lines.append(f"  checkpoints {r['checkpoints']}, training paused {r['checkpoint_time_s']:.1f}s in total"
                 + (f" ({ck:.2f}s each)" if ck else ""))
    if r["young_daly_s"]:
        lines.append(f"  Young-Daly checkpoint interval: sqrt(2 x {ck:.2f}s x MTBF {r['mtbf_s']:.0f}s ({r['mtbf_source']})) "
                     f"= {r['young_daly_s']:.0f}s" + (f" = checkpoint.every_n_steps={r['young_daly_steps']} "
                                                       f"at {r['step_s']:.2f}s/step" if r["young_daly_steps"] else ""))
        if r["mtbf_source"] == "checkpoint.mtbf_s":
            lines.append("    (no interruption observed: the MTBF is the run's checkpoint.mtbf_s; pass --mtbf-hours "
                         "for your provider's interruption rate)")
        lines.append("    (checkpoint.every_n_steps=auto recomputes this during the run from its own measurements)")
    else:
        why = "no checkpoint cost measured" if not ck else "no interruption observed (pass --mtbf-hours)"
        lines.append(f"  Young-Daly checkpoint interval: n/a ({why})")
    return "\n".join(lines)
