"""One module per `raytrain` subcommand, each with `add_parser(subparsers)` and `run(args) -> int` (table: raytrain.cli)."""
