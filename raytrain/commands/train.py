"""`raytrain train`: train a model (resuming the run when it has checkpoints) and print its summary."""

from __future__ import annotations

from raytrain.console import say
from raytrain.config import DEFAULT_RECIPE, no_recipe_line


def add_parser(subparsers):
    t = subparsers.add_parser("train", help="train a model (resumes if the run already has checkpoints)")
    t.add_argument("--config", "-c", default=None,
                   help=f"recipe name (tiny, gpt2-124m, ...) or path to a YAML file (default: {DEFAULT_RECIPE}, said)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 model.n_layer=4")
    return t


def run(args) -> int:
    from raytrain.config import load_config
    from raytrain.ray_connect import check_address
    from raytrain.trainer import train

    if args.config is None:
        say(f"[raytrain] {no_recipe_line()}")
    recipe = args.config or DEFAULT_RECIPE
    cfg = load_config(recipe, args.overrides)
    check_address("train", cfg.scaling.address)  # before the data is checked: the address is the first problem
    summary = train(cfg, submitted={"recipe": recipe, "overrides": list(args.overrides)})
    print(format_summary(summary))
    return 0


def format_summary(s: dict) -> str:
    """The run's summary.json as the box printed at the end of `raytrain train`."""
    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else str(v)

    return "\n".join([
        "=" * 64,
        f"raytrain run {s['run']} finished: {s['steps']} steps, {s['tokens_seen']:,} tokens, {s['wall_s']:.1f}s",
        f"  train loss      {f(s['final_loss'], '.4f')}",
        f"  val loss / ppl  {f(s['val_loss'], '.4f')} / {f(s['val_ppl'], '.2f')}"
        f"   (at step 0: ppl {f(s['initial_val_ppl'], '.2f')})",
        f"  throughput      {f(s['tokens_per_s'], ',.0f')} tokens/s",
        f"  checkpoint      {s['checkpoint']}",
        f"  run directory   {s['run_uri']}",
        "=" * 64,
    ])
