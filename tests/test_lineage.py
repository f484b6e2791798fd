"""Lineage of a model (raytrain/lineage.py, `raytrain lineage`) on lineages written by hand: the base chain walked, a
changed or missing input reported, unknown inputs not an error; bad input is one line and exit 2. A served, exported
fine-tune leading to both datasets' raw files: tests/test_serve.py."""

import hashlib
import json
from pathlib import Path


from raytrain import lineage
from raytrain.cli import main


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_check_walks_the_base_chain_and_unknown_inputs_are_not_an_error(tmp_path):
    """check() on lineages written by hand: no training."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one two")
    b.write_text("three")
    rec = lambda p: {"uri": str(p), "bytes": p.stat().st_size, "sha256": _sha(p)}  # noqa: E731
    split = lambda uri, inputs: {"role": "train", "source": None, "uri": uri,  # noqa: E731
                                 "manifest": {"uri": uri + "/manifest.json", "sha256": None}, "inputs": inputs}
    base = {"run": {"name": "pre"}, "data": [split("/p", [rec(a)])], "tokenizer": None, "base": None}
    base["id"] = lineage.lineage_id(base)
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "lineage.json").write_text(json.dumps(base))
    lin = {"run": {"name": "ft"}, "data": [split("/f", [rec(b)]), split("/v", None)], "tokenizer": None,
           "base": {"uri": str(tmp_path / "base"), "id": base["id"], "lineage": base}}
    assert lineage.check(lin) == []
    assert [u["uri"] for u in lineage.unknown(lin)] == ["/v"]  # prepared without provenance: unknown, not changed
    a.write_text("one two three")
    assert [(r["uri"], r["status"], r["where"]) for r in lineage.check(lin)] == [(str(a), "changed", "ft > pre")]
    b.unlink()
    (tmp_path / "base" / "lineage.json").write_text(json.dumps({**base, "id": "other"}))
    got = {(r["kind"], r["status"]) for r in lineage.check(lin)}
    assert got == {("input", "changed"), ("input", "missing"), ("base", "changed")}
    # The built-in corpus has no file: its text is hashed again as this Python builds it.
    from raytrain.data.provenance import builtin_digest

    now = builtin_digest(1)
    builtin = {"uri": "python-docs", "bytes": now["bytes"], "sha256": now["sha256"], "python": now["python"],
               "max_chars": 1}
    docs = {"run": {"name": "docs"}, "data": [split("/d", [builtin])], "tokenizer": None, "base": None}
    assert lineage.check(docs) == []
    docs["data"][0]["inputs"] = [{**builtin, "sha256": "0" * 64, "python": "3.0.0"}]
    assert [(r["uri"], r["status"]) for r in lineage.check(docs)] == [("python-docs", "changed")]


def test_lineage_of_what_is_not_a_model_or_run_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "old-export").mkdir()
    (tmp_path / "old-export" / "config.json").write_text("{}")
    for target, says in [(tmp_path / "nonexistent", "not found"), (tmp_path, "neither an exported model"),
                         (tmp_path / "old-export", "exported without lineage")]:
        assert main(["lineage", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("raytrain: error: ") and says in err, err


def _exported(tmp_path: Path, name: str, run: Path) -> tuple[Path, dict]:
    """A model directory as `raytrain export` leaves it (weights, config, then lineage.json over them), by hand."""
    d = tmp_path / name
    (d / "sub").mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"weights " * 100)
    (d / "config.json").write_text("{}")
    (d / "sub" / "tokenizer.json").write_text("{}")
    lin = {"run": {"name": name, "uri": str(run)}, "checkpoint": {"uri": str(run / "checkpoint_00000004"), "step": 4},
           "config": {"sha256": "0" * 64}, "data": [], "tokenizer": None, "packages": {}, "base": None}
    lineage.write(str(d), lin)
    return d, lin


def test_an_exported_models_files_are_checked_by_sha256_and_a_rewritten_lineage_is_found(tmp_path, capsys):
    """lineage.json lists every file of the export (sha256) and its id covers them: a replaced weight file is
    reported (exit 1); rewriting lineage.json to match it changes its id, which the export's audit record does not
    name; keeping the old id leaves an id that is not the hash of the content. A fine-tune's base is checked by
    its files' content, not only its lineage id."""
    from raytrain import audit

    run = tmp_path / "run"
    d, lin = _exported(tmp_path, "model", run)
    assert set(lin["weights"]) == {"model.safetensors", "config.json", "sub/tokenizer.json"}
    audit.run_event(str(run), "export", out=str(d), lineage=lin["id"])
    assert main(["lineage", str(d)]) == 0
    assert "files 3" in capsys.readouterr().out
    (d / "model.safetensors").write_bytes(b"poisoned" * 100)
    assert main(["lineage", str(d)]) == 1
    assert "CHANGED  weights " + str(d / "model.safetensors") in capsys.readouterr().out
    lineage.write(str(d), json.loads((d / "lineage.json").read_text()))  # lineage.json rewritten to match
    assert main(["lineage", str(d)]) == 1
    out = capsys.readouterr().out
    assert "EDITED  lineage" in out and f"the export's audit record names lineage {lin['id']}" in out
    forged = json.loads((d / "lineage.json").read_text())
    (d / "lineage.json").write_text(json.dumps({**forged, "id": lin["id"]}))  # ... keeping the old id
    assert main(["lineage", str(d)]) == 1
    assert "is not the hash of its content" in capsys.readouterr().out
    base_dir, base = _exported(tmp_path, "base", tmp_path / "pre")
    ft = {"run": {"name": "ft"}, "data": [], "tokenizer": None,
          "base": {"uri": str(base_dir), "id": base["id"], "lineage": base}}
    assert lineage.check(ft) == []
    (base_dir / "sub" / "tokenizer.json").write_text('{"x": 1}')  # the base's lineage.json untouched
    (r,) = lineage.check(ft)
    assert (r["kind"], r["status"]) == ("base", "changed") and "sub/tokenizer.json" in r["detail"]
