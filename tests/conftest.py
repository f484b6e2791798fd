"""Shared fixtures: a synthetic corpus, prepared datasets, a moto S3 server and one Ray cluster (helpers: tests/helpers.py).

Everything runs on 127.0.0.1 and is started and stopped here. The Ray cluster is shared by the whole
session (starting one costs seconds on 2 cores); it is sized above the worker count so that Ray Data
always has CPUs (a Train job holding every CPU starves its own data pipeline).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raytrain.data.prepare import PrepareConfig, prepare
from tests.helpers import (REFERENCE, S3_RECORD, start_mlflow_server_install, start_moto, synthetic_docs,
                           write_lm_eval_tasks)


def pytest_collection_finish(session):
    """The MLflow server's venv is made while the tests before the first that needs it run."""
    if any("mlflow_server" in getattr(item, "fixturenames", ()) for item in session.items):
        start_mlflow_server_install()


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


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-protocol server (moto in server mode) on 127.0.0.1, with the standard AWS env set; every request's
    arrival is recorded in S3_RECORD (tests.helpers.s3_requests reads it)."""
    proc, endpoint = start_moto(record_path=S3_RECORD)
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3

    boto3.client("s3").create_bucket(Bucket="raytrain-test")
    yield endpoint
    from raytrain.audit import close_run_writers

    close_run_writers()  # their last anchors now, while the server is up (at exit they would find no endpoint)
    proc.terminate()
    proc.wait(timeout=10)
    if os.path.exists(S3_RECORD):
        os.unlink(S3_RECORD)
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    # Nothing after this may reach a real S3 endpoint (an S3 URI's default is AWS): unreachable on loopback instead.
    os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:1"


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


@pytest.fixture(scope="session")
def reference_run(ray_cluster, tiny_data, tmp_path_factory) -> dict:
    """The uninterrupted 2-worker run (12 steps, a checkpoint every 4) that the resume tests, the ray reader's and the
    TLS cluster's compare with, trained once per session; its summary (`run_uri` names it). Read it, never write."""
    from raytrain.trainer import train
    from tests.helpers import tiny_cfg

    cfg = tiny_cfg(tiny_data, tmp_path_factory.mktemp("reference"), "reference", *REFERENCE)
    return train(cfg, log=lambda *_: None)


@pytest.fixture(scope="session")
def lm_eval_tasks(tmp_path_factory) -> Path:
    """A directory of harness task YAMLs over the JSONL the tests ship (tests/helpers.py write_lm_eval_tasks)."""
    return write_lm_eval_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))
