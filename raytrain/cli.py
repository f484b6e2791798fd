"""Command line: `raytrain train | prepare | data | ckpt | plan | export | eval | generate | check | serve | tune | report | cost | config`. Thin: parse, call the component, print one-line errors."""

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
                     f"{s.get('samples', 0):,} sequences, {s.get('shards', 0)} shard(s) per format")
    lines.append(f"  report     {r['out'].rstrip('/')}/report.md (train/val drift KS {r['ks_train_val_doc_tokens']:.3f})")
    return "\n".join(lines)


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
    from raytrain.ckpt.catalog import describe

    run_uri = storage.absolute(args.run_uri)
    if not storage.exists(run_uri):
        raise UserError(f"run directory not found: {run_uri}")
    if args.action in ("tag", "rollback", "prune"):
        return _ckpt_versions(args, run_uri)
    rows = describe(run_uri, deep=args.action == "verify" and not args.quick)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'checkpoint':22} {'step':>8} {'state':10} {'size':>10} {'val_ppl':>9}  committed / problem")
        for r in rows:
            ppl = f"{r['val_ppl']:.2f}" if r["val_ppl"] is not None else "-"
            state = "complete" if r["complete"] else "INCOMPLETE"
            marks = "".join(f"  [tag {t}]" for t in r.get("tags", [])) + ("  [rollback target]" if r.get(
                "rollback_target") else "")
            print(f"{r['checkpoint']:22} {r['step']:>8} {state:10} {r['bytes'] / 2**20:>8.1f}MB {ppl:>9}  "
                  f"{r['committed'] if r['complete'] else r['reason']}{marks}")
        if not rows:
            print(f"(no checkpoints under {run_uri})")
    bad = [r for r in rows if not r["complete"]]
    # verify exits non-zero when anything is incomplete, so scripts can gate on it.
    return 1 if args.action == "verify" and (bad or not rows) else 0


def _cmd_plan(args) -> int:
    import contextlib

    from raytrain.plan import format_plan, make_plan, parse_tokens

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import-time log lines must not mix into --json
        plan = make_plan(args.model, args.gpu, args.gpus, seq_len=args.seq_len,
                         tokens=parse_tokens(args.tokens) if args.tokens else None, micro_batch=args.micro_batch,
                         mfu=args.mfu, gpus_per_node=args.gpus_per_node, global_batch_tokens=args.global_batch_tokens,
                         vocab=args.vocab, price_on_demand=args.price_on_demand, price_spot=args.price_spot,
                         host_memory_gib=args.host_memory_gib, node_gbps=args.node_gbps)
    print(json.dumps(plan.to_dict(), indent=1) if args.json else format_plan(plan))
    return 0


