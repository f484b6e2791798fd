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
"""

from __future__ import annotations

import argparse
import csv
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
    a = ap.parse_args(argv)

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
