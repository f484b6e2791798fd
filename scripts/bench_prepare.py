"""Prepare benchmark: throughput and peak memory of `raytrain prepare` on synthetic corpora, Ray pipeline beside the
single-process path measured in the same run, with planted-duplicate recall.

For each size (--mb, default 64 and 1024): a corpus from scripts/gen_corpus.py, then `raytrain prepare` in a fresh
process per engine (engine=local: this checkout in one process; engine=ray: a fresh local Ray instance, all
CPUs; --baseline-src DIR also runs another checkout's engine=local, e.g. the pre-pipeline code). Reported: wall
time, MB/s of input, peak RSS summed over the whole process tree (driver, raylet, GCS, workers; sampled every
0.5 s; and the sum of PSS, which counts shared pages once; the largest processes at the peak), disk used under Ray's
temp directory (spills), the machine's load average during the run, and from the run's report the exact / near duplicates removed
against those planted. Near-duplicate recall is per planted pair: a pair is found when its two documents share
an LSH bucket under the pipeline's own signatures and bands (what makes the pipeline drop one of them); the near
duplicates the run removed beyond the pairs found are counted as unique documents removed (an upper bound).
At the end, the acceptance ratios: peak RSS of the largest corpus over the smallest (engine=ray), and each
ray run's MB/s over the single-process path's (the baseline checkout if given, else this checkout's engine=local).

Single-process runs grow with the corpus (the old path held ~28x its input): --local-max-mb skips them above
that size.

Usage: .venv/bin/python scripts/bench_prepare.py [--mb 64 1024] [--engines local ray] [--baseline-src /path]
       [--baseline-path DIR] [--local-max-mb 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from raytrain.data.pipeline import spill_dir  # noqa: E402 - where a local Ray spills


def tree_memory(pid: int) -> tuple[int, int, list]:
    """(sum of RSS, sum of PSS, per process [(RSS MB, own MB, object-store MB, name)]) over the process and its
    descendants. RSS counts the object store's shared pages once per process that maps them; PSS shares them
    out, so its sum is the tree's real footprint."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0, []
    rss = pss = 0
    rows = []
    for q in procs:
        try:
            m = q.memory_full_info()
            rss, pss = rss + m.rss, pss + m.pss
            rows.append((m.rss >> 20, m.uss >> 20, _shmem(q.pid) >> 20, (" ".join(q.cmdline()[:2]) or q.name())[-48:]))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return rss, pss, sorted(rows, reverse=True)


def _shmem(pid: int) -> int:
    """Shared-memory pages this process maps (on Linux: RssShmem, the object store's pages it has touched)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(x.split()[1]) << 10 for x in f if x.startswith("RssShmem:")), 0)
    except OSError:
        return 0


def machine_cpu_s() -> float:
    """CPU seconds used by every process of this machine so far (/proc/stat): a Ray run's workers included."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")  # user nice system irq softirq steal


def output_bytes(out: Path) -> dict:
    """Bytes of the shard files and of the provenance files a prepare wrote."""
    shards = sum(f.stat().st_size for f in out.glob("*/shard-*"))
    prov = sum(f.stat().st_size for f in out.glob("*/provenance/*"))
    return {"shard_bytes": shards, "provenance_bytes": prov}


def run_prepare(src: Path, corpus: Path, out: Path, engine: str, timeout: float, json_flag: bool = True,
                extra_path: str = "", extra_args: tuple = ()) -> dict:
    cmd = [sys.executable, "-m", "raytrain", "prepare", f"inputs=[{corpus}]", f"out={out}", "vocab_size=2048",
           "seq_len=128", "shard_rows=1024", f"engine={engine}", "text_field=text", "tokenizer_sample_docs=20000",
           *extra_args]
    cmd += ["--json"] if json_flag else []  # older checkouts print their JSON report unasked
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src), extra_path])), "RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0"}
    t0, cpu0 = time.monotonic(), machine_cpu_s()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=str(src),
                            start_new_session=True)
    peak, peak_pss, loads, at_peak, disk0, disk = 0, 0, [], [], shutil.disk_usage(spill_dir()).used, 0
    while proc.poll() is None:
        rss, pss, procs = tree_memory(proc.pid)
        if rss > peak:
            peak, at_peak = rss, procs
        peak_pss = max(peak_pss, pss)
        disk = max(disk, shutil.disk_usage(spill_dir()).used - disk0)  # spills (and shards, if out is there)
        loads.append(os.getloadavg()[0])
        if time.monotonic() - t0 > timeout:
            proc.kill()
            break
        time.sleep(0.5)
    out_s, err_s = proc.communicate()
    wall, cpu = time.monotonic() - t0, machine_cpu_s() - cpu0
    if proc.returncode != 0:
        return {"error": err_s.decode()[-2000:], "wall_s": round(wall, 1)}
    text = out_s.decode()
    report = json.loads(text[text.index("{"):])
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), **output_bytes(out), "peak_rss_mb": round(peak / 2**20),
            "peak_pss_mb": round(peak_pss / 2**20), "disk_mb": round(disk / 2**20), "at_peak": at_peak[:12],
            "filters": report.get("filters", {}),
            "load_avg": f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f}"}


