"""Fine-tuning on a real local Ray cluster with real DeepSpeed (CPU, gloo): prompt/completion examples, loss on the
completions only, validation and `raytrain eval` with the same mask; LoRA adapters (raytrain/lora.py)."""

import json

import pytest

from raytrain import storage
from raytrain.data.prepare import PrepareConfig, prepare
from raytrain.evaluation import evaluate
from raytrain.trainer import train
from tests.helpers import tiny_cfg

pytestmark = pytest.mark.slow
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    """Instructions whose answer is a function of the prompt (the next three words after the prompt's last)."""
    d = tmp_path_factory.mktemp("sft")
    recs = []
    for i in range(400):
        k = i % 10
        prompt = f"after {WORDS[k]} {i % 7}:"
        recs.append({"prompt": prompt, "completion": " ".join(WORDS[(k + j) % 10] for j in range(1, 4))
                     + f" {i}"})
    (d / "ex.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = d / "data"
    prepare(PrepareConfig(inputs=[str(d / "ex.jsonl")], out=str(out), format="prompt_completion", vocab_size=300,
                          seq_len=32, val_fraction=0.1, near_dup_threshold=1.0, engine="local"), log=lambda *_: None)
    return out


def _metrics(run_uri):
    return [json.loads(x) for x in storage.read_text(storage.join(run_uri, "metrics.jsonl")).splitlines()]


def _losses(run_uri):
    return {r["step"]: r["loss"] for r in _metrics(run_uri) if "loss" in r}


def _dir_bytes(path):
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


LORA = ("model.lora.r=4", "model.lora.target_modules=[c_attn,c_fc]", "run.max_steps=12",
        "checkpoint.every_n_steps=4", "optim.lr=3e-2", "run.eval_every=12")


@pytest.fixture(scope="module")
def lora_run(ray_cluster, sft_data, tmp_path_factory):
    """An uninterrupted 2-worker ZeRO-2 LoRA fine-tune of 12 steps on prompt/completion examples."""
    runs = tmp_path_factory.mktemp("runs")
    cfg = tiny_cfg(sft_data, runs, "lora", *LORA)
    lines = []
    summary = train(cfg, log=lines.append)
    return cfg, summary, lines, runs


def test_lora_fine_tune_trains_only_the_adapter_and_exports(lora_run, sft_data, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from raytrain.data.manifest import load_split
    from raytrain.data.reader import read_rows
    from raytrain.export import export, load_checkpoint

    cfg, summary, lines, runs = lora_run
    val = [r["val_loss"] for r in _metrics(cfg.run_uri) if "val_loss" in r]
    assert val[-1] < val[0] - 0.1, val  # the masked validation loss falls (a random base: LoRA alone learns slowly)
    ckpt = runs / "lora" / "checkpoint_00000012"
    # Masked validation in `raytrain eval` equals what training reported.
    out = evaluate(checkpoint=str(ckpt), workers=1, log=lambda *_: None)
    assert abs(out["val_loss"] - summary["val_loss"]) < 1e-5
    # Trainable parameters: the adapter's, printed. c_attn [32 -> 96] and c_fc [32 -> 128], r=4: 4 x (in + out).
    adapter = 4 * (32 + 96) + 4 * (32 + 128)
    assert summary["trainable_params"] == adapter  # the worker's banner prints the same figure
    # Checkpoint bytes: the adapter's weights + fp32 Adam state instead of the whole model's.
    full = summary["params"] * (4 + 12)  # fp32 weights + master copy and two Adam moments, ZeRO-2 on CPU
    engine_bytes = _dir_bytes(ckpt / "engine")
    assert engine_bytes < 0.25 * full, (engine_bytes, full)
    # Merged export: stock transformers, same logits as the adapter model.
    export(str(ckpt), str(tmp_path / "merged"), log=lambda *_: None)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    peft_model = load_checkpoint(str(ckpt), merge=False).model
    x = torch.from_numpy(read_rows(load_split(str(sft_data / "val")), 0, 4)[:, :32].astype("int64"))
    with torch.no_grad():
        assert (merged(input_ids=x).logits - peft_model(input_ids=x).logits).abs().max() < 1e-5
    # The adapter directory, and serving's merge of it, give the same model.
    export(str(ckpt), str(tmp_path / "adapter"), adapter=True, log=lambda *_: None)
    assert (tmp_path / "adapter" / "adapter_config.json").exists() and (tmp_path / "adapter" / "base").is_dir()
    from raytrain.serving.source import resolve

    served = AutoModelForCausalLM.from_pretrained(resolve(str(tmp_path / "adapter"), log=lambda *_: None).uri).eval()
    with torch.no_grad():
        assert (served(input_ids=x).logits - peft_model(input_ids=x).logits).abs().max() < 1e-5
    print(f"lora checkpoint engine bytes {engine_bytes} vs full-model arithmetic {full}")


def test_lora_resumes_exactly_after_a_sigkill_and_a_resize(lora_run, sft_data, tmp_path):
    """LoRA through faults: a SIGKILL at step 6 on 2 workers (restarted in the job, from host memory), a second at
    step 10 ends the job; the run submitted again on 1 worker resumes from checkpoint 8 (a 2 -> 1 resize of the
    adapter's optimizer state). Every loss equals the uninterrupted run's (1e-5)."""
    cfg, _, _, _ = lora_run
    want = _losses(cfg.run_uri)
    # Sync upload: checkpoint 8 is committed before the kill two steps later, however loaded the machine.
    common = (*LORA, "checkpoint.upload=sync")
    crash = tiny_cfg(sft_data, tmp_path, "lora-kill", *common, "run.max_failures=1")
    kills = [{"step": 6, "rank": 1, "signal": "SIGKILL"}, {"step": 10, "rank": 0, "signal": "SIGKILL"}]
    with pytest.raises(Exception):
        train(crash, log=lambda *_: None, inject={"events": kills, "marker": str(tmp_path / "k")})
    assert (tmp_path / "k.0").exists() and (tmp_path / "k.1").exists()
    one = tiny_cfg(sft_data, tmp_path, "lora-kill", *common, "scaling.num_workers=1")
    summary = train(one, log=lambda *_: None)
    assert summary["steps"] == 12 and summary["trainable_params"] == 4 * (32 + 96) + 4 * (32 + 128)
    restores = [json.loads(x) for x in storage.read_text(one.run_uri + "/restores.jsonl").splitlines()]
    # The restart in the job from host memory (the tier is on by default: the adapter's state at step 5, the newest
    # both ranks hold); the resubmitted, resized run from storage.
    assert [(r["source"], r["step"], r["checkpoint"]) for r in restores] == [
        ("memory:local", 5, None), ("storage", 8, "checkpoint_00000008")], restores
    got = _losses(one.run_uri)
    assert sorted(got) == list(range(1, 13))
    assert max(abs(got[s] - want[s]) for s in got) < 1e-5, (got, want)
