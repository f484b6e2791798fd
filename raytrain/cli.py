"""Command line: `raytrain train | prepare | data | ckpt | config`. Thin: parse, call the component, print one-line errors."""

from __future__ import annotations

import argparse
import json
import sys

from raytrain.errors import UserError


def _cmd_train(args) -> int:
    from raytrain.config import load_config
    from raytrain.trainer import train

    cfg = load_config(args.config, args.overrides)
    summary = train(cfg)
    print(format_summary(summary))
    return 0


def _cmd_prepare(args) -> int:
    from raytrain.data.prepare import load_prepare_config, prepare

    report = prepare(load_prepare_config(args.config, args.overrides))
    print(json.dumps(report, indent=1))
    return 0


def _cmd_data(args) -> int:
    from raytrain.data.report import compare, drift_verdict

    out = compare(args.a, args.b, split=args.split)
    out["verdict"] = drift_verdict(out["ks_doc_tokens"])
    print(json.dumps(out, indent=1))
    return 0


def _cmd_config(args) -> int:
    from raytrain.config import load_config, reference_markdown

    if args.reference:
        print(reference_markdown())
        return 0
    cfg = load_config(args.config, args.overrides)
    print(cfg.to_yaml(), end="")
    print(f"# derived: gradient_accumulation_steps={cfg.accumulation} global_batch_size={cfg.global_batch} "
          f"run_uri={cfg.run_uri}")
    return 0


def _cmd_ckpt(args) -> int:
    from raytrain import storage
    from raytrain.checkpoints import describe

    run_uri = storage.absolute(args.run_uri)
    if not storage.exists(run_uri):
        raise UserError(f"run directory not found: {run_uri}")
    rows = describe(run_uri, deep=args.action == "verify" and not args.quick)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'checkpoint':22} {'step':>8} {'state':10} {'size':>10} {'val_ppl':>9}  committed / problem")
        for r in rows:
            ppl = f"{r['val_ppl']:.2f}" if r["val_ppl"] is not None else "-"
            state = "complete" if r["complete"] else "INCOMPLETE"
            print(f"{r['checkpoint']:22} {r['step']:>8} {state:10} {r['bytes'] / 2**20:>8.1f}MB {ppl:>9}  "
                  f"{r['committed'] if r['complete'] else r['reason']}")
        if not rows:
            print(f"(no checkpoints under {run_uri})")
    bad = [r for r in rows if not r["complete"]]
    # verify exits non-zero when anything is incomplete, so scripts can gate on it.
    return 1 if args.action == "verify" and (bad or not rows) else 0


def format_summary(s: dict) -> str:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raytrain", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a model (resumes if the run already has checkpoints)")
    t.add_argument("--config", "-c", default="tiny", help="recipe name (tiny, ...) or path to a YAML file")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 model.n_layer=4")
    t.set_defaults(fn=_cmd_train)
    pr = sub.add_parser("prepare", help="tokenize and pack text into Parquet shards with a manifest")
    pr.add_argument("--config", "-c", default=None, help="YAML file of prepare settings")
    pr.add_argument("overrides", nargs="*", help="e.g. inputs=[python-docs] out=data/docs seq_len=128")
    pr.set_defaults(fn=_cmd_prepare)
    d = sub.add_parser("data", help="data tools: `data compare A B` checks two prepared datasets for drift")
    d.add_argument("action", choices=["compare"])
    d.add_argument("a", help="prepared dataset URI (the `out` of raytrain prepare)")
    d.add_argument("b", help="another prepared dataset URI")
    d.add_argument("--split", default="train", choices=["train", "val"])
    d.set_defaults(fn=_cmd_data)
    k = sub.add_parser("ckpt", help="list or verify a run's checkpoints")
    k.add_argument("action", choices=["list", "verify"], help="verify checks every file's sha256 and exits 1 "
                   "if any checkpoint is incomplete")
    k.add_argument("run_uri", help="run directory: <checkpoint.storage>/<run.name> (local path or s3://)")
    k.add_argument("--quick", action="store_true", help="verify sizes only, not checksums")
    k.add_argument("--json", action="store_true")
    k.set_defaults(fn=_cmd_ckpt)
    c = sub.add_parser("config", help="print the resolved config")
    c.add_argument("--config", "-c", default="tiny")
    c.add_argument("--reference", action="store_true", help="print every config key as Markdown")
    c.add_argument("overrides", nargs="*")
    c.set_defaults(fn=_cmd_config)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UserError as e:
        print(f"raytrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("raytrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
