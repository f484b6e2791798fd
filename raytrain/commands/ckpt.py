"""`raytrain ckpt list | verify | tag | rollback | prune`: a run's checkpoints as a table, and their versions."""

from __future__ import annotations

import json

from raytrain.errors import UserError


def add_parser(subparsers):
    k = subparsers.add_parser("ckpt", help="list, verify, tag, roll back or prune a run's checkpoints "
                              "(docs/LIFECYCLE.md)")
    k.add_argument("action", choices=["list", "verify", "tag", "rollback", "prune"],
                   help="verify checks every file's sha256 and exits 1 if any checkpoint is incomplete; "
                   "tag names a checkpoint; rollback makes the next train resume from a tag or step; prune "
                   "deletes by retention policy (dry run unless --yes)")
    k.add_argument("run_uri", help="run directory: <checkpoint.storage>/<run.name> (local path or s3://)")
    k.add_argument("target", nargs="?", default=None, help="tag: the new tag's name; rollback: the tag to resume from")
    k.add_argument("--step", type=int, default=None, help="tag / rollback: the checkpoint's step (tag default: newest)")
    k.add_argument("--force", action="store_true", help="tag: move an existing tag")
    k.add_argument("--clear", action="store_true", help="rollback: remove the rollback marker")
    k.add_argument("--older-than", default=None, help="prune: delete checkpoints older than this (7d, 12h, ...)")
    k.add_argument("--keep-last", type=int, default=None, help="prune: always keep the newest N")
    k.add_argument("--yes", action="store_true", help="prune: really delete (default: dry run)")
    k.add_argument("--quick", action="store_true", help="verify sizes only, not checksums")
    k.add_argument("--json", action="store_true")
    return k


def run(args) -> int:
    from raytrain import storage
    from raytrain.ckpt.catalog import describe

    run_uri = storage.absolute(args.run_uri)
    if not storage.exists(run_uri):
        raise UserError(f"run directory not found: {run_uri}")
    if args.action == "tag":
        return _tag(args, run_uri)
    if args.action == "rollback":
        return _rollback(args, run_uri)
    if args.action == "prune":
        return _prune(args, run_uri)
    rows = describe(run_uri, deep=args.action == "verify" and not args.quick)
    print(json.dumps(rows, indent=1) if args.json else format_table(rows, run_uri))
    bad = [r for r in rows if not r["complete"]]
    # verify exits non-zero when anything is incomplete, so scripts can gate on it.
    return 1 if args.action == "verify" and (bad or not rows) else 0


def format_table(rows: list[dict], run_uri: str) -> str:
    """`ckpt list` / `ckpt verify`: one line per checkpoint with its state, size, val_ppl, tags."""
    lines = [f"{'checkpoint':22} {'step':>8} {'state':10} {'size':>10} {'val_ppl':>9}  committed / problem"]
    for r in rows:
        ppl = f"{r['val_ppl']:.2f}" if r["val_ppl"] is not None else "-"
        state = "complete" if r["complete"] else "INCOMPLETE"
        marks = "".join(f"  [tag {t}]" for t in r.get("tags", [])) + ("  [rollback target]" if r.get(
            "rollback_target") else "")
        lines.append(f"{r['checkpoint']:22} {r['step']:>8} {state:10} {r['bytes'] / 2**20:>8.1f}MB {ppl:>9}  "
                     f"{r['committed'] if r['complete'] else r['reason']}{marks}")
    if not rows:
        lines.append(f"(no checkpoints under {run_uri})")
    return "\n".join(lines)


def parse_age(text: str) -> float:
    """`7d`, `12h`, `30m`, `90s` -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    try:
        return float(text[:-1]) * units[text[-1]]
    except (KeyError, ValueError, IndexError):
        raise UserError(f"--older-than {text!r}: use a number and a unit s/m/h/d/w, e.g. 7d") from None


def _tag(args, run_uri: str) -> int:
    from raytrain.ckpt import catalog
    from raytrain.ckpt.layout import TAGS_DIR

    if not args.target:
        raise UserError("ckpt tag needs a tag name: raytrain ckpt tag RUN_URI v1.0 [--step N]")
    rec = catalog.tag(run_uri, args.target, args.step, force=args.force)
    print(f"tagged {rec['checkpoint']} (step {rec['step']}) as {rec['tag']} -> "
          f"{run_uri}/{TAGS_DIR}/{rec['tag']}.json")
    return 0


def _rollback(args, run_uri: str) -> int:
    from raytrain.ckpt import catalog

    if args.clear:
        catalog.clear_resume_marker(run_uri)
        print(f"rollback cleared: {run_uri} resumes from its newest complete checkpoint")
        return 0
    m = catalog.set_resume_marker(run_uri, args.target, args.step)
    print(f"the next `raytrain train` of {run_uri} resumes from {m['checkpoint']} (step {m['step']}"
          f"{', tag ' + m['tag'] if m['tag'] else ''}); later checkpoints are kept but not used")
    return 0


def _prune(args, run_uri: str) -> int:
    from raytrain import storage
    from raytrain.ckpt import catalog

    if args.keep_last is None and args.older_than is None:
        raise UserError("ckpt prune needs a policy: --older-than 7d and/or --keep-last N")
    age = parse_age(args.older_than) if args.older_than else None
    doomed, kept = catalog.retention_plan(run_uri, keep_last=args.keep_last, older_than_s=age)
    for uri, why in sorted(kept.items(), key=lambda kv: kv[0]):
        if storage.exists(uri):
            print(f"keep    {uri.rsplit('/', 1)[-1]}  ({why})")
    for uri in doomed:
        print(f"{'delete' if args.yes else 'would delete'}  {uri.rsplit('/', 1)[-1]}")
    if args.yes:
        catalog.prune(run_uri, keep_last=args.keep_last, older_than_s=age)
        print(f"deleted {len(doomed)} checkpoint(s)")
    else:
        print(f"dry run: {len(doomed)} checkpoint(s) would be deleted; pass --yes to delete")
    return 0
