"""Data quality in `raytrain prepare`: duplicates and PII are removed and counted; the report and the
drift check tell a person what the data looks like."""

import json


from raytrain.cli import main
from raytrain.data.prepare import PrepareConfig, prepare
from raytrain.data.quality import normalise
from raytrain.data.stages import clean_documents
from raytrain.data.report import ks_statistic

BASE = ("Ray Train runs the training function on every worker and DeepSpeed shards the optimizer state "
        "across them so that larger models fit in memory while the data pipeline streams shards {i} "
        "from object storage into each worker without stalling the accelerators at any step.")


def _docs():
    docs = [BASE.format(i=f"batch{i} " * (i % 3 + 1)) + f" Unique tail number {i} " + "word " * i for i in range(30)]
    docs.append(docs[3])                                   # exact duplicate
    docs.append("  " + docs[5].replace(" ", "  ") + "\n")  # same text after whitespace normalisation
    docs.append(docs[7].replace("stalling", "blocking"))   # near duplicate: one word changed
    return docs


def test_exact_and_near_duplicates_are_removed_and_counted():
    kept, counts = clean_documents(_docs(), min_chars=1, max_chars=0, near_dup_threshold=0.8, pii=False, seed=0)
    assert counts["dropped_exact_duplicate"] == 2
    assert counts["dropped_near_duplicate"] >= 1
    assert counts["input"] == 33 and counts["kept"] == len(kept) <= 30


def test_length_filters_and_empty_documents_are_counted():
    _, counts = clean_documents(["", "   ", "short", "x" * 50, "y" * 500], min_chars=10, max_chars=100,
                                near_dup_threshold=1.0, pii=False, seed=0)
    assert (counts["dropped_empty"], counts["dropped_short"], counts["dropped_long"], counts["kept"]) == (2, 1, 1, 1)


def test_pii_is_scrubbed_and_counted():
    text = "Mail jane.doe@example.com or call +1 415-555-0100, server at 10.1.2.3 today."
    kept, counts = clean_documents([text], 1, 0, 1.0, pii=True, seed=0)
    assert kept == ["Mail <EMAIL> or call <PHONE>, server at <IP> today."]
    assert (counts["pii_email"], counts["pii_phone"], counts["pii_ip"]) == (1, 1, 1)


def test_normalise():
    assert normalise("Cafe\u0301  au\t lait  \r\n\n\n\nnext ") == "Caf\u00e9 au lait\n\nnext"


def test_ks_statistic():
    assert ks_statistic([1, 2, 3, 4], [1, 2, 3, 4]) == 0.0
    assert ks_statistic([1, 2, 3], [10, 11, 12]) == 1.0


def test_prepare_writes_report_and_compare_detects_drift(tmp_path, corpus_dir, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    prepare(PrepareConfig(inputs=[str(corpus_dir)], out=str(a), vocab_size=300, seq_len=16,
                          near_dup_threshold=1.0), log=lambda *_: None)
    short = tmp_path / "short"
    short.mkdir()
    for i in range(60):
        (short / f"{i}.txt").write_text(" ".join(["one two three"] * (1 + i % 3)) + f" doc {i}")
    prepare(PrepareConfig(inputs=[str(short)], out=str(b), vocab_size=300, seq_len=8,
                          near_dup_threshold=1.0), log=lambda *_: None)
    report = json.loads((a / "report.json").read_text())
    assert report["filters"]["input"] == 120 and report["splits"]["train"]["doc_tokens"]["documents"] > 0
    assert 0 <= report["ks_train_val_doc_tokens"] <= 1
    assert (a / "report.md").read_text().startswith("# Data report")
    assert len((a / "review_sample.jsonl").read_text().splitlines()) == 20
    capsys.readouterr()
    assert main(["data", "compare", str(a), str(a)]) == 0
    assert json.loads(capsys.readouterr().out)["ks_doc_tokens"] == 0.0
    assert main(["data", "compare", str(a), str(b)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ks_doc_tokens"] > 0.5 and out["verdict"] == "different"


def test_compare_without_report(tmp_path):
    assert main(["data", "compare", str(tmp_path), str(tmp_path)]) == 2
