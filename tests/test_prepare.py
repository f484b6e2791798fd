"""`raytrain prepare`: tokenizer, packing, split by document, Parquet shards and manifest; bad input."""

import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from raytrain.data.manifest import load_split
from raytrain.data.prepare import EOT, PrepareConfig, load_prepare_config, prepare
from raytrain.errors import UserError


def test_prepare_writes_shards_manifest_and_tokenizer(tiny_data):
    tok = Tokenizer.from_file(str(tiny_data / "tokenizer.json"))
    assert tok.get_vocab_size() <= 300 and tok.token_to_id(EOT) is not None
    train, val = load_split(str(tiny_data / "train")), load_split(str(tiny_data / "val"))
    assert train.seq_len == 32 and train.num_samples > 50 and val.num_samples >= 1
    m = json.loads((tiny_data / "train" / "manifest.json").read_text())
    assert m["formats"] == ["parquet"] and m["prepare"]["vocab_size"] == 300 and m["tokenizer"] == "../tokenizer.json"
    assert sum(s["rows"] for s in m["shards"]["parquet"]) == m["num_samples"] == train.num_samples
    rows = np.concatenate([
        np.stack(pq.read_table(tiny_data / "train" / s["path"])["tokens"].to_numpy(zero_copy_only=False))
        for s in m["shards"]["parquet"]
    ])
    assert rows.shape == (train.num_samples, 33)
    # Real text round-trips through the tokenizer.
    text = tok.decode(rows[0].tolist())
    assert any(w in text for w in ("one", "two", "three"))


def test_split_is_by_document(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": f"document number {i} " * 30}) for i in range(40)))
    report = prepare(PrepareConfig(inputs=[str(docs)], out=str(tmp_path / "out"), vocab_size=300, seq_len=16,
                                   val_fraction=0.2, near_dup_threshold=1.0), log=lambda *_: None)
    assert report["train"]["documents"] + report["val"]["documents"] == 40
    assert 3 <= report["val"]["documents"] <= 14  # drawn by document hash: about 20 %


def test_builtin_corpus_is_real_text():
    from raytrain.data.corpus import python_docs

    docs = list(python_docs(max_chars=200_000))
    assert len(docs) > 50 and sum(map(len, docs)) > 100_000
    assert " the " in docs[0]


@pytest.mark.parametrize("setup, needle", [
    (lambda d: [str(d / "missing*.txt")], "matches no files"),
    (lambda d: ((d / "e.txt").write_text("   "), [str(d / "e.txt")])[1], "no usable documents"),
    (lambda d: ((d / "x.jsonl").write_text('{"body": "hi"}\n'), [str(d / "x.jsonl")])[1], "'text' field"),
])
def test_prepare_bad_input(tmp_path, setup, needle):
    inputs = setup(tmp_path)
    with pytest.raises(UserError, match=needle):
        prepare(PrepareConfig(inputs=inputs, out=str(tmp_path / "out"), vocab_size=300), log=lambda *_: None)
    assert not (tmp_path / "out" / "train" / "manifest.json").exists()


def test_prepare_config_unknown_key():
    with pytest.raises(UserError, match="vocab"):
        load_prepare_config(None, ["vocab=10"])


def test_prepare_cli(tmp_path, corpus_dir):
    cmd = [sys.executable, "-m", "raytrain", "prepare", f"inputs=[{corpus_dir}]", f"out={tmp_path}/d",
           "vocab_size=300", "seq_len=16", "near_dup_threshold=1.0"]
    r = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)  # nothing but the JSON on stdout
    assert report["train"]["samples"] > 0 and report["documents"] == 120
    # Without --json: a few lines for a person, no warnings.
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "Warning" not in out and "WARNING" not in out and len(out.splitlines()) <= 10, out
    assert "documents  120 in, " in out and f"{tmp_path}/d/report.md" in out
    assert f"{report['train']['samples']:,} sequences" in out


def test_prepare_config_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("inputs: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_prepare_config(str(bad), [])
    bad.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="must be a mapping"):
        load_prepare_config(str(bad), [])


def test_report_has_a_length_histogram(tiny_data):
    png = (tiny_data / "doc_lengths.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    assert "](doc_lengths.png)" in (tiny_data / "report.md").read_text()
