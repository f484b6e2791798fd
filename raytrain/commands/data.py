"""`raytrain data compare A B` (two prepared datasets checked for drift), `raytrain data trace RUN --step N` (the
documents a step trained on) and `raytrain data contamination DATA --tasks ...` (training documents that overlap
evaluation data)."""

from __future__ import annotations

import json


def add_parser(subparsers):
    d = subparsers.add_parser("data", help="data tools: `data compare A B` checks two prepared datasets for drift; "
                              "`data trace RUN --step N` lists the documents step N trained on; `data contamination "
                              "DATA --tasks T` lists training documents sharing a long n-gram with evaluation data "
                              "(exit 1 when there are any)")
    d.add_argument("action", choices=["compare", "trace", "contamination"])
    d.add_argument("a", help="compare, contamination: a prepared dataset URI (the `out` of raytrain prepare); trace: "
                   "a run directory (<checkpoint.storage>/<run.name>)")
    d.add_argument("b", nargs="?", help="compare: another prepared dataset URI")
    d.add_argument("--split", default="train", choices=["train", "val"])
    d.add_argument("--step", type=int, help="trace: the step (1-based, as metrics.jsonl counts them)")
    d.add_argument("--position", type=int, help="trace: instead of a step, the global batch at this data position "
                   "(a rollback's skipped bad batch: its `bad_batch` start in metrics.jsonl)")
    d.add_argument("--rank", type=int, default=None, help="trace: only this data-parallel rank's lanes")
    d.add_argument("--json", action="store_true", help="trace, contamination: print JSON")
    d.add_argument("--tasks", default="", help="contamination: lm-evaluation-harness tasks, comma-separated")
    d.add_argument("--include-path", default=None, help="contamination: a directory of your own lm-eval task YAMLs")
    d.add_argument("--file", action="append", default=[], help="contamination: an evaluation file (.txt a document "
                   "per line, .jsonl, .parquet); repeatable")
    d.add_argument("--clean-out", default=None, help="contamination: write {task or file: indexes of its clean "
                   "examples} (JSON) here: the subset to score apart")
    d.add_argument("--ngram", type=int, default=13, help="contamination: words in a shared n-gram (default 13)")
    return d


def run(args) -> int:
    from raytrain.errors import UserError

    if args.action == "trace":
        from raytrain.data.trace import render, trace

        if (args.step is None) == (args.position is None) or args.b is not None:
            raise UserError("data trace takes one run directory and --step N or --position P (e.g. `raytrain data "
                            "trace RUN --step 40`)")
        t = trace(args.a, args.step, args.rank, position=args.position)
        t.pop("_tokens")
        print(json.dumps(t, indent=1) if args.json else render(t))
        return 0 if t["checksum_matches"] is not False else 1
    if args.action == "contamination":
        from raytrain import storage
        from raytrain.data.contamination import build_index
        from raytrain.data.contamination_scan import scan

        if args.b is not None:
            raise UserError("data contamination takes one prepared dataset URI and --tasks / --file")
        if args.ngram < 1:
            raise UserError(f"--ngram {args.ngram}: give a number of words >= 1 (13 is the usual)")
        index, per_source = build_index(tasks=[t for t in args.tasks.split(",") if t], files=args.file,
                                        include_path=args.include_path, n=args.ngram)
        got = scan(args.a, index=index, split=args.split)
        got["evaluation_sources"] = per_source
        if args.clean_out:  # {task or file: the indexes of its clean examples}: what an evaluation scores apart
            storage.write_text(storage.absolute(args.clean_out), json.dumps(
                {src: rec["clean"] for src, rec in got["by_source"].items()}, indent=1))
        if args.json:
            print(json.dumps(got, indent=1))
        else:
            print(f"{len(got['contaminated'])} document(s) of {got['split']} share a {got['ngram']}-word n-gram with "
                  f"{index.documents} evaluation document(s) ({', '.join(per_source)})")
            for f in got["contaminated"]:
                print(f"  {f['source']}@{f['record']} ({f['hits']} n-gram(s)): {f['head'][:60]!r}")
            for src, rec in got["by_source"].items():
                print(f"{src}: {len(rec['contaminated'])} of {rec['examples']} example(s) contaminated, "
                      f"{len(rec['clean'])} clean" + (f" (indexes in {args.clean_out})" if args.clean_out else ""))
        return 1 if got["contaminated"] else 0
    from raytrain.data.report import compare, drift_verdict

    if args.b is None:
        raise UserError("data compare takes two prepared dataset URIs: `raytrain data compare A B`")
    out = compare(args.a, args.b, split=args.split)
    out["verdict"] = drift_verdict(out["ks_doc_tokens"])
    print(json.dumps(out, indent=1))
    return 0
