"""Provenance and `raytrain data trace`: the documents of a step's global batch, reconstructed from the run directory
and the data's provenance, checked token for token against the raw inputs and against the checksum the run logged."""

from __future__ import annotations

import json

import pytest

from raytrain.cli import main
from raytrain.data.prepare import PrepareConfig, prepare
from tests.helpers import assert_traced, synthetic_docs, tiny_cfg


@pytest.fixture(scope="module")
def id_data(tmp_path_factory):
    """Documents that each carry a unique id, in JSONL (a line per document) and text files (a file each), with an
    exact duplicate whose surviving copy is decided by (hash, source, record)."""
    d = tmp_path_factory.mktemp("ids")
    (d / "in").mkdir()
    docs = [f"doc-{i:04d} {t}" for i, t in enumerate(synthetic_docs(160, seed=3))]
    with open(d / "in" / "b.jsonl", "w") as f:
        for t in docs[:100]:
            f.write(json.dumps({"text": t}) + "\n")
        f.write(json.dumps({"text": docs[5]}) + "\n")  # a duplicate, later in the same file
    for i, t in enumerate(docs[100:]):
        (d / "in" / f"a{i:03d}.txt").write_text(t)
    (d / "in" / "c.txt").write_text(docs[150])  # a duplicate in a file named after the original's
    out = d / "data"
    prepare(PrepareConfig(inputs=[str(d / "in")], out=str(out), vocab_size=300, seq_len=32, shard_rows=64,
                          near_dup_threshold=1.0, val_fraction=0.1), log=lambda *_: None)
    return out, d / "in"


def test_provenance_is_deterministic_and_keeps_the_first_copy(id_data, tmp_path):
    """The same inputs give the same provenance bytes (any engine: tests/test_prepare_pipeline.py compares them); of
    exact duplicates the copy kept is the smallest (source, record)."""
    from raytrain.data.provenance import Provenance

    out, inputs = id_data
    again = tmp_path / "again"
    prepare(PrepareConfig(inputs=[str(inputs)], out=str(again), vocab_size=300, seq_len=32, shard_rows=64,
                          near_dup_threshold=1.0, val_fraction=0.1), log=lambda *_: None)
    for f in sorted((out / "train" / "provenance").iterdir()):
        assert f.read_bytes() == (again / "train" / "provenance" / f.name).read_bytes(), f.name
    m = json.loads((out / "train" / "manifest.json").read_text())["provenance"]
    inputs_sha = {e["uri"]: e["sha256"] for e in m["inputs"]}
    import hashlib

    assert inputs_sha[str(inputs / "b.jsonl")] == hashlib.sha256((inputs / "b.jsonl").read_bytes()).hexdigest()
    # Where the duplicated documents came from: b.jsonl's first copy (record = its line's byte offset), a050.txt
    # rather than c.txt.
    import pyarrow.parquet as pq

    sources = []
    for split in ("train", "val"):
        for e in json.loads((out / split / "manifest.json").read_text())["provenance"]["documents"]:
            t = pq.read_table(out / split / e["path"]).to_pylist()
            sources += [(r["source"], r["record"], r["head"][:8]) for r in t]
    heads = [h for _, _, h in sources]
    assert len(heads) == len(set(heads)) == 160  # every id once: the duplicates dropped
    where = {h: (s, rec) for s, rec, h in sources}
    assert where["doc-0005"][0].endswith("b.jsonl") and where["doc-0005"][1] < (inputs / "b.jsonl").stat().st_size // 2
    assert where["doc-0150"][0].endswith("a050.txt")
    assert Provenance(str(out / "train")).spans(0)[0]["pos"] == 0


@pytest.mark.slow
def test_trace_names_every_document_of_a_step(ray_cluster, id_data, tmp_path, capsys):
    """2 workers: several steps' batches traced, each span equal token for token to its raw document, the rows
    covered, the checksum the run logged; --rank gives that rank's lanes; bad input is one line, exit 2."""
    from raytrain.trainer import train

    out, _ = id_data
    cfg = tiny_cfg(out, tmp_path, "traced", "run.max_steps=6", "run.log_every=2", "checkpoint.every_n_steps=100",
                   "checkpoint.save_final=false", "checkpoint.memory=false")
    train(cfg, log=lambda *_: None)
    traced = assert_traced(cfg.run_uri, [1, 2, 5, 6])
    assert traced[2]["checksum_matches"] and traced[5]["checksum_matches"] is None  # 5 is not a log step
    ids = {s["head"][:8] for r in traced[6]["rows"] for s in r["spans"]}
    assert ids and all(i.startswith("doc-") for i in ids)
    assert main(["data", "trace", cfg.run_uri, "--step", "6", "--rank", "1", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert [r["lane"] for r in one["rows"]] == list(range(cfg.global_batch // 2, cfg.global_batch))
    assert main(["data", "trace", cfg.run_uri, "--step", "2"]) == 0
    text = capsys.readouterr().out
    assert "logged at this step, equal" in text and "doc-" in text
    # Bad input: a step the run never reached; a rank it never had.
    assert main(["data", "trace", cfg.run_uri, "--step", "7"]) == 2
    assert "reached step 6" in capsys.readouterr().err
    assert main(["data", "trace", cfg.run_uri, "--step", "3", "--rank", "2"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_trace_refuses_data_prepared_without_provenance(tmp_path, capsys):
    """Data prepared with provenance=false: one line, exit 2 (here through the split's own reader)."""
    from raytrain.data.provenance import Provenance
    from raytrain.errors import UserError

    (tmp_path / "in.txt").write_text("\n".join(synthetic_docs(40)))
    prepare(PrepareConfig(inputs=[str(tmp_path / "in.txt")], out=str(tmp_path / "d"), vocab_size=300, seq_len=32,
                          text_mode="line", provenance=False, val_fraction=0.0), log=lambda *_: None)
    with pytest.raises(UserError, match="prepared with provenance=false"):
        Provenance(str(tmp_path / "d" / "train"))
    m = json.loads((tmp_path / "d" / "train" / "manifest.json").read_text())["provenance"]
    assert m["inputs"] is None and not m["spans"] and not (tmp_path / "d" / "train" / "provenance").exists()
    # The same refusal from a command: one line, exit 2.
    assert main(["data", "contamination", str(tmp_path / "d"), "--file", str(tmp_path / "in.txt")]) == 2
    err = capsys.readouterr().err
    assert "provenance=false" in err and err.count("\n") == 1
