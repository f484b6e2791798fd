"""Lineage of a model (raytrain/lineage.py, `raytrain lineage`): an exported fine-tune leads to the raw input files of
both its pre-training and its fine-tuning data with their sha256; a changed or missing input is reported (exit 1);
`raytrain check` shows the id; bad input is one line and exit 2."""

import hashlib
import json
from pathlib import Path

import pytest

from raytrain import lineage
from raytrain.cli import main


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(d: Path, docs: list[str]) -> Path:
    d.mkdir(parents=True)
    for i, doc in enumerate(docs):
        (d / f"doc{i:04d}.txt").write_text(doc)
    return d


def _prepare(inputs: Path, out: Path, **kw) -> Path:
    from raytrain.data.prepare import PrepareConfig, prepare

    prepare(PrepareConfig(inputs=[str(inputs)], out=str(out), vocab_size=300, seq_len=32, shard_rows=64,
                          near_dup_threshold=1.0, val_fraction=0.1, engine="local", **kw), log=lambda *_: None)
    if "provenance" not in json.loads((out / "train" / "manifest.json").read_text()):
        pytest.skip("`raytrain prepare` does not record its inputs yet (no 'provenance' in manifest.json): the "
                    "lineage's raw inputs come from there (issue 46, prepare side)")
    return out


@pytest.fixture(scope="module")
def chain(ray_cluster, tmp_path_factory):
    """A pre-training run on files (1 worker, 2 steps), exported as the base; a fine-tune of it (model.init_from) on
    a second dataset prepared from other files with the base's tokenizer, exported as the model."""
    from raytrain.ckpt import catalog
    from raytrain.export import export
    from raytrain.trainer import train
    from tests.helpers import synthetic_docs, tiny_cfg

    root = tmp_path_factory.mktemp("lineage")
    short = ("scaling.num_workers=1", "run.max_steps=2", "checkpoint.every_n_steps=2", "data.eval_samples=4")
    pre_files = _files(root / "pre-files", synthetic_docs(60, seed=11))
    pre_data = _prepare(pre_files, root / "pre-data")
    pre = tiny_cfg(pre_data, root / "runs", "pre", *short)
    train(pre, log=lambda *_: None)
    base = root / "base"
    export(catalog.latest_complete(pre.run_uri).uri, str(base), log=lambda *_: None)
    ft_files = _files(root / "ft-files", [d.upper() for d in synthetic_docs(40, seed=12)])
    ft_data = _prepare(ft_files, root / "ft-data", tokenizer=str(base))
    ft = tiny_cfg(ft_data, root / "runs", "ft", *short, f"model.init_from={base}")
    train(ft, log=lambda *_: None)
    model = root / "model"
    out = export(catalog.latest_complete(ft.run_uri).uri, str(model), log=lambda *_: None)
    return {"pre_files": pre_files, "ft_files": ft_files, "ft_data": ft_data, "base": base, "model": model,
            "ft_run": ft.run_uri, "pre_run": pre.run_uri, "export": out}


def _inputs(lin: dict) -> dict[str, dict]:
    return {i["uri"]: i for s in lin["data"] for i in s["inputs"]}


@pytest.mark.slow
def test_an_exported_fine_tune_leads_to_both_datasets_raw_files(chain, capsys):
    lin = json.loads((chain["model"] / "lineage.json").read_text())
    assert lin["id"] == lineage.lineage_id(lin) == chain["export"]["lineage"]
    # The fine-tune: its run, checkpoint, config, data (train and val) and tokenizer, each with its sha256.
    ckpt = Path(lin["checkpoint"]["uri"])
    assert lin["run"]["name"] == "ft" and lin["checkpoint"]["step"] == 2 and ckpt.parent == Path(chain["ft_run"])
    assert lin["config"]["sha256"] == _sha(ckpt / "config.yaml")
    assert {s["role"] for s in lin["data"]} == {"train", "val"}
    for s in lin["data"]:
        assert s["manifest"]["sha256"] == _sha(Path(s["uri"]) / "manifest.json")
    assert lin["tokenizer"]["sha256"] == _sha(chain["ft_data"] / "tokenizer.json")
    assert lin["packages"]["torch"] and lin["packages"]["raytrain"]
    # ... the fine-tuning data's raw files with their size and sha256,
    ft = _inputs(lin)
    assert set(ft) == {str(p) for p in chain["ft_files"].iterdir()}
    assert all(ft[u]["sha256"] == _sha(Path(u)) and ft[u]["bytes"] == Path(u).stat().st_size for u in ft)
    # ... and, through the base model (model.init_from) and its own lineage, the pre-training data's.
    base = lin["base"]
    assert base["uri"] == str(chain["base"])
    assert base["id"] == json.loads((chain["base"] / "lineage.json").read_text())["id"]
    assert base["lineage"]["run"]["name"] == "pre" and base["lineage"]["base"] is None
    pre = _inputs(base["lineage"])
    assert set(pre) == {str(p) for p in chain["pre_files"].iterdir()}
    assert all(pre[u]["sha256"] == _sha(Path(u)) and pre[u]["bytes"] == Path(u).stat().st_size for u in pre)
    # `raytrain lineage`: nothing changed (exit 0); the run directory gives the lineage of the same checkpoint.
    assert main(["lineage", str(chain["model"]), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["lineage"]["id"] == lin["id"] and shown["changed"] == [] and shown["unknown"] == []
    assert main(["lineage", chain["ft_run"]]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"lineage {lin['id']}: run ") and "0 of " in text and "changed since" in text
    assert str(next(iter(pre))) in text and str(next(iter(ft))) in text
    # The release gate names the id, and so does a serving replica's info (each /v1/models entry is one).
    assert main(["check", str(chain["model"]), "-n", "1", "--max-new-tokens", "2"]) == 0
    assert f"lineage {lin['id']}" in capsys.readouterr().out
    import ray

    @ray.remote
    def replica_info(uri: str) -> dict:
        from raytrain.serving.app import ModelServer

        return ModelServer.func_or_class(uri, "ft").info()  # the class itself, outside Serve

    assert ray.get(replica_info.remote(str(chain["model"])))["lineage"] == lin["id"]


@pytest.mark.slow
def test_a_changed_or_missing_input_file_is_reported(chain, capsys):
    ft_file = sorted(chain["ft_files"].iterdir())[0]
    pre_file = sorted(chain["pre_files"].iterdir())[1]
    saved = {p: p.read_bytes() for p in (ft_file, pre_file)}
    try:
        ft_file.write_bytes(saved[ft_file] + b" edited")
        pre_file.unlink()
        assert main(["lineage", str(chain["model"]), "--json"]) == 1
        changed = {r["uri"]: r for r in json.loads(capsys.readouterr().out)["changed"]}
        assert set(changed) == {str(ft_file), str(pre_file)}, changed
        assert changed[str(ft_file)]["status"] == "changed" and changed[str(ft_file)]["where"] == "ft"
        assert changed[str(ft_file)]["now"]["sha256"] == _sha(ft_file)
        assert changed[str(pre_file)]["status"] == "missing" and changed[str(pre_file)]["where"] == "ft > pre"
        assert main(["lineage", str(chain["model"])]) == 1
        out = capsys.readouterr().out
        assert f"CHANGED  input {ft_file}" in out and f"MISSING  input {pre_file}" in out and "2 of " in out
    finally:
        for p, data in saved.items():
            p.write_bytes(data)
    assert main(["lineage", str(chain["model"]), "--json"]) == 0


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
