"""`raytrain prepare` inputs: text per file / per line, JSONL, Parquet, local and s3://, in this process and as a
Ray Data pipeline; invalid UTF-8 replaced or dropped and counted; bad inputs named in one line; tokenizers."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from raytrain import storage
from raytrain.data.prepare import EOT, PrepareConfig, prepare
from raytrain.errors import UserError

QUIET = {"log": lambda *_: None}
DOCS = [f"document {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(30)) for i in range(12)]


def _write_inputs(root):
    """The same 12 documents as .txt files, lines of one .txt, JSONL and Parquet."""
    (root / "files").mkdir()
    for i, d in enumerate(DOCS[:4]):
        (root / "files" / f"{i:02d}.txt").write_text(d)
    (root / "lines.txt").write_text("\n\n".join(DOCS[4:6]) + "\n")  # blank lines are not documents
    (root / "recs.jsonl").write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS[6:9])))
    pq.write_table(pa.table({"body": DOCS[9:], "n": [1, 2, 3]}), root / "table.parquet")


def _read(inputs, out, **kw):
    """The documents `prepare` read (all of them land in the review sample: no val split, no near-dedup), sorted,
    and its counts."""
    report = prepare(PrepareConfig(inputs=inputs, out=str(out), vocab_size=260, seq_len=4, val_fraction=0.0,
                                   near_dup_threshold=1.0, review_samples=100, **kw), **QUIET)
    review = storage.read_text(storage.join(str(out), "review_sample.jsonl")).splitlines()
    return sorted(json.loads(x)["text"] for x in review), report["filters"]


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("engine", ["local", "ray"])
def test_every_input_kind_in_order(tmp_path, where, engine, s3_server, ray_cluster):
    _write_inputs(tmp_path)
    base = str(tmp_path)
    if where == "s3":
        base = f"s3://raytrain-test/inputs-{engine}"
        for p in tmp_path.rglob("*"):
            if p.is_file():
                storage.upload_file(str(p), f"{base}/{p.relative_to(tmp_path)}")
    inputs = [f"{base}/files/*.txt", f"{base}/lines.txt", f"{base}/recs.jsonl", f"{base}/table.parquet"]
    docs, counts = _read(inputs, tmp_path / "out", text_field="body", text_mode="line", engine=engine)
    assert docs == sorted(DOCS) and counts["input"] == len(DOCS) == counts["kept"]


def test_invalid_utf8_replaced_or_dropped_and_counted(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"good text here")
    (tmp_path / "b.txt").write_bytes(b"bad \xff\xfe bytes here")
    docs, counts = _read([str(tmp_path / "*.txt")], tmp_path / "r", invalid_utf8="replace", engine="local")
    assert docs == ["bad \ufffd\ufffd bytes here", "good text here"] and counts["invalid_utf8_replaced"] == 1
    docs, counts = _read([str(tmp_path / "*.txt")], tmp_path / "d", invalid_utf8="drop", engine="local")
    assert docs == ["good text here"] and counts["dropped_invalid_utf8"] == 1
    report = prepare(PrepareConfig(inputs=[str(tmp_path / "*.txt")], out=str(tmp_path / "o"), vocab_size=260,
                                   seq_len=4, val_fraction=0.0, invalid_utf8="drop"), **QUIET)
    assert report["filters"]["input"] == 2 and report["filters"]["dropped_invalid_utf8"] == 1
    assert report["filters"]["kept"] == 1


@pytest.mark.parametrize("name, content, needle", [
    ("x.jsonl", b'{"text": "fine"}\n{"body": "no text field"}\n', r"x.jsonl:2: record has no 'text' field"),
    ("x.jsonl", b'{"text": "fine"}\nnot json\n', r"x.jsonl:2: not valid JSON"),
    ("x.parquet", None, r"x.parquet: Parquet file has no column 'text' \(columns: body\)"),
    ("x.parquet", b"PAR1 this is not parquet", r"x.parquet: not a readable Parquet file"),
])
@pytest.mark.parametrize("engine", ["local", "ray"])
def test_bad_input_file_is_named_in_one_line(tmp_path, name, content, needle, engine, ray_cluster):
    p = tmp_path / name
    if content is None:
        pq.write_table(pa.table({"body": ["a"]}), p)
    else:
        p.write_bytes(content)
    with pytest.raises(UserError, match=needle) as e:
        prepare(PrepareConfig(inputs=[str(p)], out=str(tmp_path / "o"), vocab_size=260, engine=engine), **QUIET)
    assert "\n" not in str(e.value) and str(p) in str(e.value)


def test_unreadable_file_is_named(tmp_path):
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "gone.txt").symlink_to(tmp_path / "deleted-meanwhile.txt")  # listed, but cannot be read
    with pytest.raises(UserError, match=f"input {tmp_path / 'gone.txt'}: cannot read it"):
        prepare(PrepareConfig(inputs=[str(tmp_path / "*.txt")], out=str(tmp_path / "o"), vocab_size=260), **QUIET)


def test_s3_glob_matching_nothing(tmp_path, s3_server):
    with pytest.raises(UserError, match="matches no files"):
        _read(["s3://raytrain-test/nothing-here/*.txt"], tmp_path / "o", engine="local")


def test_tokenizer_special_tokens_sample_and_reuse(tmp_path):
    _write_inputs(tmp_path)
    cfg = dict(inputs=[str(tmp_path / "files")], vocab_size=300, seq_len=8, val_fraction=0.0)
    prepare(PrepareConfig(out=str(tmp_path / "a"), special_tokens=["<|pad|>", "<|sep|>"], tokenizer_sample_docs=2,
                          **cfg), **QUIET)
    tok = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in (EOT, "<|pad|>", "<|sep|>")] == [0, 1, 2]
    # An existing tokenizer.json, or a Hugging Face tokenizer directory holding one, is used as is.
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "tokenizer.json").write_text((tmp_path / "a" / "tokenizer.json").read_text())
    for src in (str(tmp_path / "a" / "tokenizer.json"), str(hf_dir)):
        prepare(PrepareConfig(out=str(tmp_path / "b"), tokenizer=src, **cfg), **QUIET)
        assert (tmp_path / "b" / "tokenizer.json").read_text() == (tmp_path / "a" / "tokenizer.json").read_text()
    with pytest.raises(UserError, match="has no </s> token; set eot_token="):
        prepare(PrepareConfig(out=str(tmp_path / "c"), tokenizer=str(hf_dir), eot_token="</s>", **cfg), **QUIET)


def test_jobs_api_ray_address_reads_locally_or_is_explained(tmp_path):
    """`local_cluster.sh env` exports RAY_ADDRESS=http://... for `ray job submit`; a driver cannot join it.
    In a fresh process (this one may already hold the session's Ray): auto reads in-process, ray says why not."""
    import os
    import subprocess
    import sys

    code = ("import sys\nfrom raytrain.data.inputs import use_ray\nfrom raytrain.errors import UserError\n"
            "print(use_ray('auto'))\ntry:\n    use_ray('ray')\nexcept UserError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "RAY_ADDRESS": "http://127.0.0.1:8265"})
    assert r.returncode == 0, r.stderr
    auto, err = r.stdout.strip().splitlines()
    assert auto == "False"
    assert err.startswith("engine=ray, but RAY_ADDRESS=http://127.0.0.1:8265 is the Ray Jobs API address")


@pytest.mark.parametrize("where", ["local", "s3"])
def test_large_files_read_in_ranges_give_every_document_once(tmp_path, monkeypatch, where, s3_server):
    """JSONL, line-per-document text and Parquet above READ_RANGE_BYTES are read in byte ranges by separate
    tasks: every document exactly once, whatever the range size (smaller than a line, cut at a newline)."""
    from raytrain.data import inputs

    docs = [f"doc {i} " + "x" * (i * 37 % 300) for i in range(400)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "b.txt").write_text("\n".join(docs) + "\n")
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", row_group_size=37)
    base = str(tmp_path)
    if where == "s3":
        base = "s3://raytrain-test/ranges"
        for name in ("a.jsonl", "b.txt", "c.parquet"):
            storage.upload_file(str(tmp_path / name), f"{base}/{name}")
    files = inputs.expand(f"{base}/*")
    assert [s for _, s in files] == [(tmp_path / n).stat().st_size for n in ("a.jsonl", "b.txt", "c.parquet")]
    # Ranges smaller than a line locally; on S3 (every range is requests to the server) fewer, larger ones.
    for size in (7, 1000, 4096, 1 << 30) if where == "local" else (4096, 1 << 30):
        monkeypatch.setattr(inputs, "READ_RANGE_BYTES", size)
        units = inputs.read_units(files, "line")
        if size == 4096:
            assert len(units) > 3 * 5
        for uri, _ in files:
            got = [t for u in units if u["uri"] == uri
                   for t, *_ in inputs.read_file(uri, text_mode="line", start=u["start"], stop=u["stop"])]
            assert got == docs, (uri, size)


def test_bad_line_in_a_later_range_is_named_with_its_line_number(tmp_path, monkeypatch):
    from raytrain.data import inputs

    lines = [json.dumps({"text": f"document number {i}"}) for i in range(500)]
    lines[431] = "not json at all"
    p = tmp_path / "big.jsonl"
    p.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(inputs, "READ_RANGE_BYTES", 2000)
    with pytest.raises(UserError, match=f"input {p}:432: not valid JSON"):
        prepare(PrepareConfig(inputs=[str(p)], out=str(tmp_path / "o"), vocab_size=260, engine="local"), **QUIET)
