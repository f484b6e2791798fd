"""`raytrain audit verify RUN_OR_MODEL`: whether a run's or a deployment's audit records are complete and unedited."""

from __future__ import annotations


def add_parser(subparsers):
    what = ("check audit records: every writer's segments there, each naming the sha256 of the one before, its first "
            "and last segment as its anchors say; on a versioned (S3 Object Lock) bucket every object version, so a "
            "deleted or overwritten segment is named with its original version (exit 0: intact, 1: a segment "
            "missing, deleted or edited, each named on a line of its own, 2: bad input)")
    a = subparsers.add_parser("audit", help=what, description=what)
    a.add_argument("action", choices=["verify"])
    a.add_argument("target", metavar="RUN_OR_MODEL", help="a run directory (its records), a served model directory "
                   "(the records `raytrain serve` keeps beside it) or an audit root (`serve --audit URI`); local or "
                   "s3:// (records of an S3 run live under the bucket's audit/ prefix: the run's URI finds them)")
    return a


def run(args) -> int:
    from raytrain import audit

    verdict = audit.verify(args.target)
    for line in verdict.problems:
        print(line)
    print(verdict.summary)
    return 0 if verdict.ok else 1