def planted_recall(d: Path, threshold: float = 0.9, seed: int = 0) -> dict:
    """{pairs, found}: planted near pairs whose documents share an LSH bucket under the pipeline's settings."""

    from raytrain.data import minhash
    from raytrain.data.quality import normalise

    planted = [json.loads(x) for x in (d / "planted.jsonl").read_text().splitlines()]
    near = [p for p in planted if p["kind"] == "near"]
    want = {p["id"] for p in near} | {p["of"] for p in near}
    text = {}
    for f in sorted((d / "corpus").glob("*.jsonl")):
        with open(f) as fh:
            for line in fh:
                doc = json.loads(line)
                if doc["id"] in want:
                    text[doc["id"]] = normalise(doc["text"])
    bands, rows = minhash.lsh_params(threshold, minhash.NUM_PERM)
    ids = sorted(want)
    keys = minhash.band_keys(minhash.signatures([text[i] for i in ids], seed=seed), bands, rows)
    at = {i: n for n, i in enumerate(ids)}
    found = sum(bool((keys[at[p["id"]]] == keys[at[p["of"]]]).any()) for p in near)
    return {"pairs": len(near), "found": found}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[64, 1024])
    ap.add_argument("--engines", nargs="+", default=["local", "ray"])
    ap.add_argument("--baseline-src", default=None, help="another checkout whose engine=local is measured too")
    ap.add_argument("--baseline-path", default="",
                    help="extra PYTHONPATH for the baseline (packages it needs that this venv dropped, e.g. datasketch: "
                         "pip install --target DIR datasketch scipy)")
    ap.add_argument("--local-max-mb", type=float, default=None,
                    help="single-process runs (engine=local, baseline) only for corpora up to this size")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", default=None)
    ap.add_argument("--provenance", type=int, default=0, metavar="REPEATS",
                    help="instead: the cost of provenance, runs with provenance=false and =true interleaved REPEATS "
                         "times per size (first engine only): CPU seconds of the whole machine and bytes written")
    a = ap.parse_args()
    from scripts.gen_corpus import generate

    if a.provenance:
        return provenance_cost(a, generate)

    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    results = []
    try:
        for mb in a.mb:
            d = tmp / f"c{mb:g}"
            info = generate(d, mb=mb, exact=0.02, near=0.02, threshold=0.9, seed=0, file_mb=16)
            runs = [("this", ROOT, e) for e in a.engines]
            if a.baseline_src:
                runs.insert(0, ("baseline", Path(a.baseline_src), "local"))
            if a.local_max_mb is not None and mb > a.local_max_mb:
                runs = [r for r in runs if r[2] != "local"]
            rec = planted_recall(d)
            for name, src, engine in runs:
                r = run_prepare(src, d / "corpus", tmp / "out", engine, a.timeout, json_flag=name == "this",
                                extra_path=a.baseline_path if name == "baseline" else "")
                shutil.rmtree(tmp / "out", ignore_errors=True)
                f = r.get("filters", {})
                r.update({"mb": mb, "code": name, "engine": engine, "mb_per_s": round(mb / r["wall_s"], 2),
                          "planted_exact": info["exact"], "planted_near": info["near"],
                          "exact_removed": f.get("dropped_exact_duplicate"),
                          "near_removed": f.get("dropped_near_duplicate"), "near_pairs_found": rec["found"],
                          "unique_docs": info["unique"]})
                if r.get("near_removed") is not None and name == "this":  # the pairs found are this code's
                    r["near_recall"] = round(rec["found"] / max(1, rec["pairs"]), 4)
                    r["unique_removed_max"] = max(0, r["near_removed"] - rec["found"])
                    r["unique_removed_pct"] = round(100 * r["unique_removed_max"] / max(1, info["unique"]), 3)
                r.pop("filters", None)
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "at_peak"}), flush=True)
            shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n| corpus | code | engine | wall s | MB/s | peak RSS (tree) MB | peak PSS (tree) MB | disk MB | load avg | exact removed / planted | "
          "near removed / planted | near pairs found | unique docs removed (max) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['mb']:g} MB | {r['code']} | {r['engine']} | {r['wall_s']} | {r['mb_per_s']} | "
              f"{r.get('peak_rss_mb', '-')} | {r.get('peak_pss_mb', '-')} | {r.get('disk_mb', '-')} | {r.get('load_avg', '-')} | {r.get('exact_removed')} / {r['planted_exact']} | "
              f"{r.get('near_removed')} / {r['planted_near']} | {r.get('near_recall', '-')} | "
              f"{r.get('unique_removed_max', '-')} ({r.get('unique_removed_pct', '-')} %) |")
    ok = [r for r in results if "error" not in r]
    ray = sorted((r for r in ok if r["code"] == "this" and r["engine"] == "ray"), key=lambda r: r["mb"])
    single = [r for r in ok if r["engine"] == "local" and r["code"] == ("baseline" if a.baseline_src else "this")]
    for r in ray[-1:]:
        print(f"\nat the peak of ray {r['mb']:g} MB, the largest processes (RSS MB, own MB, object store MB, name):")
        for row in r.get("at_peak", []):
            print(f"  {row[0]:>6} {row[1]:>6} {row[2]:>6}  {row[3]}")
    if len(ray) >= 2:
        print(f"\npeak RSS, ray: {ray[-1]['mb']:g} MB / {ray[0]['mb']:g} MB = "
              f"{ray[-1]['peak_rss_mb'] / ray[0]['peak_rss_mb']:.2f}x (target <= 1.5x); peak PSS: "
              f"{ray[-1]['peak_pss_mb'] / ray[0]['peak_pss_mb']:.2f}x")
    for s in single:
        for r in ray:
            print(f"throughput: ray {r['mb']:g} MB {r['mb_per_s']} MB/s / single-process ({s['code']}) {s['mb']:g} MB "
                  f"{s['mb_per_s']} MB/s = {r['mb_per_s'] / s['mb_per_s']:.2f}x (target >= 2x)")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


