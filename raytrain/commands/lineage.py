"""`raytrain lineage MODEL_OR_RUN`: where a model came from (run, checkpoint, config, data, raw inputs, base model) and which of its inputs changed since."""

from __future__ import annotations

import json


def add_parser(subparsers):
    what = ("a model's lineage: run, checkpoint, config, data manifests, tokenizer, raw input files (size, sha256), "
            "packages and a fine-tune's base model, and the inputs changed since (exit 0: unchanged, 1: some changed "
            "or missing, 2: bad input)")
    li = subparsers.add_parser("lineage", help=what, description=what)
    li.add_argument("target", metavar="MODEL_OR_RUN", help="exported model directory (its lineage.json), or a run "
                    "directory / RUN@TAG / checkpoint (its lineage built from the newest complete checkpoint, "
                    "nothing exported); local or s3://")
    li.add_argument("--json", action="store_true", help="print {lineage, what, changed, unknown} as JSON")
    return li


def run(args) -> int:
    from raytrain import lineage

    lin, what = lineage.resolve(args.target)
    results = lineage.verify(lin)
    changed = lineage.check(lin)
    unknown = lineage.unknown(lin) + [r for r in results if r["status"] == "unknown"]
    if args.json:
        print(json.dumps({"what": what, "lineage": lin, "changed": changed, "unknown": unknown}, indent=1))
        return 1 if changed else 0
    print(f"lineage {lin['id']}: {what}")
    for line in describe(lin):
        print(line)
    inputs = {r["uri"] for r in results if r["kind"] == "input"}
    for r in changed:
        was, now = r.get("was") or {}, r.get("now") or {}
        figures = (f"sha256 {str(was.get('sha256'))[:12]}.. ({was.get('bytes')} bytes) then, now "
                   f"{str(now.get('sha256'))[:12]}.. ({now.get('bytes')} bytes)") if now.get("sha256") else r["detail"]
        print(f"{r['status'].upper()}  {r['kind']} {r['uri']} (of {r['where']}): {figures}")
    for u in unknown:
        print(f"unknown  {u['uri']} (of {u['where']}): {u['detail']}")
    print(f"{len(changed)} of {len({(r['kind'], r['uri']) for r in results})} recorded files ({len(inputs)} raw "
          f"inputs) changed since" + (f"; {len(unknown)} unknown" if unknown else ""))
    return 1 if changed else 0


def describe(lin: dict, indent: str = "  ") -> list[str]:
    """The lineage as indented lines, its base's chain below it."""
    out = [f"{indent}run {lin['run']['name']} ({lin['run']['uri']}), checkpoint step {lin['checkpoint']['step']} "
           f"({lin['checkpoint']['uri']})",
           f"{indent}config sha256 {lin['config']['sha256']}"]
    listed: dict[str, str] = {}  # the inputs of a split already printed (train and val list the same files)
    for s in lin.get("data", []):
        name = f"{s['role']}" + (f" [{s['source']}]" if s.get("source") else "")
        out.append(f"{indent}data {name} {s['uri']}: manifest sha256 {s['manifest'].get('sha256')}")
        key = json.dumps(s.get("inputs"), sort_keys=True)
        if s.get("inputs") is None:
            out.append(f"{indent}  inputs unknown: {s.get('note', '')}")
        elif key in listed:
            out.append(f"{indent}  inputs: the {len(s['inputs'])} of {listed[key]} above")
            continue
        listed[key] = name
        for i in s.get("inputs") or []:
            extra = f", Python {i['python']}" if i.get("python") else ""
            out.append(f"{indent}  input {i.get('uri')} {i.get('bytes')} bytes sha256 {i.get('sha256')}{extra}")
    if lin.get("weights"):
        total = sum(r.get("bytes") or 0 for r in lin["weights"].values())
        out.append(f"{indent}files {len(lin['weights'])} ({total:,} bytes) with their sha256: "
                   + ", ".join(sorted(lin["weights"])[:6]) + (" ..." if len(lin["weights"]) > 6 else ""))
    tok = lin.get("tokenizer") or {}
    out.append(f"{indent}tokenizer {tok.get('uri')} sha256 {tok.get('sha256')}")
    out.append(f"{indent}packages " + ", ".join(f"{k} {v}" for k, v in lin.get("packages", {}).items()))
    base = lin.get("base")
    if base:
        out.append(f"{indent}base model {base['uri']}: " + (f"lineage {base['id']}" if base.get("lineage")
                                                            else "no lineage recorded"))
        if base.get("lineage"):
            out += describe(base["lineage"], indent + "  ")
    return out
