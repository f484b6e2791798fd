"""`raytrain cost`: a run's node time by market, money vs on-demand, preemptions and checkpoint interval."""

from __future__ import annotations

import json


def add_parser(subparsers):
    co = subparsers.add_parser("cost", help="node time by market, money vs on-demand, preemptions, lost steps and "
                               "the Young-Daly checkpoint interval of a run")
    co.add_argument("run_uri", help="run directory: <checkpoint.storage>/<run.name> (local path or s3://)")
    co.add_argument("overrides", nargs="*", help="prices, e.g. cost.spot_per_hour=0.3 cost.on_demand_per_hour=1.0")
    co.add_argument("--mtbf-hours", type=float, default=None, help="mean time between interruptions for the "
                    "Young-Daly interval (default: observed in this run)")
    co.add_argument("--json", action="store_true")
    return co


def run(args) -> int:
    from raytrain import storage
    from raytrain.rundir import CONFIG, RunDir
    from raytrain.config import load_tree
    from raytrain.cost import Prices, format_report, report

    run_uri = storage.absolute(args.run_uri)
    # Prices: the run's own saved config.yaml, then any cost.* overrides given here.
    saved = RunDir(run_uri).uri(CONFIG)
    cfg = load_tree(saved if storage.exists(saved) else None, args.overrides)
    c = cfg.cost
    r = report(run_uri, Prices(c.spot_per_hour, c.on_demand_per_hour, c.head_per_hour),
               mtbf_s=args.mtbf_hours * 3600 if args.mtbf_hours else None, prior_mtbf_s=cfg.checkpoint.mtbf_s)
    print(json.dumps(r, indent=1) if args.json else format_report(r))
    return 0
