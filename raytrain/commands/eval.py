"""`raytrain eval`: validation loss / perplexity (raytrain.evaluation) or lm-eval tasks (raytrain.eval_harness) on Ray."""

from __future__ import annotations

import json


def add_parser(subparsers):
    ev = subparsers.add_parser("eval", help="validation loss / perplexity, or lm-evaluation-harness tasks (--tasks), "
                                            "of a checkpoint or exported model, on Ray")
    ev.add_argument("--checkpoint", default=None, help="checkpoint directory URI")
    ev.add_argument("--model", default=None, help="or an exported model directory")
    ev.add_argument("--data", default=None, help="prepared validation split (default: the run's data.val)")
    ev.add_argument("--samples", type=int, default=None, help="sequences to score (default: as in training)")
    ev.add_argument("--workers", type=int, default=2, help="Ray tasks to spread the work over")
    ev.add_argument("--tasks", default=None, help="lm-evaluation-harness tasks, comma-separated (pip install "
                    "'raytrain[eval]'); results go to <run>/eval/<step>/<task>.json")
    ev.add_argument("--limit", type=int, default=None, help="--tasks: documents per task (the harness's --limit)")
    ev.add_argument("--num-fewshot", type=int, default=None, help="--tasks: few-shot examples per document")
    ev.add_argument("--include-path", default=None, help="--tasks: a directory of your own task YAMLs")
    ev.add_argument("--clean", default=None, help="--tasks: also score each task on its clean examples only (a "
                    "`raytrain data contamination --clean-out` file), reported as <task>/clean")
    ev.add_argument("--batch-size", type=int, default=1, help="--tasks: the harness's batch size (1: its CLI's default)")
    ev.add_argument("--json", action="store_true")
    return ev


def run(args) -> int:
    if args.tasks is not None:
        from raytrain.eval_harness import run_eval_command

        out = run_eval_command(args)
        if args.json:
            print(json.dumps(out, indent=1))
        return 0
    from raytrain.evaluation import evaluate

    out = evaluate(args.checkpoint, args.model, args.data, args.samples, args.workers)
    if args.json:
        print(json.dumps(out, indent=1))
    return 0
