"""`raytrain tune`: a Ray Tune sweep of training runs, from a tune config + dotted overrides."""

from __future__ import annotations


def add_parser(subparsers):
    tu = subparsers.add_parser("tune", help="Ray Tune sweep of training runs (micro-batch throughput, lr/warmup "
                               "with ASHA)")
    tu.add_argument("--config", "-c", required=True, help="tune config: tune_configs/NAME.yaml (or NAME)")
    tu.add_argument("--resume", action="store_true", help="continue the sweep whose driver died (Tuner.restore)")
    tu.add_argument("overrides", nargs="*", help="training keys (data.train=..., model.n_layer=2) or tune config "
                    "keys (budget.max_steps=20, microbatch.memory_cap_mb=4000)")
    return tu


def run(args) -> int:
    from raytrain.ray_connect import check_address
    from raytrain.sweep.run import run_sweep
    from raytrain.sweep.spec import load_spec, trial_config

    spec = load_spec(args.config, args.overrides)
    check_address("tune", trial_config(spec, {}).scaling.address)  # before the data is checked
    run_sweep(spec, resume=args.resume)
    return 0
