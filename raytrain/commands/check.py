"""`raytrain check`: the release gate of an exported model, or with --url the HTTP launch check of a running server."""

from __future__ import annotations

import json

from raytrain.errors import UserError


def add_parser(subparsers):
    ch = subparsers.add_parser("check", help="release gate for an exported model: load, parameter count, generation, "
                               "latency; with --url the HTTP launch check of a running server (exit 1 on failure)")
    ch.add_argument("model_dir", nargs="?", default=None, help="exported model directory (local or s3://); with "
                    "--url: the offline model to compare with (default: the served version's source)")
    ch.add_argument("--expect-params", type=int, default=None, help="default: the count recorded at export")
    ch.add_argument("--prompt", default="The")
    ch.add_argument("-n", type=int, default=20, help="timed generations for p50 / p99 latency")
    ch.add_argument("--max-new-tokens", type=int, default=16)
    ch.add_argument("--max-p99-ms", type=float, default=None, help="fail if p99 latency exceeds this (--url: default 500)")
    ch.add_argument("--data", default=None, help="also check perplexity on this prepared val split against training's")
    ch.add_argument("--max-loss-diff", type=float, default=1e-3, help="allowed |val loss - reported| with --data")
    ch.add_argument("--json", action="store_true")
    ch.add_argument("--url", default=None, help="HTTP(S) launch check of a running `raytrain serve`: health, one predict, "
                    "consistency with the offline model, load test")
    ch.add_argument("--requests", type=int, default=200, help="--url: load-test requests")
    ch.add_argument("--concurrency", type=int, default=8, help="--url: requests in flight at once")
    ch.add_argument("--samples", type=int, default=8, help="--url: held-out samples for the consistency check")
    ch.add_argument("--timeout", type=float, default=300.0, help="--url: the whole check's time bound (s)")
    ch.add_argument("--report-dir", default="launch-check", help="--url: where launch_check.json and .md go")
    ch.add_argument("--ca-bundle", default=None, metavar="CA", help="--url https://...: verify the server with this "
                    "CA certificate (PEM; default: the system's trust store)")
    return ch


def run(args) -> int:
    if args.url:
        return _url_check(args)
    if args.ca_bundle:
        raise UserError("--ca-bundle is for check --url https://... (a running server)")
    if not args.model_dir:
        raise UserError("check needs MODEL_DIR (an exported model) or --url URL (a running `raytrain serve`)")
    from raytrain.lineage import model_id
    from raytrain.release_check import run_checks

    out = run_checks(args.model_dir, expect_params=args.expect_params, prompt=args.prompt, n=args.n,
                     max_new_tokens=args.max_new_tokens, max_p99_ms=args.max_p99_ms, data=args.data,
                     max_loss_diff=args.max_loss_diff)
    out["lineage"] = model_id(args.model_dir)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for c in out["checks"]:
            print(f"{'PASS' if c['ok'] else 'FAIL'}  {c['name']:10} {c['detail']}")
        print(f"lineage {out['lineage']} (`raytrain lineage {args.model_dir}`)" if out["lineage"] else
              "lineage none recorded (exported before lineage.json; export it again to record one)")
        print(f"{'release check passed' if out['ok'] else 'release check FAILED'}: {args.model_dir}")
    return 0 if out["ok"] else 1


def _url_check(args) -> int:
    from raytrain.serving.check import run_url_check

    out = run_url_check(args.url, model=args.model_dir, data=args.data, k=args.samples, requests=args.requests,
                        concurrency=args.concurrency, max_p99_ms=500.0 if args.max_p99_ms is None else args.max_p99_ms,
                        prompt=args.prompt,
                        max_new_tokens=args.max_new_tokens, timeout_s=args.timeout, out_dir=args.report_dir,
                        ca_bundle=args.ca_bundle,
                        log=(lambda *_: None) if args.json else print)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{'launch check passed' if out['ok'] else 'launch check FAILED'}: {args.url}; reports: "
              f"{', '.join(out.get('reports', []))}")
    return 0 if out["ok"] else 1
