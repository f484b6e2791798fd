"""Command line: `raytrain train | prepare | data | ckpt | export | lineage | eval | generate | check | serve | audit | plan | tune | report | cost | config`. Thin: parse, call the component, print one-line errors."""

from __future__ import annotations

import argparse
import importlib
import sys

from raytrain.errors import UserError

# The subcommands, in --help order: raytrain/commands/<name>.py, each with add_parser(subparsers) and run(args).
COMMANDS = ("train", "prepare", "data", "ckpt", "export", "lineage", "eval", "generate", "check", "serve", "audit",
            "plan", "tune", "report", "cost", "config")
# These import DeepSpeed, which would announce the accelerator it guessed.
IMPORTS_DEEPSPEED = frozenset({"plan", "export", "eval", "generate", "check"})


def command(name: str):
    """The module of one subcommand."""
    return importlib.import_module(f"raytrain.commands.{name}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raytrain", description=__doc__)
    p.add_argument("--version", action="version", version=f"raytrain {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in COMMANDS:
        mod = command(name)
        mod.add_parser(sub).set_defaults(run=mod.run)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("raytrain")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    from raytrain.quiet import quiet_deepspeed, quiet_progress_bars, quiet_warnings

    args = build_parser().parse_args(argv)
    quiet_warnings()
    quiet_progress_bars()
    try:
        from raytrain.internals.registry import check_env

        check_env()
        if args.cmd in IMPORTS_DEEPSPEED:
            quiet_deepspeed()
        return args.run(args)
    except UserError as e:
        print(f"raytrain: error: {e}", file=sys.stderr)
        return getattr(e, "exit_status", 2)  # 3: an elastic run waited run.max_wait_for_capacity (docs/FAULT_TOLERANCE.md)
    except KeyboardInterrupt as e:
        print("raytrain: interrupted" + (f"; {e}" if str(e) else ""), file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`raytrain config | head`): as other commands in a pipe, no traceback. stdout now goes
        # to /dev/null, or Python's flush at exit raises the same error again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command a pipe's reader closed


if __name__ == "__main__":
    sys.exit(main())
