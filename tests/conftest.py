"""Shared fixtures: a synthetic learnable corpus, prepared datasets, a moto S3 server and one Ray cluster.

Everything runs on 127.0.0.1 and is started and stopped here. The Ray cluster is shared by the whole
session (starting one costs seconds on 2 cores); it is sized above the worker count so that Ray Data
always has CPUs (pitfalls #1).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain.config import load_config
from raytrain.data.prepare import PrepareConfig, prepare

WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def synthetic_docs(n_docs: int = 120, seed: int = 0) -> list[str]:
    """Counting sequences starting at random words: easy to learn, so loss must fall fast."""
    import random

    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        start = rng.randrange(len(WORDS))
        docs.append(" ".join(WORDS[(start + i) % len(WORDS)] for i in range(rng.randrange(40, 120))) + ".")
    return docs


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for i, doc in enumerate(synthetic_docs()):
        (d / f"doc{i:04d}.txt").write_text(doc)
    return d


@pytest.fixture(scope="session")
def tiny_data(corpus_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "synthetic"
    prepare(PrepareConfig(inputs=[str(corpus_dir)], out=str(out), vocab_size=300, seq_len=32, shard_rows=64,
                          near_dup_threshold=1.0,  # counting sequences are near duplicates by design
                          val_fraction=0.1), log=lambda *_: None)
    return out


def tiny_cfg(data: Path | str, storage: Path | str, name: str, *overrides: str):
    """The smallest useful run: 2 workers, ZeRO-2, a 1-layer GPT on 32-token sequences."""
    return load_config("tiny", [
        f"data.train={data}/train", f"data.val={data}/val", f"checkpoint.storage={storage}", f"run.name={name}",
        "model.n_layer=1", "model.hidden_size=32", "model.n_head=2", "model.seq_len=32",
        "batch.micro_batch_size=4", "optim.lr=3e-3", "optim.warmup_steps=2", "run.log_every=1",
        "run.eval_every=0", "data.eval_samples=16", "checkpoint.every_n_steps=5", "run.max_steps=10",
        "run.max_failures=0", *overrides,
    ])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    """Start a moto S3 server on a free 127.0.0.1 port; returns (process, endpoint) once it listens."""
    port = _free_port()
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    pytest.fail("moto_server did not start")


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-protocol server (moto in server mode) on 127.0.0.1, with the standard AWS env set."""
    proc, endpoint = start_moto()
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3

    boto3.client("s3").create_bucket(Bucket="raytrain-test")
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def ray_cluster(s3_server):
    """One local Ray cluster for the session; workers inherit the S3 settings from this process."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    # Worker logs stay in Ray's session directory instead of being echoed here: echoed lines arrive at any
    # moment, even during a later test, and would mix into the CLI output those tests capture and parse.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
