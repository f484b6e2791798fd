"""`raytrain config`: the resolved config of a recipe + overrides (or the reference of every key) printed."""

from __future__ import annotations

from raytrain.config import DEFAULT_RECIPE, no_recipe_line


def add_parser(subparsers):
    c = subparsers.add_parser("config", help="print the resolved config")
    c.add_argument("--config", "-c", default=None,
                   help=f"recipe name or path to a YAML file (default: {DEFAULT_RECIPE}, said on the first line)")
    c.add_argument("--reference", action="store_true", help="print every config key as Markdown")
    c.add_argument("overrides", nargs="*")
    return c


def run(args) -> int:
    from raytrain.config import load_config, reference_markdown

    if args.reference:
        from raytrain.data.prepare import reference_markdown as prepare_keys

        print(reference_markdown())
        print(prepare_keys())
        return 0
    if args.config is None:
        print(f"# {no_recipe_line()}")
    cfg = load_config(args.config or DEFAULT_RECIPE, args.overrides)
    print(cfg.to_yaml(), end="")
    acc = "chosen at train start" if cfg.batch.micro_batch_size == "auto" else cfg.accumulation
    if cfg.scaling.elastic:
        acc = "per size, below"
    print(f"# derived: gradient_accumulation_steps={acc} global_batch_size={cfg.global_batch} "
          f"run_uri={cfg.run_uri}")
    if cfg.scaling.elastic:
        from raytrain.elastic.size_table import lines

        vocab = cfg.model.vocab_size
        print("\n".join("# " + line.removeprefix("[raytrain] ") for line in lines(cfg, _params(cfg, vocab))))
        if vocab is None:
            print("# (snapshot bytes: set model.vocab_size, or see the start-up lines of `raytrain train`)")
    return 0


def _params(cfg, vocab):
    """The model's parameter count where the vocabulary is known without reading data."""
    if vocab is None:
        return None
    from raytrain.sweep.memory_estimate import param_count

    return param_count(cfg, vocab)
