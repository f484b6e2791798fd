"""The distributed prepare pipeline: planted duplicates are found (exact all, near >= 95 %, <= 1 % of unique
documents removed), and the output is byte-identical in this process, on Ray with any block layout, with 1 CPU
reading from and writing to S3, and submitted (`ray job submit -- raytrain prepare`) to a 2-node cluster from
scripts/local_cluster.sh reading from and writing to S3."""

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from raytrain.data import pipeline
from raytrain.data.prepare import PrepareConfig, prepare
from raytrain.data.stages import clean_documents
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
QUIET = {"log": lambda *_: None}


def _gen():
    spec = importlib.util.spec_from_file_location("gen_corpus", ROOT / "scripts" / "gen_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 1.5 MB in 6 files; 4 % exact and 4 % near copies (Jaccard in [0.9, 0.97]) planted and recorded."""
    d = tmp_path_factory.mktemp("planted")
    info = _gen().generate(d, mb=1.5, exact=0.04, near=0.04, threshold=0.9, seed=3, file_mb=0.25)
    assert info["exact"] >= 20 and info["near"] >= 20 and info["files"] >= 6
    return d


def _docs(d):
    return [json.loads(x) for f in sorted((d / "corpus").glob("*.jsonl")) for x in f.read_text().splitlines()]


def test_planted_duplicates_are_found(corpus):
    docs = _docs(corpus)
    planted = [json.loads(x) for x in (corpus / "planted.jsonl").read_text().splitlines()]
    assert all(0.9 <= p["jaccard"] <= 0.97 for p in planted if p["kind"] == "near")
    kept, counts = clean_documents([d["text"] for d in docs], 1, 0, 0.9, False, 0)
    kept = set(kept)  # the generator's text is already normalised: kept texts name the documents kept
    text = {d["id"]: d["text"] for d in docs}
    exact = [p for p in planted if p["kind"] == "exact"]
    near = [p for p in planted if p["kind"] == "near"]
    assert counts["dropped_exact_duplicate"] == len(exact)  # every exact copy, and nothing else
    found = sum(not (text[p["id"]] in kept and text[p["of"]] in kept) for p in near)
    assert found / len(near) >= 0.95, (found, len(near))
    involved = {p["id"] for p in planted} | {p["of"] for p in planted}
    unique = [i for i in text if i not in involved]
    removed = sum(text[i] not in kept for i in unique)
    assert removed / len(unique) <= 0.01, (removed, len(unique))


def test_tokenizer_sample_reaching_the_driver_is_bounded_in_characters(corpus, tmp_path, monkeypatch):
    """tokenizer_sample_docs=0 ("all") still draws only about twice the character cap to the driver."""
    cap = 50_000
    monkeypatch.setattr(pipeline, "TOKENIZER_SAMPLE_CHARS", cap)
    real, seen = pipeline.tokenizer_sample, {}

    def spy(rows, limit):
        seen["drawn"] = sum(len(r["text"]) for r in rows)
        sample = real(rows, limit)
        seen["sample"] = sum(map(len, sample))
        return sample

    monkeypatch.setattr(pipeline, "tokenizer_sample", spy)
    prepare(PrepareConfig(inputs=[str(corpus / "corpus")], out=str(tmp_path / "o"), vocab_size=300,
                          tokenizer_sample_docs=0, engine="local"), **QUIET)
    total = sum(len(d["text"]) for d in _docs(corpus))
    assert total > 20 * cap and cap <= seen["sample"] < cap + 20_000 and seen["drawn"] < 3 * cap, (seen, total)


def _signature(out: str) -> dict:
    """What must not depend on where and how the pipeline ran: manifests (less location) and every shard sha256."""
    from raytrain import storage

    sig = {}
    for split in ("train", "val"):
        m = json.loads(storage.read_text(f"{out}/{split}/manifest.json"))
        for entries in m["shards"].values():
            for e in entries:
                e.pop("uri")
        for k in ("out", "engine", "inputs"):
            m["prepare"].pop(k)
        # Provenance names the inputs where they were read (their digests must agree; the span tables too).
        for e in m["provenance"]["inputs"]:
            e.pop("uri")
        for e in m["provenance"]["documents"]:
            e.pop("sha256"), e.pop("bytes")
        sig[split] = m
    sig["tokenizer"] = storage.read_text(f"{out}/tokenizer.json")
    return sig


def _cfg(inputs, out, **kw):
    return PrepareConfig(inputs=[str(inputs)], out=str(out), **SETTINGS, **kw)


# Small partitions (256 kB of input each): the 1.5 MB corpus spreads over 6 of them, so the output depends on
# cross-partition order, offsets and merged statistics being deterministic, not just on one task's work.
SETTINGS = dict(vocab_size=400, seq_len=64, shard_rows=100, formats=["parquet", "webdataset"], partition_mb=0.25)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The in-process engine's output, several partitions."""
    out = tmp_path_factory.mktemp("ref") / "out"
    prepare(_cfg(corpus / "corpus", out, engine="local"), **QUIET)
    return _signature(str(out))


@pytest.fixture(scope="module")
def s3_corpus(corpus, s3_server) -> str:
    """The planted corpus uploaded to the S3 server; its glob."""
    from raytrain import storage

    for f in sorted((corpus / "corpus").glob("*.jsonl")):
        storage.upload_file(str(f), f"s3://raytrain-test/planted/{f.name}")
    return "s3://raytrain-test/planted/*.jsonl"


@pytest.mark.slow
def test_ray_output_is_byte_identical_whatever_the_blocks(corpus, reference, tmp_path, monkeypatch, ray_cluster):
    """On the session's 4-CPU Ray, with other block boundaries (normalise batches of 37 documents, every file
    read in 50 kB ranges by separate tasks): the in-process engine's bytes."""
    from raytrain.data import inputs

    monkeypatch.setattr(pipeline, "NORMALISE_BATCH", 37)
    monkeypatch.setattr(inputs, "READ_RANGE_BYTES", 50_000)
    assert len(reference["train"]["shards"]["parquet"]) >= 3 and reference["val"]["num_samples"] > 0
    r = prepare(_cfg(corpus / "corpus", tmp_path / "a", engine="ray"), **QUIET)
    assert r["engine"] == "ray" and r["filters"]["dropped_exact_duplicate"] > 0
    assert _signature(str(tmp_path / "a")) == reference


@pytest.mark.slow
def test_one_cpu_ray_from_and_to_s3_gives_the_same_bytes(s3_corpus, reference):
    """A fresh Ray instance with 1 CPU reads the corpus from the S3 server and writes the shards there."""
    out = "s3://raytrain-test/prepared-1cpu"
    code = ("import ray\nray.init(address='local', num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
            "from raytrain.data.prepare import PrepareConfig, prepare\n"
            f"prepare(PrepareConfig(inputs=[{s3_corpus!r}], out={out!r}, engine='ray', **{SETTINGS!r}),"
            " log=lambda *_: None)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "RAY_ADDRESS": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    assert _signature(out) == reference


def _cluster_nodes(dash: int) -> list[dict]:
    """The cluster's nodes from the dashboard's state API (plain HTTP with the token: pitfalls #2)."""
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    req = urllib.request.Request(f"http://127.0.0.1:{dash}/api/v0/nodes?detail=1&limit=100",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["data"]["result"]["result"]


@pytest.fixture(scope="module")
def two_node_cluster(s3_server, tmp_path_factory):
    """scripts/local_cluster.sh with a head of 1 CPU and one worker node of 1 CPU that the autoscaler starts at
    once (min_workers 1), S3 settings in its environment. Yields (dashboard port, env for `ray job submit`)."""
    import yaml

    cfg = yaml.safe_load((ROOT / "cluster" / "local-fake.yaml").read_text())
    cfg["max_workers"] = 1
    cfg["available_node_types"] = {
        "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
        "cpu": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 1, "max_workers": 1},
    }
    path = tmp_path_factory.mktemp("cluster") / "two-nodes.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    port, dash = free_port(), free_port()
    env = {**os.environ, "RAYTRAIN_CLUSTER_PORT": str(port), "RAYTRAIN_CLUSTER_DASHBOARD_PORT": str(dash),
           "RAYTRAIN_CLUSTER_CONFIG": str(path), "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    script = str(ROOT / "scripts" / "local_cluster.sh")
    up = subprocess.run([script, "up"], env=env, capture_output=True, text=True, timeout=300)
    try:
        if up.returncode != 0:
            pytest.skip(f"the fake_multinode cluster did not start (RAY_FAKE_CLUSTER=1 ray start): "
                        f"{(up.stdout + up.stderr).strip().splitlines()[-1:]}")
        t0 = time.monotonic()
        while sum(n["state"] == "ALIVE" for n in _cluster_nodes(dash)) < 2:
            # Liveness guard only: the node normally joins within seconds of `up`; 120 s only catches one that never does.
            assert time.monotonic() - t0 < 120, f"the worker node did not join in 120 s: {_cluster_nodes(dash)}"
            time.sleep(2)
        yield dash, env
    finally:
        subprocess.run([script, "down"], env=env, capture_output=True, timeout=120)


@pytest.mark.slow
def test_two_node_cluster_job_from_and_to_s3_gives_the_same_bytes(s3_corpus, reference, two_node_cluster):
    """`ray job submit -- raytrain prepare ... engine=ray` on a 2-node cluster, S3 in and out: the same bytes as
    the in-process engine, with the pipeline's tasks spread over both nodes."""
    dash, env = two_node_cluster
    out = "s3://raytrain-test/prepared-2nodes"
    settings = [f"{k}={json.dumps(v)}" for k, v in SETTINGS.items()]
    job = subprocess.run([str(Path(sys.executable).parent / "ray"), "job", "submit",
                          f"--address=http://127.0.0.1:{dash}", "--", "raytrain", "prepare", f"inputs=[{s3_corpus}]",
                          f"out={out}", "engine=ray", *settings],
                         env=env, capture_output=True, text=True, timeout=600)
    assert job.returncode == 0 and "engine ray" in job.stdout, (job.stdout + job.stderr)[-3000:]
    assert _signature(out) == reference
    nodes = [n for n in _cluster_nodes(dash) if n["state"] == "ALIVE"]
    assert len(nodes) == 2, nodes
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    req = urllib.request.Request(f"http://127.0.0.1:{dash}/api/v0/tasks?detail=1&limit=10000",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        tasks = json.loads(resp.read())["data"]["result"]["result"]
    used = {t["node_id"] for t in tasks if t.get("node_id") and "Map" in (t.get("name") or "")}
    assert used == {n["node_id"] for n in nodes}, (used, [(t.get("name"), t.get("node_id")) for t in tasks][:20])


def test_too_little_spill_disk_fails_before_any_work_and_tight_disk_warns(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    lines = []
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(0, 0, 3 << 30))
    pipeline.check_spill_space(1 << 30, lines.append)  # 3 GB free for 1 GB of input: tight
    assert len(lines) == 1 and "warning: 3.0 GB free in " + str(tmp_path) in lines[0] and "about 4.0 GB" in lines[0]
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(0, 0, 1 << 30))
    with pytest.raises(pipeline.UserError, match="1.0 GB free in .*set RAY_TMPDIR to a directory on a larger disk"):
        pipeline.check_spill_space(1 << 30, lines.append)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(0, 0, 8 << 30))
    pipeline.check_spill_space(1 << 30, lines.append)
    assert len(lines) == 1