def provenance_cost(a, generate) -> int:
    """Provenance off and on, interleaved, on the same corpus; the ratios its acceptance states (issue 46)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-prov-"))
    rows = []
    try:
        for mb in a.mb:
            d = tmp / f"c{mb:g}"
            generate(d, mb=mb, exact=0.02, near=0.02, threshold=0.9, seed=0, file_mb=16)
            for rep in range(a.provenance):
                for on in (False, True):
                    r = run_prepare(ROOT, d / "corpus", tmp / "out", a.engines[0], a.timeout,
                                    extra_args=(f"provenance={str(on).lower()}",))
                    shutil.rmtree(tmp / "out", ignore_errors=True)
                    r = {k: v for k, v in r.items() if k not in ("at_peak", "filters")}
                    r.update({"mb": mb, "provenance": on, "repeat": rep})
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n| corpus | provenance | wall s | machine CPU s | shard MB | provenance MB | load avg |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mb']:g} MB | {'on' if r['provenance'] else 'off'} | {r.get('wall_s')} | {r.get('cpu_s')} | "
              f"{r.get('shard_bytes', 0) / 2**20:.1f} | {r.get('provenance_bytes', 0) / 2**20:.2f} | {r.get('load_avg')} |")
    for mb in a.mb:
        on = [r for r in rows if r["mb"] == mb and r["provenance"] and "error" not in r]
        off = [r for r in rows if r["mb"] == mb and not r["provenance"] and "error" not in r]
        if on and off:
            cpu = sum(r["cpu_s"] for r in on) / sum(r["cpu_s"] for r in off)
            size = on[0]["provenance_bytes"] / on[0]["shard_bytes"]
            print(f"{mb:g} MB: CPU time with / without provenance = {cpu:.3f} (target <= 1.10); provenance bytes / "
                  f"shard bytes = {size:.3f} (target <= 0.15)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
