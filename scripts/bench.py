"""raytrain benchmark suite: figures beside a baseline measured in the same run, all written as JSON.

A "baseline" cell only ever holds a figure measured in that run (benchkit.parts.measured); targets and constants
(a configured interval, N, 1.0) print in the "target / reference" column, and no ratio is taken against them.

Parts (see scripts/benchkit/parts.py):
  overhead    raytrain tokens/s at steady state vs a plain PyTorch loop (1 worker) and plain DDP (2 workers)
  readers     data.reader=ray vs direct: tokens/s, data wait, worker start to first step (1, 2 workers); read +
              decode and the fim transform per CPU core, and the cores per H100 they take
  ingest      the training reader's tokens/s (PlannedReader, plan order) vs a raw pyarrow read; data wait in training
  checkpoint  save / restore MB/s to a local S3-protocol server (moto) vs raw boto3; async vs sync upload stall
  recovery    seconds from a worker SIGKILL to the first resumed step; steps lost; tokens/s after vs before; the median of 5 kills by phase;
              tokens/s with a memory snapshot every step vs none (interleaved windows of one run)
  gpu         MFU of GPT-2-124M and a ~1B Llama in bf16 vs plain PyTorch + DeepSpeed (skipped without CUDA)
  dataplane   the sample plan alone at N = 8..1024 on a synthetic 1 TB manifest: read amplification, per-worker cost;
              the same for data mixtures of 2 and 8 sources (the worst source's read amplification)
  dataplane_runs  real CPU runs under the plan at 1, 2, 4 workers, Parquet and WebDataset, local and S3 (moto):
              read amplification, rows and bytes read per worker, data wait (the runs' own counters)
  trackers    step time with W&B (offline) + MLflow (local server) vs without; the loop's pause to hand a checkpoint
              to a downstream (lm-eval) evaluation task
  memory      peak host RSS per worker of a ~322M ZeRO-3 model at 1, 2 and 4 workers vs 1 worker, and (8b) the largest
              training worker through whole runs of a 57M model (not in the default set)
  serve       `raytrain serve` over HTTP (the demo-sized model): P50 / P99 latency and requests/s at concurrency 1
              and 8, cold and warm apart, vs a plain transformers generate loop in one process

Usage: .venv/bin/python scripts/bench.py [--quick] [--parts overhead,ingest,...] [--json out.json] [--markdown]
--quick finishes in under 10 minutes on 2 CPU cores. Everything runs on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS = ("overhead", "readers", "ingest", "checkpoint", "recovery", "gpu", "dataplane", "dataplane_runs", "trackers", "serve")
EXTRA_PARTS = ("memory",)  # run only when named in --parts: ~10 GB of RAM across its workers


def versions() -> dict:
    from importlib.metadata import version

    out = {"python": platform.python_version()}
    for pkg in ("ray", "deepspeed", "torch", "transformers", "pyarrow", "boto3", "moto"):
        try:
            out[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - report what is there
            out[pkg] = None
    return out


def machine() -> str:
    import psutil
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()}-core {platform.machine()} CPU, {psutil.virtual_memory().total / 2**30:.0f} GiB, {gpu}")


def _fmt(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "fraction":
        return f"{v:.3%}"
    if unit == "fraction of peak":
        return f"{v:.1%}"
    if unit in ("s",):
        return f"{v:.2f} s"
    if unit == "steps":
        return f"{v:g}"
    if unit == "ms" and v < 10:
        return f"{v:.2f}"
    return f"{v:,.1f}" if v < 100 else f"{v:,.0f}"


def target_cell(f: dict) -> str:
    """What the figure is held to or read against, none of it measured: the target, then any reference constant."""
    parts = [x for x in (f.get("target"), f.get("reference")) if x]
    return "; ".join(parts) if parts else "-"


def markdown(results: dict, command: str) -> str:
    v = results["versions"]
    vers = ", ".join(f"{k} {v[k]}" for k in ("ray", "deepspeed", "torch", "transformers", "pyarrow") if v.get(k))
    head = (f"Measured {results['date']} on {results['machine']} (load average {results['load_before']} before, "
            f"{results['load_after']} after); {vers}, Python {v['python']}. Command: `{command}` "
            f"({results['wall_s']:.0f} s).\n\n")
    rows = ["| part | figure | value | baseline (measured, same run) | baseline value | ratio | target / reference "
            "(not measured) | met |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for f in results["figures"]:
        met = "-" if f["met"] is None else ("yes" if f["met"] else "**no**")
        # Baseline cells come only from the figure's measured baseline: "-" where it has none.
        measured = f["baseline_value"] is not None
        ratio = "-" if f["ratio"] is None or not measured else f"{f['ratio']:.3f}"
        rows.append(f"| {f['part']} | {f['name']} | {_fmt(f['value'], f['unit'])} {f['unit'] if f['unit'] not in ('fraction', 'fraction of peak', 's') else ''} | "
                    f"{(f['baseline'] or '-') if measured else '-'} | {_fmt(f['baseline_value'], f['unit'])} | {ratio} | "
                    f"{target_cell(f)} | {met} |")
    return head + "\n".join(rows) + "\n"


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: under 10 minutes on 2 CPU cores")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--json", default="bench.json", help="write every figure (with its raw windows) here")
    ap.add_argument("--markdown", action="store_true", help="also print a Markdown table for docs/BENCHMARKS.md")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (runs, data) for inspection")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS + EXTRA_PARTS]
    if bad:
        ap.error(f"unknown part(s) {bad}; choose from {','.join(PARTS + EXTRA_PARTS)}")

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    from benchkit import parts as P

    t_all = time.perf_counter()
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "quick": args.quick, "machine": machine(),
               "versions": versions(), "load_before": load(), "parts": parts, "figures": []}
    print(f"raytrain bench ({'quick' if args.quick else 'full'}): {results['machine']}, load average "
          f"{results['load_before']}", flush=True)
    tmp = tempfile.mkdtemp(prefix="raytrain-bench-")
    moto = None
    started_ray = False
    try:
        data = None
        if set(parts) & {"checkpoint", "dataplane_runs"}:
            # Before any Ray instance starts, so that its workers inherit the endpoint and credentials.
            from tests.helpers import start_moto

            moto, endpoint = start_moto()
            os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
                               "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
                               "AWS_EC2_METADATA_DISABLED": "true"})
            import boto3

            boto3.client("s3").create_bucket(Bucket="bench")
        if set(parts) & {"overhead", "readers", "ingest", "recovery", "serve"}:
            t = time.perf_counter()
            data = P.prepare_data(os.path.join(tmp, "data"), 300_000 if args.quick else 1_500_000)
            print(f"dataset prepared in {time.perf_counter() - t:.1f}s", flush=True)
        if set(parts) & {"overhead", "readers", "ingest", "recovery", "dataplane_runs", "trackers"}:
            import ray

            # Logical CPUs above the 2 training workers, so Ray Data always has room (a job holding every CPU starves its data pipeline).
            if not ray.is_initialized():
                from raytrain.ray_auth import ensure_token

                ensure_token()
                ray.init(address="local", num_cpus=max(6 if "dataplane_runs" in parts else 4, os.cpu_count() or 1),
                         include_dashboard=False,
                         log_to_driver=False)
                started_ray = True
        train_runs = None

        def section(title: str, fn):
            """Run one part; a part that fails is recorded as failed and the others still run."""
            print(f"\n== {title}", flush=True)
            t = time.perf_counter()
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001 - a benchmark reports what it could measure
                import traceback

                traceback.print_exc()
                out = [P.figure(title.split(".")[0], f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                                None, "", "", None, met=False)]
                out = (out, None) if title.startswith("1.") else out
            print(f"   ({time.perf_counter() - t:.0f}s)", flush=True)
            results["figures"] += out[0] if isinstance(out, tuple) else out
            Path(args.json).write_text(json.dumps(results, indent=1))  # partial results survive a crash
            return out

        if "overhead" in parts:
            _, train_runs = section("1. training overhead: raytrain vs plain loops (same model, micro-batch, threads)",
                                    lambda: P.overhead(data, tmp, args.quick))
        if "readers" in parts:
            section("1b. readers: data.reader=ray (Ray Data, routed by key) vs direct, 1 and 2 workers",
                    lambda: P.readers(data, tmp, args.quick))
        if "ingest" in parts:
            section("2. ingest: the training reader vs raw pyarrow; data wait in training",
                    lambda: P.ingest(data, 3 if args.quick else 10, train_runs))
            if train_runs is None:
                print("   (data wait comes from part 'overhead'; run it too for that figure)")
        if "checkpoint" in parts:
            size = (96 if args.quick else 384) << 20
            section(f"3. checkpoint: {size >> 20} MiB to moto S3 on 127.0.0.1 via raytrain.storage "
                    "vs raw boto3; async vs sync upload stall",
                    lambda: P.checkpoint(tmp, "bench", size, 4))
        if "recovery" in parts:
            section("4. recovery: SIGKILL of one of 2 workers",
                    lambda: P.recovery(data, tmp, args.quick))
            section("4b. recovery: 5 SIGKILLs on the demo recipe, host memory on; kill to first step, by phase",
                    lambda: P.recovery_kills(data, tmp, args.quick))
            section("4c. recovery: tokens/s with a memory snapshot every step vs none, interleaved windows",
                    lambda: P.snapshot_cost(data, tmp, args.quick))
        if "gpu" in parts:
            section("5. GPU MFU (bf16, SDPA) vs plain PyTorch + DeepSpeed",
                    lambda: P.gpu(tmp, args.quick))
        if "dataplane" in parts:
            from benchkit.dataplane import dataplane, mixture_figures

            section("6. dataplane: the sample plan alone (no data), 1 TB of 2049-token rows in 1024-row units",
                    dataplane)
            section("6b. dataplane: mixtures of 2 and 8 sources of different sizes, the same 1 TB", mixture_figures)
        if "dataplane_runs" in parts:
            from benchkit.dataplane import runs as dataplane_runs

            section("7. dataplane_runs: training under the plan, 1/2/4 workers, Parquet/WebDataset, local/S3",
                    lambda: dataplane_runs(tmp, s3="s3://bench/dataplane", quick=args.quick))
        if "trackers" in parts:
            from benchkit.trackers import trackers

            section("9. trackers: step time with W&B + MLflow vs without; hand-over to an evaluation task",
                    lambda: trackers(tmp, args.quick))
        if "memory" in parts:
            from benchkit.zero3_rss import memory

            section("8. memory: peak host RSS per worker, ZeRO-3, 1 / 2 / 4 workers", memory)
            from benchkit.zero3_rss import whole_run

            section("8b. memory: the largest training worker's peak RSS through whole ZeRO-3 runs, 1 / 2 / 4 workers",
                    lambda: whole_run(tmp))
            section("8c. memory: the same with host-memory snapshots on (checkpoint.memory=true)",
                    lambda: whole_run(tmp, snapshots=True))
        if "serve" in parts:
            from benchkit.serving import serve

            section("9. serve: raytrain serve over HTTP vs a plain transformers generate loop, same model, prompts "
                    "and max_tokens", lambda: serve(tmp, data, args.quick))
    finally:
        if moto is not None:
            moto.terminate()
        if started_ray:  # a Ray instance this process already had (a caller's) is left alone
            import ray

            ray.shutdown()
        if args.keep:
            print(f"scratch kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - t_all
    results["load_after"] = load()
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\n{len(results['figures'])} figures in {results['wall_s']:.0f}s, load average {results['load_after']}; "
          f"JSON: {args.json}")
    missed = [f["name"] for f in results["figures"] if f["met"] is False]
    if missed:
        print("targets missed: " + "; ".join(missed))
    if args.markdown:
        print("\n" + markdown(results, "scripts/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])))
    return results


if __name__ == "__main__":
    main()
