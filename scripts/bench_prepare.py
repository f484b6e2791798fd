"""Prepare benchmark: throughput and peak memory of `raytrain prepare` on synthetic corpora, Ray pipeline beside the
single-process path measured in the same run, with planted-duplicate recall.

For each size (--mb, default 64 and 1024): a corpus from scripts/gen_corpus.py, then `raytrain prepare` in a fresh
process per engine (engine=local: this checkout in one process; engine=ray: a fresh local Ray instance, all
CPUs; --baseline-src DIR also runs another checkout's engine=local, e.g. the pre-pipeline code). Reported: wall
time, MB/s of input, peak RSS summed over the whole process tree (driver, raylet, GCS, workers; sampled every
0.5 s), and from the run's report the exact / near duplicates removed against those planted.

Usage: .venv/bin/python scripts/bench_prepare.py [--mb 64 1024] [--engines local ray] [--baseline-src /path]
       [--json out.json]
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


def tree_rss(pid: int) -> int:
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_prepare(src: Path, corpus: Path, out: Path, engine: str, timeout: float, json_flag: bool = True) -> dict:
    cmd = [sys.executable, "-m", "raytrain", "prepare", f"inputs=[{corpus}]", f"out={out}", "vocab_size=2048",
           "seq_len=128", "shard_rows=1024", f"engine={engine}", "text_field=text", "tokenizer_sample_docs=20000"]
    cmd += ["--json"] if json_flag else []  # older checkouts print their JSON report unasked
    env = {**os.environ, "PYTHONPATH": str(src), "RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=str(src),
                            start_new_session=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        if time.monotonic() - t0 > timeout:
            proc.kill()
            break
        time.sleep(0.5)
    out_s, err_s = proc.communicate()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        return {"error": err_s.decode()[-2000:], "wall_s": wall}
    text = out_s.decode()
    report = json.loads(text[text.index("{"):])
    return {"wall_s": round(wall, 1), "peak_rss_mb": round(peak / 2**20), "filters": report.get("filters", {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[64, 1024])
    ap.add_argument("--engines", nargs="+", default=["local", "ray"])
    ap.add_argument("--baseline-src", default=None, help="another checkout whose engine=local is measured too")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from scripts.gen_corpus import generate

    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    results = []
    try:
        for mb in a.mb:
            d = tmp / f"c{mb:g}"
            info = generate(d, mb=mb, exact=0.02, near=0.02, threshold=0.9, seed=0, file_mb=16)
            runs = [("this", ROOT, e) for e in a.engines]
            if a.baseline_src:
                runs.insert(0, ("baseline", Path(a.baseline_src), "local"))
            for name, src, engine in runs:
                r = run_prepare(src, d / "corpus", tmp / "out", engine, a.timeout, json_flag=name == "this")
                shutil.rmtree(tmp / "out", ignore_errors=True)
                f = r.get("filters", {})
                r.update({"mb": mb, "code": name, "engine": engine, "mb_per_s": round(mb / r["wall_s"], 2),
                          "planted_exact": info["exact"], "planted_near": info["near"],
                          "exact_removed": f.get("dropped_exact_duplicate"),
                          "near_removed": f.get("dropped_near_duplicate")})
                r.pop("filters", None)
                results.append(r)
                print(json.dumps(r), flush=True)
            shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n| corpus | code | engine | wall s | MB/s | peak RSS (tree) MB | exact removed / planted | near removed / planted |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['mb']:g} MB | {r['code']} | {r['engine']} | {r['wall_s']} | {r['mb_per_s']} | "
              f"{r.get('peak_rss_mb', '-')} | {r.get('exact_removed')} / {r['planted_exact']} | "
              f"{r.get('near_removed')} / {r['planted_near']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
