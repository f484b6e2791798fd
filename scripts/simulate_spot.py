#!/usr/bin/env python
"""Spot-interruption simulator: wall time, money and work lost for checkpoint policies, past one machine.

Replays interruptions (Poisson at a per-node rate, or the times in a CSV trace) over a run that needs
WORK hours of training on N spot workers, where a checkpoint pauses training for C seconds and every
interruption costs R seconds to replace the node and restart. Policies compared:
  fixed      checkpoint every --fixed-minutes of training
  young-daly every sqrt(2 C MTBF), MTBF = 1 / (N x rate)   (what `raytrain cost` prints)
  notice     young-daly, plus a checkpoint on the interruption notice when the notice is >= C
Prints a Markdown table (means over --trials runs) - the one in docs/CLUSTERS.md.

    python scripts/simulate_spot.py --work-hours 24 --workers 8 --rate-per-node-hour 0.05 --ckpt-seconds 60
    python scripts/simulate_spot.py --trace interruptions.csv    # one column: hours since start

With --capacity it models instead a run over a capacity trace in the format of the public spot traces
({"metadata": {"gap_seconds"}, "data": [nodes per tick]}, the format of scripts/spot_replay.py): an elastic run
(--workers-range MIN MAX, sizes that divide --global-batch) and a fixed one at MAX, each step, restart and resize
costing what --calibrate measured in a replay (spot_replay.py --out JSON: seconds per step at each size, seconds of a
start, a restart after a lost node and a resize). Weeks of a trace take seconds:

    python scripts/simulate_spot.py --capacity trace.json --calibrate replay.json --workers-range 1 4 \
        --global-batch 24 --tick-s 15 --monitor-s 5 --grow-stable-s 5
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import sys


def simulate(work_s: float, interval_s: float, ckpt_s: float, restart_s: float, arrivals: list[float],
             notice_s: float = 0.0, use_notice: bool = False) -> tuple[float, float, int]:
    """One run. Returns (wall seconds, training seconds lost, interruptions suffered)."""
    t, done, saved, lost, hits = 0.0, 0.0, 0.0, 0.0, 0
    next_ckpt = interval_s
    arrivals = iter(sorted(arrivals))
    nxt = next(arrivals, math.inf)
    while done < work_s:
        # Train until the next checkpoint or the end, unless an interruption comes first.
        target = min(next_ckpt, work_s)
        need = target - done
        if t + need <= nxt:
            t += need
            done = target
            if done < work_s:  # a periodic checkpoint (the final one is not counted against policies)
                if t + ckpt_s > nxt:  # interrupted while checkpointing: the checkpoint is lost
                    lost += done - saved
                    t, done = nxt + restart_s, saved
                    hits += 1
                    nxt = next(arrivals, math.inf)
                    next_ckpt = done + interval_s
                    continue
                t += ckpt_s
                saved = done
                next_ckpt = done + interval_s
            continue
        # Interrupted mid-training.
        done += nxt - t
        t = nxt
        hits += 1
        if use_notice and notice_s >= ckpt_s:
            t += ckpt_s  # checkpoint inside the notice window: nothing lost
            saved = done
        else:
            lost += done - saved
            done = saved
        t += restart_s
        next_ckpt = done + interval_s
        nxt = next(arrivals, math.inf)
        while nxt < t:  # interruptions during the restart hit the new node, not progress
            nxt = next(arrivals, math.inf)
    return t, lost, hits


def calibration(path: str) -> dict:
    """From spot_replay.py's output: seconds per step at each size and seconds of a start, restart and resize (its
    elastic run's goodput ledger: productive seconds and steps of each attempt, the gaps before first steps), and
    seconds per node join (the replay's node log: one `ray start` at a time)."""
    with open(path) as f:
        replay = json.load(f)
    run = next(r for r in replay["runs"] if r["label"] == "elastic")
    g = run["ledger"]
    per_size: dict[int, list[float]] = {}  # [seconds, steps] of the attempts at each size
    gaps: dict[str, list[float]] = {}
    for a in g["attempts"]:
        if a.get("steps"):
            acc = per_size.setdefault(int(a["world_size"]), [0.0, 0])
            acc[0] += a["productive"] + a["data_wait"] + a["checkpoint_stall"] + a.get("evaluation", 0.0)
            acc[1] += a["steps"]
        gaps.setdefault(a["kind"], []).append(a["gap_s"])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    # The shortest gap of each kind: a longer one spans a wait or a group that failed before its first step, which
    # the model plays out itself.
    restart = min(gaps.get("restart") or gaps["start"])
    joins, since = [], None
    for e in run.get("nodes", []):  # a tick entry, then its node events in the order they happened
        if "tick" in e:
            since = e["time"]
        elif e.get("joined") and since is not None:
            joins.append(e["time"] - since)
            since = e["time"]
    # Per size, seconds over steps of all its attempts: an attempt of a few steps (a spell that ended soon after
    # the group started) weighs what its steps weigh, not as much as one that trained for minutes.
    return {"step_s": {n: t / k for n, (t, k) in per_size.items()}, "start_s": mean(gaps["start"]),
            "restart_s": restart, "resize_s": min(gaps.get("resize") or [restart]),
            "join_s": mean(joins) if joins else 0.0}


def step_seconds(cal: dict, n: int) -> float:
    """Seconds per step at size n: measured, else scaled from the nearest measured size as compute / n."""
    if n in cal["step_s"]:
        return cal["step_s"][n]
    near = min(cal["step_s"], key=lambda m: abs(m - n))
    return cal["step_s"][near] * near / n


def node_events(ticks: list[int], tick_s: float, join_s: float, notice_every: int) -> list[tuple[float, int, bool]]:
    """(time, +1 joins / -1 leaves, with notice) of each node as a replay moves them: leaves at the tick, the newest
    first, every notice_every-th with a notice; joins one after another, join_s each (the first tick's nodes are
    there when the run starts)."""
    out, alive, removed = [], 0, 0
    for i, target in enumerate(ticks):
        t = i * tick_s
        while alive > target:
            alive -= 1
            removed += 1
            out.append((t, -1, bool(notice_every) and removed % notice_every == 0))
        k = 0
        while alive < target:
            alive += 1
            k += 1
            out.append((t + k * join_s if i else 0.0, 1, False))
    return sorted(out)


def capacity_run(ticks: list[int], tick_s: float, sizes: list[int], cal: dict, *, monitor_s: float,
                 grow_stable_s: float, notice_every: int, redo_steps: float = 1.0, dt: float = 0.25) -> dict:
    """Steps a run with these usable sizes (one size: a fixed run) trains over a capacity trace, second by second as
    raytrain's controller decides: a node lost takes its group down (restart_s; redo_steps steps redone without a
    notice: the host-memory snapshot interval; none with one), the group restarts at the largest usable size the
    nodes left hold, below the smallest it waits and starts again (start_s) when nodes are back; a running group
    looks every monitor_s for nodes alive grow_stable_s and grows onto them (resize_s, nothing redone)."""
    events = node_events(ticks, tick_s, cal.get("join_s", 0.0), notice_every)
    end = len(ticks) * tick_s
    fit = lambda n: max((m for m in sizes if m <= n), default=0)  # noqa: E731
    joined: list[float] = []  # join times of the nodes alive, oldest first
    t, steps, size, busy_until, next_look, i = 0.0, 0.0, 0, 0.0, 0.0, 0
    out = {"restarts": 0, "resizes": 0, "redone": 0.0, "waiting_s": 0.0}
    while t < end:
        lost = False
        while i < len(events) and events[i][0] <= t:
            _, d, noticed = events[i]
            i += 1
            if d > 0:
                joined.append(events[i - 1][0])
                continue
            joined.pop()
            if size and len(joined) < size:  # a node of the group went (nodes going together: one restart)
                if not noticed and not lost and t >= busy_until:
                    out["redone"] += min(redo_steps, steps)
                    steps -= min(redo_steps, steps)
                lost = True
        if lost:
            size = fit(len(joined))
            out["restarts"] += 1
            busy_until, next_look = t + cal["restart_s"], t + cal["restart_s"] + monitor_s
        elif size == 0 and fit(len(joined)):
            size = fit(len(joined))  # capacity back (or the first start)
            busy_until = t + (cal["start_s"] if t == 0 else cal["restart_s"])
            next_look = busy_until + monitor_s
        elif size and t >= busy_until and t >= next_look:
            next_look = t + monitor_s
            grow = fit(sum(1 for j in joined if t - j >= grow_stable_s))
            if grow > size:
                size, busy_until = grow, t + cal["resize_s"]
                next_look = busy_until + monitor_s
                out["resizes"] += 1
        if size == 0:
            out["waiting_s"] += dt
        elif t >= busy_until:
            steps += dt / step_seconds(cal, size)
        t += dt
    return {**out, "steps": int(steps)}


def capacity_main(a) -> int:
    with open(a.capacity) as f:
        trace = json.load(f)
    ticks = [int(v) for v in trace["data"]]
    if a.segment:
        lo, hi = (int(x) if x else None for x in a.segment.split(":"))
        ticks = ticks[lo:hi]
    lo_n, hi_n = a.workers_range
    ticks = [min(v, hi_n) for v in ticks]
    cal = calibration(a.calibrate)
    if a.join_s is not None:
        cal["join_s"] = a.join_s
    sizes = [n for n in range(lo_n, hi_n + 1) if a.global_batch % n == 0]
    print(f"capacity trace {a.capacity} ({len(ticks)} ticks of {a.tick_s:g} s), sizes {sizes}, calibrated on "
          f"{a.calibrate}: step s {', '.join(f'{n}: {s:.3f}' for n, s in sorted(cal['step_s'].items()))}, "
          f"start {cal['start_s']:.1f} s, restart {cal['restart_s']:.1f} s, resize {cal['resize_s']:.1f} s, "
          f"node join {cal['join_s']:.1f} s")
    print("| run | steps | restarts | resizes | steps redone | waiting (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, usable in (("elastic", sizes), ("fixed", [hi_n])):
        r = capacity_run(ticks, a.tick_s, usable, cal, monitor_s=a.monitor_s, grow_stable_s=a.grow_stable_s,
                         notice_every=a.notice_every, redo_steps=a.redo_steps, dt=max(0.25, a.tick_s / 200))
        print(f"| {name} | {r['steps']} | {r['restarts']} | {r['resizes']} | {r['redone']:.0f} | {r['waiting_s']:.0f} |")
    return 0


def poisson(rate_per_s: float, horizon_s: float, rng: random.Random) -> list[float]:
    out, t = [], 0.0
    while rate_per_s > 0:
        t += rng.expovariate(rate_per_s)
        if t > horizon_s:
            return out
        out.append(t)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-hours", type=float, default=24.0, help="training time the run needs without interruptions")
    ap.add_argument("--workers", type=int, default=8, help="spot worker nodes (one interruption stops all of them)")
    ap.add_argument("--rate-per-node-hour", type=float, default=0.05, help="interruptions per spot node-hour")
    ap.add_argument("--trace", help="CSV of interruption times in hours since start (replaces --rate-per-node-hour)")
    ap.add_argument("--ckpt-seconds", type=float, default=60.0, help="training paused per checkpoint")
    ap.add_argument("--restart-seconds", type=float, default=300.0, help="replacement node + restart + resume")
    ap.add_argument("--notice-seconds", type=float, default=120.0, help="interruption notice (AWS 120, GCP 30)")
    ap.add_argument("--fixed-minutes", type=float, default=60.0, help="the fixed policy's interval")
    ap.add_argument("--spot-per-hour", type=float, default=0.45, help="USD per spot worker-hour (example g5.xlarge)")
    ap.add_argument("--on-demand-per-hour", type=float, default=1.006, help="USD per on-demand worker-hour")
    ap.add_argument("--head-per-hour", type=float, default=0.384, help="USD per head-hour (on-demand)")
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacity", help="capacity trace JSON (spot-traces format): model elastic vs fixed runs on it")
    ap.add_argument("--calibrate", help="--capacity: spot_replay.py --out JSON to take step and restart seconds from")
    ap.add_argument("--segment", default=None, help="--capacity: ticks START:END")
    ap.add_argument("--tick-s", type=float, default=300.0, help="--capacity: seconds per tick (a replay's --tick-s)")
    ap.add_argument("--workers-range", type=int, nargs=2, default=[1, 4], metavar=("MIN", "MAX"))
    ap.add_argument("--global-batch", type=int, default=24, help="--capacity: usable sizes divide it")
    ap.add_argument("--notice-every", type=int, default=2, help="--capacity: every k-th node lost comes with a notice")
    ap.add_argument("--monitor-s", type=float, default=30.0, help="--capacity: scaling.resize_monitor_s")
    ap.add_argument("--grow-stable-s", type=float, default=30.0, help="--capacity: scaling.grow_stable_s")
    ap.add_argument("--redo-steps", type=float, default=1.0, help="--capacity: steps redone after a node lost without "
                    "notice (checkpoint.memory_every_n_steps; with memory snapshots off, about half the checkpoint "
                    "interval)")
    ap.add_argument("--join-s", type=float, default=None, help="--capacity: seconds a node takes to join (default: "
                    "the replay's)")
    a = ap.parse_args(argv)
    if a.capacity:
        if not a.calibrate:
            raise SystemExit("simulate_spot: --capacity needs --calibrate REPLAY.json (scripts/spot_replay.py --out)")
        return capacity_main(a)

    work_s, c, r = a.work_hours * 3600, a.ckpt_seconds, a.restart_seconds
    rate = a.workers * a.rate_per_node_hour / 3600  # per second, for the whole job
    trace = None
    if a.trace:
        with open(a.trace) as f:
            trace = [float(row[0]) * 3600 for row in csv.reader(f) if row and row[0].strip()[0].isdigit()]
        rate = len(trace) / max(trace[-1], 1.0) if trace else 0.0
    mtbf = 1 / rate if rate > 0 else math.inf
    yd = math.sqrt(2 * c * mtbf) if math.isfinite(mtbf) else work_s
    policies = [("fixed", a.fixed_minutes * 60, False), ("young-daly", yd, False), ("notice", yd, True)]
    per_hour = a.workers * a.spot_per_hour + a.head_per_hour
    od_wall = work_s + (math.ceil(work_s / (a.fixed_minutes * 60)) - 1) * c  # no interruptions: the fixed interval
    od_cost = od_wall / 3600 * (a.workers * a.on_demand_per_hour + a.head_per_hour)

    print(f"inputs: {a.work_hours:g} h of training on {a.workers} spot workers, "
          + (f"trace {a.trace} ({len(trace)} interruptions)" if trace is not None else
             f"{a.rate_per_node_hour:g} interruptions per node-hour (job MTBF {mtbf / 60:.0f} min)")
          + f", checkpoint {c:g} s, restart {r:g} s, notice {a.notice_seconds:g} s, prices spot ${a.spot_per_hour}/h "
          f"on-demand ${a.on_demand_per_hour}/h head ${a.head_per_hour}/h, {a.trials if trace is None else 1} trials\n")
    print("| policy | checkpoint every | wall time (h) | work lost (h) | interruptions | cost | vs on-demand |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, interval, notice in policies:
        rng = random.Random(a.seed)  # the same interruption sequences for every policy
        walls, losts, hits = [], [], []
        for _ in range(1 if trace is not None else a.trials):
            arrivals = trace if trace is not None else poisson(rate, work_s * 20, rng)
            w, lo, h = simulate(work_s, interval, c, r, arrivals, a.notice_seconds, notice)
            walls.append(w)
            losts.append(lo)
            hits.append(h)
        wall = sum(walls) / len(walls)
        cost = wall / 3600 * per_hour
        print(f"| {name} | {interval / 60:.1f} min | {wall / 3600:.2f} | {sum(losts) / len(losts) / 3600:.2f} | "
              f"{sum(hits) / len(hits):.1f} | ${cost:,.0f} | {cost / od_cost:.0%} |")
    print(f"| on-demand (no interruptions) | {a.fixed_minutes:.1f} min | {od_wall / 3600:.2f} | 0.00 | 0 | ${od_cost:,.0f} | 100% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
