"""Model lifecycle end to end: train (ZeRO-2 and ZeRO-3) -> export -> stock transformers; eval; generate;
release check; tag + rollback + resume; fine-tuning from an exported model.

One tiny run per ZeRO stage is trained once for the module and reused by every test.
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from raytrain import storage
from raytrain.ckpt import catalog
from raytrain.cli import main
from raytrain.trainer import train
from tests.helpers import tiny_cfg

slow = pytest.mark.slow  # the end-to-end tests; the bad-input ones at the end are quick


def _metrics(run_uri: str) -> list[dict]:
    return [json.loads(line) for line in storage.read_text(storage.join(run_uri, "metrics.jsonl")).splitlines()]


def _val(run_uri: str, step: int) -> float:
    return [r["val_loss"] for r in _metrics(run_uri) if r["step"] == step and "val_loss" in r][-1]


class _Lazy(dict):
    """A dict that builds a missing entry on first use, so a test selected alone trains only what it needs."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = self.make(key)
        return self[key]


@pytest.fixture(scope="module")
def runs(ray_cluster, tiny_data, tmp_path_factory):
    """{zero stage: (cfg, summary)}: 10 steps, checkpoints at 5 and 10, validation at 0 and 10."""
    root = tmp_path_factory.mktemp("lifecycle")

    def make(stage):
        cfg = tiny_cfg(tiny_data, root, f"z{stage}", f"deepspeed.zero_stage={stage}", "checkpoint.keep_last=3")
        return cfg, train(cfg, log=lambda *_: None)

    return _Lazy(make)


@pytest.fixture(scope="module")
def exported(runs, s3_server, tmp_path_factory):
    """ZeRO-2 exported to a local directory, ZeRO-3 to the S3-protocol server."""
    dests = {2: str(tmp_path_factory.mktemp("export") / "z2"), 3: "s3://raytrain-test/exports/z3"}

    def make(stage):
        assert main(["export", "--checkpoint", runs[stage][1]["checkpoint"], "--out", dests[stage]]) == 0
        return dests[stage]

    return _Lazy(make)


def _local(uri: str, tmp_path) -> str:
    from raytrain.model import local_model_dir

    return local_model_dir(uri) if storage.is_remote(uri) else uri


