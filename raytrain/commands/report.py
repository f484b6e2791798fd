"""`raytrain report`: a run's loss, perplexity and throughput plotted (PNG) and summarised (Markdown)."""

from __future__ import annotations


def add_parser(subparsers):
    rp = subparsers.add_parser("report", help="plot a run's loss, perplexity and throughput (PNG) and summarise it "
                               "(Markdown)")
    rp.add_argument("run_uri", help="run directory: <checkpoint.storage>/<run.name> (local path or s3://)")
    rp.add_argument("--out", default=None, help="directory for report.png and report.md (default: the run directory)")
    return rp


def run(args) -> int:
    from raytrain.run_report import report

    png, md = report(args.run_uri, args.out)
    print(f"wrote {png}\nwrote {md}")
    return 0
