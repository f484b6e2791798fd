"""`raytrain prepare`: documents -> tokenizer and packed shards with a manifest and a data report; a summary printed."""

from __future__ import annotations

import json
import sys


def add_parser(subparsers):
    pr = subparsers.add_parser("prepare", help="tokenize and pack text into Parquet / WebDataset shards with a "
                               "manifest and a data report")
    pr.add_argument("--config", "-c", default=None, help="YAML file of prepare settings")
    pr.add_argument("overrides", nargs="*", help="e.g. inputs=[python-docs] out=data/docs seq_len=128")
    pr.add_argument("--json", action="store_true", help="print the full report as JSON (progress lines go to stderr)")
    # Every key, from the schema itself; read only when help is asked for (it imports the data package).
    pr.format_help = lambda: type(pr).format_help(pr) + "\nprepare keys (key: type, default - meaning):\n" + _keys()
    return pr


def _keys() -> str:
    import textwrap

    from raytrain.config import key_rows
    from raytrain.data.prepare import PrepareConfig

    return "".join(textwrap.fill(f"{k}: {t}, default {d}" + (f" - {m}" if m else ""), width=100,
                                 initial_indent="  ", subsequent_indent="      ") + "\n"
                   for k, t, d, m in key_rows(PrepareConfig))


def run(args) -> int:
    import time

    from raytrain.data.prepare import load_prepare_config, prepare

    t0 = time.monotonic()
    report = prepare(load_prepare_config(args.config, args.overrides),
                     log=(lambda line: print(line, file=sys.stderr)) if args.json else print)
    print(json.dumps(report, indent=1) if args.json else format_prepare_summary(report, time.monotonic() - t0))
    return 0


def format_prepare_summary(r: dict, seconds: float) -> str:
    """A few lines for a person: documents in / kept and why dropped, tokens and shards per split, the report."""
    f = r.get("filters", {})
    drops = ", ".join(f"{k.removeprefix('dropped_').replace('_', ' ')} {v:,}" for k, v in f.items()
                      if k.startswith("dropped_") and v)
    lines = [f"prepared {r['out']} in {seconds:.1f} s (engine {r.get('engine', 'local')})",
             f"  documents  {r['documents']:,} in, {r['kept']:,} kept" + (f" (dropped: {drops})" if drops else "")]
    for split in ("train", "val"):
        s = r.get(split, {})
        lines.append(f"  {split:<9}  {s.get('documents', 0):,} documents, {s.get('tokens', 0):,} tokens in "
                     f"{s.get('samples', 0):,} sequences, {s.get('shards', 0)} shard(s) per format"
                     + (f"; {s['examples']:,} examples, {s['learned_tokens']:,} tokens learned, "
                        f"{s['masked_tokens']:,} masked" if "learned_tokens" in s else ""))
    if "truncated" in f:
        lines.append(f"  examples   {f['truncated']:,} truncated to seq_len+1 tokens")
    lines.append(f"  report     {r['out'].rstrip('/')}/report.md (train/val drift KS {r['ks_train_val_doc_tokens']:.3f})")
    return "\n".join(lines)