@slow
@pytest.mark.parametrize("stage", [2, 3])
def test_export_loads_offline_with_same_logits_and_reported_val_loss(stage, runs, exported, tiny_data, tmp_path,
                                                                     monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raytrain.data.manifest import load_split
    from raytrain.evaluation import eval_rows, loss_sums
    from raytrain.export import load_checkpoint
    from raytrain.model import param_count

    cfg, summary = runs[stage]
    local = _local(exported[stage], tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = AutoModelForCausalLM.from_pretrained(local).eval()
    tok = AutoTokenizer.from_pretrained(local)
    assert param_count(hf) == summary["params"]
    assert tok.decode(tok("three four five")["input_ids"]) == "three four five"
    ours = load_checkpoint(summary["checkpoint"]).model
    rows = eval_rows(load_split(f"{tiny_data}/val"), 16, 4, 2)
    x = torch.from_numpy(np.array(rows[:, :-1], dtype=np.int64))
    with torch.no_grad():
        diff = (hf(input_ids=x).logits - ours(input_ids=x).logits).abs().max().item()
    assert diff < 1e-5
    # Against the engine itself: the exported weights score training's validation set as training did.
    total, count = loss_sums(hf, rows, 4)
    assert total / count == pytest.approx(_val(cfg.run_uri, 10), abs=1e-4)
    assert summary["val_loss"] < _val(cfg.run_uri, 0) - 0.5  # it learned something: a real model, not init


@slow
def test_eval_cli_reproduces_training_val_loss(runs, capsys):
    for stage in (2, 3):
        cfg, summary = runs[stage]
        assert main(["eval", "--checkpoint", summary["checkpoint"], "--json"]) == 0
        text = capsys.readouterr().out
        out = json.loads(text[text.index("{\n"):])
        assert out["step"] == 10 and out["sequences"] == 16
        assert out["val_loss"] == pytest.approx(_val(cfg.run_uri, 10), abs=1e-4)
        assert abs(out["diff"]) < 1e-4


@slow
def test_generate_greedy_and_seeded_sampling(exported, runs, capsys):
    from raytrain.generate import load

    gen = load(model_dir=exported[2])
    prompt = "three four five"
    greedy = gen(prompt, 12, greedy=True)
    # Greedy is the argmax chain, computed by hand.
    ids = gen.tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        for _ in range(12):
            nxt = gen.model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            if nxt.item() == gen.tokenizer.eos_token_id:
                break
    n_prompt = gen.tokenizer(prompt, return_tensors="pt")["input_ids"].shape[1]
    assert greedy == gen.tokenizer.decode(ids[0, n_prompt:])
    assert gen(prompt, 12, greedy=False, top_k=1, seed=3) == greedy  # top-1 sampling is greedy
    a = gen(prompt, 12, greedy=False, temperature=2.0, top_p=0.95, seed=7)
    assert gen(prompt, 12, greedy=False, temperature=2.0, top_p=0.95, seed=7) == a  # seeded: reproducible
    assert len({gen(prompt, 12, greedy=False, temperature=2.0, seed=s) for s in range(6)}) > 1
    # From the checkpoint directly (weights consolidated in memory): the same greedy text.
    assert main(["generate", "--checkpoint", runs[2][1]["checkpoint"], "--prompt", prompt,
                 "--max-new-tokens", "12", "--greedy"]) == 0
    assert prompt + greedy in capsys.readouterr().out


@slow
def test_release_check_passes_and_fails_on_param_mismatch(exported, runs, tiny_data, capsys):
    cfg, summary = runs[2]
    assert main(["check", exported[2], "-n", "5", "--data", f"{tiny_data}/val"]) == 0
    out = capsys.readouterr().out
    assert f"{summary['params']:,} parameters, expected {summary['params']:,}" in out
    assert "p50" in out and "p99" in out and "release check passed" in out
    assert main(["check", exported[3], "-n", "3", "--expect-params", str(summary["params"] + 1), "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert not rep["ok"] and [c["name"] for c in rep["checks"] if not c["ok"]] == ["params"]
    assert rep["p99_ms"] >= rep["p50_ms"] > 0


@slow
def test_a_bf16_export_is_half_the_bytes_passes_the_check_and_scores_as_the_fp32_one(exported, runs, tiny_data,
                                                                                      tmp_path, capsys):
    """The run trained in fp32 (CPU), so its export is fp32 by default; `--dtype bf16` halves the weights' bytes, the
    release check passes on it, and its log-probabilities match the fp32 export's within bf16's precision (8 bits of
    mantissa: 0.05 nats on these tokens)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from raytrain.data.manifest import load_split
    from raytrain.evaluation import eval_rows

    cfg, summary = runs[2]
    bf16 = str(tmp_path / "bf16")
    assert main(["export", "--checkpoint", summary["checkpoint"], "--out", bf16, "--dtype", "bf16"]) == 0
    fp32 = exported[2]
    assert json.load(open(f"{fp32}/raytrain_export.json"))["dtype"] == "fp32"
    assert json.load(open(f"{bf16}/raytrain_export.json"))["dtype"] == "bf16"
    with safe_open(f"{bf16}/model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    ratio = (tmp_path / "bf16" / "model.safetensors").stat().st_size / os.path.getsize(f"{fp32}/model.safetensors")
    assert 0.45 <= ratio <= 0.55, ratio
    assert main(["check", bf16, "-n", "3"]) == 0 and "release check passed" in capsys.readouterr().out
    rows = eval_rows(load_split(f"{tiny_data}/val"), 16, 4, 2)
    x = torch.from_numpy(np.array(rows[:, :-1], dtype=np.int64))
    with torch.no_grad():
        lp = [torch.log_softmax(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)(input_ids=x).logits, -1)
              for d in (fp32, bf16)]
    assert (lp[0] - lp[1]).abs().max().item() < 0.05


@slow
def test_tag_rollback_resume_continues_from_the_tagged_step(runs, tiny_data, tmp_path):
    cfg0, _ = runs[2]
    want = {r["step"]: r["loss"] for r in _metrics(cfg0.run_uri) if "loss" in r}
    shutil.copytree(cfg0.run_uri, tmp_path / "z2", ignore=shutil.ignore_patterns("checkpoint_manager_snapshot*"))
    run = str(tmp_path / "z2")
    assert main(["ckpt", "tag", run, "v1.0", "--step", "5"]) == 0
    assert main(["ckpt", "rollback", run, "v1.0"]) == 0
    old10 = (tmp_path / "z2" / "checkpoint_00000010" / "manifest.json").read_text()
    # keep_last=1: the worker's own pruning must still spare the tagged checkpoint.
    cfg = tiny_cfg(tiny_data, tmp_path, "z2", "checkpoint.keep_last=1")
    summary = train(cfg, log=lambda *_: None)
    got = {r["step"]: r["loss"] for r in _metrics(run) if "loss" in r}
    assert summary["steps"] == 10 and sorted(got) == list(range(1, 11))
    for step in range(6, 11):  # retrained from step 5 on the same data: the original run's losses
        assert got[step] == pytest.approx(want[step], abs=1e-5), step
    assert (tmp_path / "z2" / "checkpoint_00000010" / "manifest.json").read_text() != old10  # rewritten
    assert catalog.read_resume_marker(run) is None  # moved past every old checkpoint: marker consumed
    assert catalog.latest_complete(run).step == 10
    assert sorted(p.name for p in (tmp_path / "z2").glob("checkpoint_*")) == ["checkpoint_00000005",
                                                                           "checkpoint_00000010"]


@slow
def test_finetune_from_export_starts_at_its_loss(runs, exported, tiny_data, tmp_path):
    src_cfg, _ = runs[2]
    fresh0, trained10 = _val(src_cfg.run_uri, 0), _val(src_cfg.run_uri, 10)
    cfg = tiny_cfg(tiny_data, tmp_path, "ft", f"model.init_from={exported[2]}", "run.max_steps=2",
                   "scaling.num_workers=1",
                   "optim.lr=1e-4", "checkpoint.every_n_steps=2")
    train(cfg, log=lambda *_: None)
    start = _val(cfg.run_uri, 0)
    assert start == pytest.approx(trained10, abs=1e-4)  # the exported model's loss ...
    assert start < fresh0 - 0.5  # ... not a fresh model's


@pytest.fixture
def fresh_model_dir(tiny_data, tmp_path):
    """An untrained model saved as a Hugging Face directory with the dataset's tokenizer (no training)."""
    from raytrain.data.manifest import load_split
    from raytrain.export import hf_tokenizer
    from raytrain.model import build_model

    cfg = tiny_cfg(tiny_data, tmp_path, "x")
    split = load_split(cfg.data.train)
    d = tmp_path / "fresh"
    build_model(cfg.model, split.vocab_size, 0, split.eot_id).save_pretrained(d)
    hf_tokenizer(split.tokenizer_uri, 32, split.eot_id).save_pretrained(d)
    return cfg, split, d


def test_init_from_takes_the_shape_and_rejects_another_tokenizer(fresh_model_dir, tmp_path):
    from raytrain.errors import UserError
    from raytrain.model import apply_init_from, build_model

    cfg, split, d = fresh_model_dir
    ft = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": str(d), "n_layer": 3,
                                                                        "hidden_size": 64})})
    got = apply_init_from(ft, split.tokenizer_uri, log=lambda *_: None)
    assert (got.model.n_layer, got.model.hidden_size, got.model.vocab_size) == (1, 32, split.vocab_size)
    m = build_model(got.model, split.vocab_size, seed=123)  # another seed: the weights must still be the file's
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(d)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))
    other = json.loads((d / "tokenizer.json").read_text())
    vocab = other["model"]["vocab"]
    vocab["not-in-the-data"] = max(vocab.values()) + 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(UserError, match="tokenized with .*other.json, not with model.init_from's tokenizer"):
        apply_init_from(ft, str(tmp_path / "other.json"), log=lambda *_: None)
    nothing = ft.model_copy(update={"model": ft.model.model_copy(update={"init_from": str(tmp_path)})})
    with pytest.raises(UserError, match="no config.json there"):
        apply_init_from(nothing, split.tokenizer_uri, log=lambda *_: None)


def test_lifecycle_commands_reject_bad_input(fresh_model_dir, tmp_path, capsys):
    _, _, d = fresh_model_dir
    assert main(["export", "--checkpoint", str(tmp_path / "checkpoint_00000001"), "--out", str(tmp_path / "o")]) == 2
    assert "is not complete (no manifest" in capsys.readouterr().err
    assert main(["generate", "--model", str(d), "--prompt", "one two", "--max-new-tokens", "40"]) == 2
    assert "exceeds the model's context of 32 tokens" in capsys.readouterr().err
    assert main(["check", str(d), "-n", "2"]) == 1  # not exported by raytrain: no recorded count
    assert "nothing to compare with: pass --expect-params" in capsys.readouterr().out
    assert main(["check", str(tmp_path / "nope"), "-n", "2"]) == 1
    assert "FAIL  load" in capsys.readouterr().out
