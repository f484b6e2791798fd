"""Fine-tuning data (`raytrain prepare format=prompt_completion|chat`): loss mask and segment ids in Parquet and
WebDataset, packing or padding, truncations and drops counted, bad records in one line. In this process, no Ray."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from raytrain.data.manifest import load_split
from raytrain.data.prepare import PrepareConfig, prepare
from raytrain.data.reader import read_rows
from raytrain.errors import UserError

QUIET = {"log": lambda *_: None}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def _pc_records(n=60):
    return [{"prompt": f"Q{i}: " + " ".join(WORDS[(i + j) % 10] for j in range(i % 5 + 2)) + "?",
             "completion": " ".join(WORDS[(i * 3 + j) % 10] for j in range(i % 3 + 1))} for i in range(n)]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _prep(tmp_path, name, records, **kw):
    kw = {"vocab_size": 300, "seq_len": 48, "val_fraction": 0.0, "near_dup_threshold": 1.0, "engine": "local", **kw}
    out = tmp_path / name
    report = prepare(PrepareConfig(inputs=[_jsonl(tmp_path / f"{name}.jsonl", records)], out=str(out), **kw), **QUIET)
    return out, report


@pytest.fixture(scope="module")
def pc_data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    records = _pc_records() + [{"prompt": "copy", "completion": "same"}] * 2 + [
        {"prompt": "long " * 80, "completion": "end"}]
    out, report = _prep(tmp, "pc", records, format="prompt_completion", formats=["parquet", "webdataset"])
    return out, report, tmp


def test_prompt_completion_mask_marks_the_completion_in_both_formats(pc_data):
    out, report, _ = pc_data
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    rows = {fmt: read_rows(load_split(str(out / "train"), fmt=fmt), 0, 10**6) for fmt in ("parquet", "webdataset")}
    assert np.array_equal(rows["parquet"], rows["webdataset"])
    r = rows["parquet"].reshape(len(rows["parquet"]), 3, -1)
    learned, seen = [], 0
    for t, m, seg in r:
        assert set(np.unique(m)) <= {0, 1} and (m[seg == 0] == 0).all()
        for s in range(1, seg.max() + 1):
            ex_t, ex_m = t[seg == s], m[seg == s]
            assert ex_m[0] == 0 and ex_m[-1] == 1 and ex_t[-1] == 0  # prompt first; the eot closing it is learned
            learned.append(tok.decode(ex_t[ex_m == 1][:-1].tolist()))
            seen += 1
    completions = {r["completion"] for r in _pc_records()} | {"same"}
    assert set(learned) <= completions and seen == report["train"]["examples"] == 61  # 60 + one copy of "copy"
    f = report["filters"]
    assert f["dropped_exact_duplicate"] == 1 and f["truncated"] == 1 and f["dropped_no_learned_tokens"] == 1
    s = report["train"]
    assert s["learned_tokens"] == int(sum(r[:, 1, 1:].sum() for r in [r]))
    assert s["learned_tokens"] + s["masked_tokens"] + s["pad_tokens"] == r[:, 0].size
    md = (out / "report.md").read_text()
    assert "## Examples (loss mask)" in md and "Truncated: 1" in md


def test_unpacked_rows_hold_one_example_and_too_long_examples_can_be_dropped(pc_data):
    _, _, tmp = pc_data
    records = _pc_records(20) + [{"prompt": "long " * 80, "completion": "end"}]
    out, report = _prep(tmp, "pad", records, format="prompt_completion", pack=False, too_long="drop")
    r = read_rows(load_split(str(out / "train")), 0, 10**6)
    r = r.reshape(len(r), 3, -1)
    assert len(r) == 20 and (r[:, 2].max(axis=1) == 1).all()
    assert report["filters"]["dropped_too_long"] == 1 and "truncated" not in report["filters"]


def test_chat_mask_covers_the_assistant_turns(tmp_path):
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    records = [{"messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": f"say {WORDS[i % 10]}"},
                             {"role": "assistant", "content": f"{WORDS[i % 10]} {i}"},
                             {"role": "user", "content": "again"},
                             {"role": "assistant", "content": f"ok {i}"}]} for i in range(12)]
    out, report = _prep(tmp_path, "chat", records, format="chat", chat_template=template, seq_len=96)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    r = read_rows(load_split(str(out / "train")), 0, 10**6)
    r = r.reshape(len(r), 3, -1)
    for t, m, seg in r:
        for s in range(1, seg.max() + 1):
            text = tok.decode(t[(seg == s) & (m == 1)].tolist(), skip_special_tokens=False)
            i = int(text.split("\n")[0].split()[-1])
            assert text == f"{WORDS[i % 10]} {i}\nok {i}\n<|endoftext|>"
    assert report["train"]["examples"] == 12


@pytest.mark.parametrize("record,extra,msg", [
    ({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}, {},
     "unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, {}, "no assistant message with content"),
    ({"chat": []}, {}, "no 'messages' list"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
     {"chat_template": "{{ messages[0]['nope'].upper() }}"}, "chat_template: it failed to render"),
])
def test_bad_chat_records_are_one_line(tmp_path, record, extra, msg):
    with pytest.raises(UserError, match=msg) as e:
        _prep(tmp_path, "bad", [record] * 3, format="chat", **extra)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("record,msg", [
    ({"prompt": "a"}, "record has no 'completion' field"),
    ({"question": "a", "completion": "b"}, "record has no 'prompt' field .set prompt_field"),
    ({"prompt": "a", "completion": "   "}, "empty completion"),
])
def test_bad_prompt_completion_records_are_one_line(tmp_path, record, msg):
    with pytest.raises(UserError, match=msg):
        _prep(tmp_path, "bad", [record], format="prompt_completion")


def test_cli_exit_2_on_a_bad_record(tmp_path):
    import subprocess
    import sys

    path = _jsonl(tmp_path / "x.jsonl", [{"prompt": "a", "completion": ""}])
    r = subprocess.run([sys.executable, "-m", "raytrain", "prepare", f"inputs=[{path}]", f"out={tmp_path / 'o'}",
                        "format=prompt_completion", "engine=local"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "x.jsonl:1" in r.stderr