def _parse_age(text: str) -> float:
    """`7d`, `12h`, `30m`, `90s` -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    try:
        return float(text[:-1]) * units[text[-1]]
    except (KeyError, ValueError, IndexError):
        raise UserError(f"--older-than {text!r}: use a number and a unit s/m/h/d/w, e.g. 7d") from None


def _ckpt_versions(args, run_uri: str) -> int:
    from raytrain import storage
    from raytrain.ckpt import catalog
    from raytrain.ckpt.layout import TAGS_DIR

    if args.action == "tag":
        if not args.target:
            raise UserError("ckpt tag needs a tag name: raytrain ckpt tag RUN_URI v1.0 [--step N]")
        rec = catalog.tag(run_uri, args.target, args.step, force=args.force)
        print(f"tagged {rec['checkpoint']} (step {rec['step']}) as {rec['tag']} -> "
              f"{run_uri}/{TAGS_DIR}/{rec['tag']}.json")
        return 0
    if args.action == "rollback":
        if args.clear:
            catalog.clear_resume_marker(run_uri)
            print(f"rollback cleared: {run_uri} resumes from its newest complete checkpoint")
            return 0
        m = catalog.set_resume_marker(run_uri, args.target, args.step)
        print(f"the next `raytrain train` of {run_uri} resumes from {m['checkpoint']} (step {m['step']}"
              f"{', tag ' + m['tag'] if m['tag'] else ''}); later checkpoints are kept but not used")
        return 0
    if args.keep_last is None and args.older_than is None:
        raise UserError("ckpt prune needs a policy: --older-than 7d and/or --keep-last N")
    age = _parse_age(args.older_than) if args.older_than else None
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


def _cmd_export(args) -> int:
    from raytrain.export import export

    export(args.checkpoint, args.out, tokenizer=args.tokenizer, force=args.force)
    return 0


def _cmd_eval(args) -> int:
    from raytrain.eval_cmd import evaluate

    out = evaluate(args.checkpoint, args.model, args.data, args.samples, args.workers)
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


def _cmd_generate(args) -> int:
    from raytrain.generate import load

    gen = load(args.checkpoint, args.model, args.tokenizer)
    for i in range(args.num):
        text = gen(args.prompt, args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed + i)
        print(args.prompt + text)
    return 0


def _cmd_tune(args) -> int:
    from raytrain.sweep.run import run_sweep
    from raytrain.sweep.spec import load_spec

    run_sweep(load_spec(args.config, args.overrides), resume=args.resume)
    return 0


def _cmd_check(args) -> int:
    if args.url:
        from raytrain.serving.check import run_url_check

        out = run_url_check(args.url, args.model_dir, args.data, args.samples, args.requests, args.concurrency,
                            500.0 if args.max_p99_ms is None else args.max_p99_ms, prompt=args.prompt,
                            max_new_tokens=args.max_new_tokens, timeout_s=args.timeout, out_dir=args.report_dir,
                            log=(lambda *_: None) if args.json else print)
        if args.json:
            print(json.dumps(out, indent=1))
        else:
            print(f"{'launch check passed' if out['ok'] else 'launch check FAILED'}: {args.url}; reports: "
                  f"{', '.join(out.get('reports', []))}")
        return 0 if out["ok"] else 1
    if not args.model_dir:
        raise UserError("check needs MODEL_DIR (an exported model) or --url URL (a running `raytrain serve`)")
    from raytrain.release_check import run_checks

    out = run_checks(args.model_dir, args.expect_params, args.prompt, args.n, args.max_new_tokens,
                     args.max_p99_ms, args.data, args.max_loss_diff)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for c in out["checks"]:
            print(f"{'PASS' if c['ok'] else 'FAIL'}  {c['name']:10} {c['detail']}")
        print(f"{'release check passed' if out['ok'] else 'release check FAILED'}: {args.model_dir}")
    return 0 if out["ok"] else 1


def _cmd_serve(args) -> int:
    from raytrain.serving.run import serve_forever, traffic

    if args.model in ("promote", "rollback", "split"):
        if not args.url:
            raise UserError(f"serve {args.model} needs --url of the running server, e.g. --url http://127.0.0.1:8000")
        state = traffic(args.url, args.model, args.canary_fraction)
        print(f"stable {state['stable']}" + (f", canary {state['canary']} at {state['canary_fraction']:.0%}"
                                             if state["canary"] else ", no canary"))
        return 0
    return serve_forever(args.model, port=args.port, host=args.host, version=args.version, canary=args.canary,
                         canary_version=args.canary_version, canary_fraction=args.canary_fraction or 0.0,
                         replicas=args.replicas, max_replicas=args.max_replicas, num_cpus=args.cpus_per_replica,
                         max_batch_size=args.max_batch_size, metrics_port=args.metrics_port, ready_file=args.ready_file)


def _cmd_report(args) -> int:
    from raytrain.report_cmd import report

    png, md = report(args.run_uri, args.out)
    print(f"wrote {png}\nwrote {md}")
    return 0


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


def _cmd_cost(args) -> int:
    from raytrain import storage
    from raytrain.config import apply_overrides, check_key, load_yaml, parse_overrides, validate
    from raytrain.cost import Prices, format_report, report

    run_uri = storage.absolute(args.run_uri)
    # Prices: the run's own saved config.yaml, then any cost.* overrides given here.
    saved = storage.join(run_uri, "config.yaml")
    tree = (load_yaml(storage.read_text(saved)) or {}) if storage.exists(saved) else {}
    overrides = parse_overrides(args.overrides)
    for key in overrides:
        check_key(key)
    cfg = validate(apply_overrides(tree, overrides))
    c = cfg.cost
    r = report(run_uri, Prices(c.spot_per_hour, c.on_demand_per_hour, c.head_per_hour),
               mtbf_s=args.mtbf_hours * 3600 if args.mtbf_hours else None, prior_mtbf_s=cfg.checkpoint.mtbf_s)
    print(json.dumps(r, indent=1) if args.json else format_report(r))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raytrain", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a model (resumes if the run already has checkpoints)")
    t.add_argument("--config", "-c", default="tiny", help="recipe name (tiny, ...) or path to a YAML file")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 model.n_layer=4")
    t.set_defaults(fn=_cmd_train)
    pr = sub.add_parser("prepare", help="tokenize and pack text into Parquet / WebDataset shards with a manifest and a data report")
    pr.add_argument("--config", "-c", default=None, help="YAML file of prepare settings")
    pr.add_argument("overrides", nargs="*", help="e.g. inputs=[python-docs] out=data/docs seq_len=128")
    pr.add_argument("--json", action="store_true", help="print the full report as JSON (progress lines go to stderr)")
    pr.set_defaults(fn=_cmd_prepare)
    d = sub.add_parser("data", help="data tools: `data compare A B` checks two prepared datasets for drift")
    d.add_argument("action", choices=["compare"])
    d.add_argument("a", help="prepared dataset URI (the `out` of raytrain prepare)")
    d.add_argument("b", help="another prepared dataset URI")
    d.add_argument("--split", default="train", choices=["train", "val"])
    d.set_defaults(fn=_cmd_data)
    k = sub.add_parser("ckpt", help="list, verify, tag, roll back or prune a run's checkpoints (docs/LIFECYCLE.md)")
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
    k.set_defaults(fn=_cmd_ckpt)
    ex = sub.add_parser("export", help="checkpoint -> Hugging Face model directory (any ZeRO stage)")
    ex.add_argument("--checkpoint", required=True, help="checkpoint directory URI (see `raytrain ckpt list`)")
    ex.add_argument("--out", required=True, help="output directory: local path or s3://...")
    ex.add_argument("--tokenizer", default=None, help="tokenizer.json if the training data is not reachable")
    ex.add_argument("--force", action="store_true", help="overwrite an existing model directory")
    ex.set_defaults(fn=_cmd_export)
    ev = sub.add_parser("eval", help="validation loss / perplexity of a checkpoint or exported model, on Ray")
    ev.add_argument("--checkpoint", default=None, help="checkpoint directory URI")
    ev.add_argument("--model", default=None, help="or an exported model directory")
    ev.add_argument("--data", default=None, help="prepared validation split (default: the run's data.val)")
    ev.add_argument("--samples", type=int, default=None, help="sequences to score (default: as in training)")
    ev.add_argument("--workers", type=int, default=2, help="Ray tasks to spread the work over")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(fn=_cmd_eval)
    g = sub.add_parser("generate", help="generate text from a checkpoint or exported model")
    g.add_argument("--checkpoint", default=None, help="checkpoint directory URI")
    g.add_argument("--model", default=None, help="or an exported model directory")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json (with --checkpoint, if the data is not reachable)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--greedy", action="store_true", help="argmax decoding (default: sampling)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0: all")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (the i-th of --num uses seed+i)")
    g.add_argument("--num", type=int, default=1, help="number of samples")
    g.set_defaults(fn=_cmd_generate)
    ch = sub.add_parser("check", help="release gate for an exported model: load, parameter count, generation, "
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
    ch.add_argument("--url", default=None, help="HTTP launch check of a running `raytrain serve`: health, one predict, "
                    "consistency with the offline model, load test")
    ch.add_argument("--requests", type=int, default=200, help="--url: load-test requests")
    ch.add_argument("--concurrency", type=int, default=8, help="--url: requests in flight at once")
    ch.add_argument("--samples", type=int, default=8, help="--url: held-out samples for the consistency check")
    ch.add_argument("--timeout", type=float, default=300.0, help="--url: the whole check's time bound (s)")
    ch.add_argument("--report-dir", default="launch-check", help="--url: where launch_check.json and .md go")
    ch.set_defaults(fn=_cmd_check)
    sv = sub.add_parser("serve", help="serve a model over HTTP on Ray Serve (POST /predict, /v1/completions); "
                        "`serve promote|rollback|split --url URL` moves traffic between versions")
    sv.add_argument("model", help="exported model directory (local or s3://), a run directory (its newest complete "
                    "checkpoint, exported on the fly), RUN@TAG (a tagged version), or promote / rollback / split")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    sv.add_argument("--version", default=None, help="version name in responses (default: the tag, the directory's "
                    "name or step-N)")
    sv.add_argument("--canary", default=None, help="a second model served beside the first (same forms as MODEL)")
    sv.add_argument("--canary-version", default=None, help="the canary's version name")
    sv.add_argument("--canary-fraction", type=float, default=None, help="share of requests the canary answers "
                    "(0..1); with split: the new share")
    sv.add_argument("--url", default=None, help="promote / rollback / split: the running server")
    sv.add_argument("--replicas", type=int, default=1, help="model replicas per version (autoscaling minimum)")
    sv.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many replicas per version")
    sv.add_argument("--cpus-per-replica", type=float, default=1)
    sv.add_argument("--max-batch-size", type=int, default=8, help="Serve dynamic batching: requests per batch")
    sv.add_argument("--metrics-port", type=int, default=None, help="local Ray only: Prometheus metrics on this port")
    sv.add_argument("--ready-file", default=None, help="write {url, stable, canary} here once serving (for scripts)")
    sv.set_defaults(fn=_cmd_serve)
    pl = sub.add_parser("plan", help="capacity plan: memory per GPU for each ZeRO stage, a recommended setup, "
                        "time and cost for a token budget (docs/PLANNING.md)")
    pl.add_argument("--model", required=True, help="a size (124m, 350m, 1b, 7b, 10b, 13b, 70b, 8x7b, ...), a recipe "
                    "name or a config YAML")
    pl.add_argument("--gpu", required=True, help="GPU type: a100-80gb, a100-40gb, h100, h200, l4, ...")
    pl.add_argument("--gpus", type=int, required=True, help="GPUs in the run (data-parallel ranks)")
    pl.add_argument("--gpus-per-node", type=int, default=8)
    pl.add_argument("--seq-len", type=int, default=None, help="context length (default: the model's)")
    pl.add_argument("--tokens", default=None, help="token budget for time and cost, e.g. 300B, 1.4T")
    pl.add_argument("--micro-batch", type=int, default=None, help="fix the micro-batch instead of the largest that fits")
    pl.add_argument("--global-batch-tokens", type=int, default=2**20, help="target tokens per optimizer step")
    pl.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (default 0.4)")
    pl.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the family's usual one)")
    pl.add_argument("--price-on-demand", type=float, default=None, help="USD per GPU-hour, overrides the table")
    pl.add_argument("--price-spot", type=float, default=None, help="USD per GPU-hour, overrides the table")
    pl.add_argument("--host-memory-gib", type=float, default=1024.0, help="host RAM per node (offload and model "
                    "construction live there)")
    pl.add_argument("--node-gbps", type=float, default=10.0, help="a node's bandwidth from checkpoint storage in "
                    "Gbit/s, for the restore time (default 10)")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=_cmd_plan)
    tu = sub.add_parser("tune", help="Ray Tune sweep of training runs (micro-batch throughput, lr/warmup with ASHA)")
    tu.add_argument("--config", "-c", required=True, help="tune config: tune_configs/NAME.yaml (or NAME)")
    tu.add_argument("--resume", action="store_true", help="continue the sweep whose driver died (Tuner.restore)")
    tu.add_argument("overrides", nargs="*", help="training keys (data.train=..., model.n_layer=2) or tune config "
                    "keys (budget.max_steps=20, microbatch.memory_cap_mb=4000)")
    tu.set_defaults(fn=_cmd_tune)
    rp = sub.add_parser("report", help="plot a run's loss, perplexity and throughput (PNG) and summarise it (Markdown)")
    rp.add_argument("run_uri", help="run directory: <checkpoint.storage>/<run.name> (local path or s3://)")
    rp.add_argument("--out", default=None, help="directory for report.png and report.md (default: the run directory)")
    rp.set_defaults(fn=_cmd_report)
    co = sub.add_parser("cost", help="node time by market, money vs on-demand, preemptions, lost steps and the "
                        "Young-Daly checkpoint interval of a run")
    co.add_argument("run_uri", help="run directory: <checkpoint.storage>/<run.name> (local path or s3://)")
    co.add_argument("overrides", nargs="*", help="prices, e.g. cost.spot_per_hour=0.3 cost.on_demand_per_hour=1.0")
    co.add_argument("--mtbf-hours", type=float, default=None, help="mean time between interruptions for the "
                    "Young-Daly interval (default: observed in this run)")
    co.add_argument("--json", action="store_true")
    co.set_defaults(fn=_cmd_cost)
    c = sub.add_parser("config", help="print the resolved config")
    c.add_argument("--config", "-c", default="tiny")
    c.add_argument("--reference", action="store_true", help="print every config key as Markdown")
    c.add_argument("overrides", nargs="*")
    c.set_defaults(fn=_cmd_config)
    return p


def main(argv: list[str] | None = None) -> int:
    from raytrain.quiet import quiet_deepspeed, quiet_warnings

    args = build_parser().parse_args(argv)
    quiet_warnings()
    try:
        if args.fn in (_cmd_plan, _cmd_export, _cmd_eval, _cmd_generate, _cmd_check):
            quiet_deepspeed()  # these import DeepSpeed, which would announce the accelerator it guessed
        return args.fn(args)
    except UserError as e:
        print(f"raytrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("raytrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
