"""Data benchmark: prepare throughput, and ingest throughput into a training worker, each beside a raw baseline
measured in the same run.

  prepare: `raytrain prepare` end to end (MB/s of input text, tokens/s written), beside the tokenizer alone
           (encode_batch over the same documents: the floor no pipeline around it can beat).
  ingest:  tokens/s a training worker (a Ray actor with 1 CPU) gets from the training reader (PlannedReader:
           the sample plan's order, one rank holding all 64 lanes), for Parquet and WebDataset, beside a raw
           pyarrow read of the same shard files in the same worker (Parquet: read_table; tar: the bytes),
           from local disk and from an S3-protocol server (moto) on 127.0.0.1.

Usage: .venv/bin/python scripts/bench_data.py [--quick] [--json out.json]
Prints a Markdown table (paste into docs/BENCHMARKS.md) and the raw figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _moto() -> tuple[subprocess.Popen, str]:
    from tests.helpers import start_moto  # the same local S3 server the tests use

    proc, endpoint = start_moto()
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")
    return proc, endpoint


def bench_prepare(out: str, max_chars: int, seq_len: int) -> dict:
    from raytrain.data.corpus import python_docs
    from raytrain.data.prepare import PrepareConfig, prepare, train_tokenizer

    import rensa  # noqa: F401 - imports (webdataset pulls in torch) are a one-off cost, not throughput
    import webdataset  # noqa: F401

    docs = list(python_docs(max_chars))
    mb = sum(len(d.encode()) for d in docs) / 1e6
    cfg = PrepareConfig(inputs=["python-docs"], out=out, max_chars=max_chars, seq_len=seq_len, shard_rows=256,
                        formats=["parquet", "webdataset"], engine="local")
    t = time.perf_counter()
    report = prepare(cfg, log=lambda *_: None)
    dt = time.perf_counter() - t
    tokens = report["train"]["tokens"] + report["val"]["tokens"]
    tok = train_tokenizer(docs, cfg.vocab_size)
    t = time.perf_counter()
    raw_tokens = sum(len(e.ids) for e in tok.encode_batch(docs))
    dt_tok = time.perf_counter() - t
    return {"text_mb": mb, "prepare_s": dt, "prepare_mb_per_s": mb / dt, "prepare_tokens_per_s": tokens / dt,
            "tokenizer_only_tokens_per_s": raw_tokens / dt_tok, "tokens": tokens,
            "shards_per_format": report["train"]["shards"]}


def ingest_in_worker(split_uri: str, fmt: str, epochs: int) -> dict:
    """Runs inside the worker actor: the training reader's throughput, then a raw pyarrow read of the same shards."""
    import pyarrow.parquet as pq

    from raytrain import storage
    from raytrain.data.manifest import load_split
    from raytrain.data.sample_plan import SamplePlan
    from raytrain.data.reader import PlannedReader

    split = load_split(split_uri, fmt=fmt)
    gb = 64
    plan = SamplePlan.for_split(split, seed=0, global_batch=gb)
    steps = plan.steps_per_epoch * epochs
    # End to end from a cold start, as a worker sees it: the first units' reads included.
    t = time.perf_counter()
    reader = PlannedReader(split, plan, (0, gb), 0, end_step=steps)
    reader.take(0)
    startup = time.perf_counter() - t
    for step in range(1, steps):
        reader.take(step)
    dt = time.perf_counter() - t
    c = reader.counters()
    reader.close()
    tokens = steps * gb * (split.seq_len + 1)
    t = time.perf_counter()
    raw = 0
    for _ in range(epochs):
        for uri, rows in zip(split.shard_uris, split.shard_rows):
            fs, path = storage.resolve(uri)
            if fmt == "parquet":
                pq.read_table(path, filesystem=fs, columns=["tokens"])
            else:
                with fs.open_input_stream(path) as f:
                    f.read()
            raw += rows * (split.seq_len + 1)
    dt_raw = time.perf_counter() - t
    return {"tokens_per_s": tokens / dt, "startup_s": startup, "raw_pyarrow_tokens_per_s": raw / dt_raw,
            "read_amplification": c["rows_read"] / c["rows_trained"],
            "bytes_fetched_per_split_byte": c["bytes_fetched"] / (epochs * sum(
                fs.get_file_info(p).size for fs, p in map(storage.resolve, split.shard_uris)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small corpus, two epochs: a smoke run in a minute or two")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    max_chars, epochs, seq_len = (300_000, 2, 128) if args.quick else (3_000_000, 10, 128)

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    proc, endpoint = _moto()
    tmp = tempfile.mkdtemp(prefix="bench_data_")
    try:
        import ray

        from raytrain import storage

        results: dict = {"date": time.strftime("%Y-%m-%d"), "quick": args.quick,
                         "machine": f"{os.cpu_count()}-core {platform.machine()}, Python {platform.python_version()}"}
        local = os.path.join(tmp, "ds")
        results["prepare"] = bench_prepare(local, max_chars, seq_len)
        s3 = "s3://bench/ds"
        for p in Path(local).rglob("*"):
            if p.is_file():
                storage.upload_file(str(p), storage.join(s3, str(p.relative_to(local))))
        from raytrain.ray_auth import ensure_token

        ensure_token()
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        worker = ray.remote(num_cpus=1)(ingest_in_worker)
        results["ingest"] = []
        for where, base in (("local", local), ("s3", s3)):
            for fmt in ("parquet", "webdataset"):
                r = ray.get(worker.remote(f"{base}/train", fmt, epochs))
                results["ingest"].append({"where": where, "format": fmt, **r})
        ray.shutdown()
    finally:
        proc.terminate()
        shutil.rmtree(tmp, ignore_errors=True)

    p = results["prepare"]
    print(f"\nprepare ({p['text_mb']:.2f} MB of text, Parquet + WebDataset): {p['prepare_mb_per_s']:.2f} MB/s, "
          f"{p['prepare_tokens_per_s']:,.0f} tokens/s end to end; tokenizer alone {p['tokenizer_only_tokens_per_s']:,.0f} "
          f"tokens/s (ratio {p['prepare_tokens_per_s'] / p['tokenizer_only_tokens_per_s']:.2f})\n")
    print("| storage | format | training reader tokens/s (cold start) | raw pyarrow read tokens/s | ratio | "
          "first batch after s | read amplification | bytes fetched / split bytes |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results["ingest"]:
        print(f"| {r['where']} | {r['format']} | {r['tokens_per_s']:,.0f} | "
              f"{r['raw_pyarrow_tokens_per_s']:,.0f} | {r['tokens_per_s'] / r['raw_pyarrow_tokens_per_s']:.2f} | "
              f"{r['startup_s']:.2f} | {r['read_amplification']:.3f} | {r['bytes_fetched_per_split_byte']:.3f} |")
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
