"""The distributed prepare pipeline: planted duplicates are found (exact all, near >= 95 %, <= 1 % of unique
documents removed), and the output is byte-identical in this process, on Ray with any block layout, with 1 CPU,
and read from / written to S3."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain.data import pipeline
from raytrain.data.prepare import PrepareConfig, prepare
from raytrain.data.quality import clean_documents

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
        sig[split] = m
    sig["tokenizer"] = storage.read_text(f"{out}/tokenizer.json")
    return sig


def _cfg(inputs, out, **kw):
    return PrepareConfig(inputs=[str(inputs)], out=str(out), vocab_size=400, seq_len=64, shard_rows=100,
                         formats=["parquet", "webdataset"], **kw)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The in-process engine's output, several partitions."""
    out = tmp_path_factory.mktemp("ref") / "out"
    mp = pytest.MonkeyPatch()
    mp.setattr(pipeline, "PART_BYTES", 256 << 10)
    prepare(_cfg(corpus / "corpus", out, engine="local"), **QUIET)
    mp.undo()
    return _signature(str(out))


@pytest.mark.slow
def test_ray_output_is_byte_identical_whatever_the_blocks(corpus, reference, tmp_path, monkeypatch, ray_cluster):
    """On the session's 4-CPU Ray, with other block boundaries (normalise batches of 37 documents, one read
    block per file): the in-process engine's bytes."""
    monkeypatch.setattr(pipeline, "PART_BYTES", 256 << 10)
    monkeypatch.setattr(pipeline, "NORMALISE_BATCH", 37)
    assert len(reference["train"]["shards"]["parquet"]) >= 3 and reference["val"]["num_samples"] > 0
    r = prepare(_cfg(corpus / "corpus", tmp_path / "a", engine="ray"), **QUIET)
    assert r["engine"] == "ray" and r["filters"]["dropped_exact_duplicate"] > 0
    assert _signature(str(tmp_path / "a")) == reference


@pytest.mark.slow
def test_one_cpu_ray_from_and_to_s3_gives_the_same_bytes(corpus, reference, s3_server):
    """A fresh Ray instance with 1 CPU reads the corpus from the S3 server and writes the shards there."""
    from raytrain import storage

    for f in sorted((corpus / "corpus").glob("*.jsonl")):
        storage.upload_file(str(f), f"s3://raytrain-test/planted/{f.name}")
    out = "s3://raytrain-test/prepared-1cpu"
    code = ("import ray\nray.init(address='local', num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
            "from raytrain.data import pipeline\nfrom raytrain.data.prepare import PrepareConfig, prepare\n"
            "pipeline.PART_BYTES = 256 << 10\n"
            "prepare(PrepareConfig(inputs=['s3://raytrain-test/planted/*.jsonl'], out='" + out + "', vocab_size=400,"
            " seq_len=64, shard_rows=100, formats=['parquet', 'webdataset'], engine='ray'), log=lambda *_: None)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "RAY_ADDRESS": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    assert _signature(out) == reference
