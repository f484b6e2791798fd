"""`raytrain data compare A B`: two prepared datasets checked for drift, printed as JSON."""

from __future__ import annotations

import json


def add_parser(subparsers):
    d = subparsers.add_parser("data", help="data tools: `data compare A B` checks two prepared datasets for drift")
    d.add_argument("action", choices=["compare"])
    d.add_argument("a", help="prepared dataset URI (the `out` of raytrain prepare)")
    d.add_argument("b", help="another prepared dataset URI")
    d.add_argument("--split", default="train", choices=["train", "val"])
    return d


def run(args) -> int:
    from raytrain.data.report import compare, drift_verdict

    out = compare(args.a, args.b, split=args.split)
    out["verdict"] = drift_verdict(out["ks_doc_tokens"])
    print(json.dumps(out, indent=1))
    return 0
