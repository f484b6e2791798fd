"""`raytrain eval`: validation loss / perplexity of a checkpoint or exported model on Ray tasks (raytrain.evaluation)."""

from __future__ import annotations

import json


def add_parser(subparsers):
    ev = subparsers.add_parser("eval", help="validation loss / perplexity of a checkpoint or exported model, on Ray")
    ev.add_argument("--checkpoint", default=None, help="checkpoint directory URI")
    ev.add_argument("--model", default=None, help="or an exported model directory")
    ev.add_argument("--data", default=None, help="prepared validation split (default: the run's data.val)")
    ev.add_argument("--samples", type=int, default=None, help="sequences to score (default: as in training)")
    ev.add_argument("--workers", type=int, default=2, help="Ray tasks to spread the work over")
    ev.add_argument("--json", action="store_true")
    return ev


def run(args) -> int:
    from raytrain.evaluation import evaluate

    out = evaluate(args.checkpoint, args.model, args.data, args.samples, args.workers)
    if args.json:
        print(json.dumps(out, indent=1))
    return 0
