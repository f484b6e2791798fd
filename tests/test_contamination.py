"""Contamination: training documents that share a 13-word n-gram with an lm-eval task's documents are found (all of
them, none of the others) with their sources, and `prepare decontaminate=...` drops them, counted in report.json."""

from __future__ import annotations

import json
import random

import pytest

from raytrain.cli import main
from raytrain.data.prepare import PrepareConfig, prepare
from tests.helpers import synthetic_docs, write_lm_eval_tasks

LEXICON = ("amber basalt cedar delta ember fjord garnet harbor iris juniper kelp lagoon marble nectar onyx prairie "
           "quartz raven saffron tundra umber violet willow xenon yarrow zephyr").split()


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A local lm-eval task of 12 questions of 16 words; a corpus of counting documents with 5 of the questions planted
    (in JSONL records and text files), one document holding only 12 words of a sixth (not contaminated)."""
    d = tmp_path_factory.mktemp("contam")
    rng = random.Random(11)
    questions = [" ".join(rng.choice(LEXICON) for _ in range(16)) for _ in range(12)]
    with open(d / "qa.jsonl", "w") as f:
        for q in questions:
            f.write(json.dumps({"question": q, "choices": ["yes", "no"], "answer": 0}) + "\n")
    (d / "tasks").mkdir()
    write_lm_eval_tasks(d / "tasks", "planted_qa", d / "qa.jsonl")
    (d / "in").mkdir()
    docs = synthetic_docs(80, seed=5)
    with open(d / "in" / "mixed.jsonl", "w") as f:
        for i, t in enumerate(docs[:40]):
            t = f"{t} {questions[i // 10].upper()}, said the record." if i % 10 == 3 else t  # 4 planted (0..3)
            f.write(json.dumps({"text": t}) + "\n")
    for i, t in enumerate(docs[40:]):
        (d / "in" / f"t{i:02d}.txt").write_text(t)
    (d / "in" / "t90.txt").write_text(f"{docs[0]} Quoted: {questions[4]}")  # the fifth
    near_miss = " ".join(questions[5].split()[:12])
    (d / "in" / "t91.txt").write_text(f"{docs[1]} {near_miss} seven eight")
    out = d / "data"
    common = dict(vocab_size=300, seq_len=32, shard_rows=64, near_dup_threshold=1.0, val_fraction=0.0)
    prepare(PrepareConfig(inputs=[str(d / "in")], out=str(out), **common), log=lambda *_: None)
    return d, out, common


def test_contamination_finds_the_planted_documents_only(planted, capsys):
    d, out, _ = planted
    rc = main(["data", "contamination", str(out), "--tasks", "planted_qa", "--include-path", str(d / "tasks"), "--json"])
    got = json.loads(capsys.readouterr().out)
    assert rc == 1
    found = [(f["source"].rsplit("/", 1)[-1], f["record"]) for f in got["contaminated"]]
    offsets, at = [], 0
    for i, line in enumerate((d / "in" / "mixed.jsonl").read_bytes().splitlines(keepends=True)):
        if i % 10 == 3:
            offsets.append(at)
        at += len(line)
    assert found == [("mixed.jsonl", o) for o in offsets] + [("t90.txt", 0)]
    assert got["evaluation_sources"] == {"planted_qa": 12}


def test_decontaminate_drops_them_and_counts_them(planted, tmp_path, capsys):
    d, _, common = planted
    clean = tmp_path / "clean"
    report = prepare(PrepareConfig(inputs=[str(d / "in")], out=str(clean), **common,
                                   decontaminate={"tasks": ["planted_qa"], "include_path": str(d / "tasks")}),
                     log=lambda *_: None)
    assert report["filters"]["dropped_contaminated"] == 5
    saved = json.loads((clean / "report.json").read_text())
    assert saved["filters"]["dropped_contaminated"] == 5 and saved["decontaminate"]["dropped"] == 5
    assert main(["data", "contamination", str(clean), "--tasks", "planted_qa", "--include-path",
                 str(d / "tasks")]) == 0
    assert capsys.readouterr().out.startswith("0 document(s)")
    # The same evaluation documents given as a file find the same.
    qa = d / "qa.txt"
    qa.write_text("\n".join(json.loads(x)["question"] for x in (d / "qa.jsonl").read_text().splitlines()))
    assert main(["data", "contamination", str(clean), "--file", str(qa)]) == 0


def test_contamination_bad_input(planted, capsys):
    d, out, _ = planted
    assert main(["data", "contamination", str(out), "--tasks", "no_such_task", "--include-path", str(d / "tasks")]) == 2
    err = capsys.readouterr().err
    assert "no_such_task" in err and err.count("\n") == 1
    assert main(["data", "contamination", str(out)]) == 2
    assert "--tasks" in capsys.readouterr().err


def test_contaminated_examples_are_counted_as_brute_force_counts_them_and_the_clean_subset_is_the_rest(planted, tmp_path,
                                                                                                     capsys):
    """Per evaluation example: which share a 13-word n-gram with a document the split holds (the five planted
    questions), as a brute-force comparison of every example's n-grams with every input document finds; the clean
    subset written by --clean-out holds exactly the others."""
    import re

    d, out, _ = planted
    clean = tmp_path / "clean.json"
    rc = main(["data", "contamination", str(out), "--tasks", "planted_qa", "--include-path", str(d / "tasks"),
               "--json", "--clean-out", str(clean)])
    got = json.loads(capsys.readouterr().out)
    assert rc == 1
    qa = [json.loads(x) for x in (d / "qa.jsonl").read_text().splitlines()]

    def ngrams(text: str) -> set:
        w = re.findall(r"[^\W_]+", text.lower())
        return {tuple(w[i:i + 13]) for i in range(len(w) - 12)}

    docs = [json.loads(x)["text"] for x in (d / "in" / "mixed.jsonl").read_text().splitlines()]
    docs += [p.read_text() for p in sorted((d / "in").glob("*.txt"))]
    train = set().union(*(ngrams(t) for t in docs))
    brute = {i for i, q in enumerate(qa) if ngrams(f"{q['question']} yes") & train}
    rec = got["by_source"]["planted_qa"]
    assert rec["examples"] == 12 and set(rec["contaminated"]) == brute and len(brute) == 5
    assert json.loads(clean.read_text()) == {"planted_qa": sorted(set(range(12)) - brute)}
    main(["data", "contamination", str(out), "--tasks", "planted_qa", "--include-path", str(d / "tasks")])
    assert "planted_qa: 5 of 12 example(s) contaminated, 7 clean" in capsys.readouterr().out
