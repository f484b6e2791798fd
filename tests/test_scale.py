"""Scale features at tiny size on CPU: ZeRO-3 with CPU offload of optimizer and parameters plus activation
checkpointing, a Mixture-of-Experts (Mixtral) model whose router aux loss is trained and logged, and DeepSpeed
AutoTP tensor parallelism (with activation checkpointing) checked against a one-worker run.

Each run crashes a worker once after a checkpoint, so it also proves resume (restarted from the checkpoint,
every step logged once), then trains to the end with falling loss and is exported to a Hugging Face directory.
"""

import json

import pytest
import torch

from raytrain import storage
from raytrain.config import load_config
from raytrain.data.manifest import load_split
from raytrain.ds_config import build_ds_config
from raytrain.errors import UserError
from raytrain.export import export, load_checkpoint
from raytrain.model import build_model, flops_per_token, moe_aux_loss, param_counts
from raytrain.capacity import shape_of
from raytrain.trainer import train
from tests.helpers import tiny_cfg


def _metrics(run_uri: str) -> list[dict]:
    return [json.loads(line) for line in storage.read_text(storage.join(run_uri, "metrics.jsonl")).splitlines()]


def _run_with_one_crash(tiny_data, tmp_path, name, *overrides):
    cfg = tiny_cfg(tiny_data, tmp_path, name, "run.max_steps=12", "checkpoint.every_n_steps=4", "run.max_failures=1",
                   *overrides)
    summary = train(cfg, log=lambda *_: None,
                    inject={"crash_at_step": 6, "marker": str(tmp_path / f"{name}.crashed"), "rank": 1})
    recs = [r for r in _metrics(cfg.run_uri) if "loss" in r]
    steps = [r["step"] for r in recs]
    assert summary["restarts"] == 1 and summary["steps"] == 12
    assert sorted(steps) == list(range(1, 13)) and len(set(steps)) == 12  # resumed at 4: nothing lost or doubled
    loss = {r["step"]: r["loss"] for r in recs}
    assert (loss[11] + loss[12]) / 2 < 0.9 * (loss[1] + loss[2]) / 2, loss  # 12 tiny steps: ~20 % lower
    return cfg, summary, recs


def _export_loads(summary, out):
    from transformers import AutoModelForCausalLM

    meta = export(summary["checkpoint"], str(out), log=lambda *_: None)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert sum(p.numel() for p in model.parameters()) == summary["params"]
    return meta, model


@pytest.mark.slow
def test_zero3_cpu_offload_with_activation_checkpointing(ray_cluster, tiny_data, tmp_path):
    cfg, summary, _ = _run_with_one_crash(
        # Storage restore: the partitions each rank reads are checked below (memory snapshots are off).
        tiny_data, tmp_path, "z3off", "checkpoint.memory=false", "deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu",
        "deepspeed.offload_param=cpu", "model.activation_checkpointing=true")
    ds = json.loads(json.dumps(build_ds_config(cfg, 2, "fp32", cuda=False)))["zero_optimization"]
    assert ds["offload_optimizer"]["device"] == "cpu" and ds["offload_param"]["device"] == "cpu"
    ckpt = tmp_path / "z3off" / "checkpoint_00000012" / "engine"
    # ZeRO-3 shards: one optimizer-state file per rank, each holding its partition.
    assert sorted(p.name for p in ckpt.iterdir() if "optim_states" in p.name) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    # The restore after the crash: each rank read only its own partitions (weights and optimizer) and the small
    # shared files, about half the checkpoint, and checked their sha256.
    (rec,) = [json.loads(x) for x in (tmp_path / "z3off" / "restores.jsonl").read_text().splitlines()]
    assert rec["ok"] and all(r["reads"] <= 0.6 * rec["checkpoint_bytes"] for r in rec["ranks"]), rec
    _export_loads(summary, tmp_path / "z3off-hf")


@pytest.mark.slow
def test_mixture_of_experts_trains_logs_aux_loss_resumes_and_exports(ray_cluster, tiny_data, tmp_path):
    cfg, summary, recs = _run_with_one_crash(
        tiny_data, tmp_path, "moe", "model.family=mixtral", "model.moe_experts=4", "model.moe_top_k=2",
        "model.moe_aux_loss_coef=0.02", "model.n_head=2", "model.n_kv_head=1", "model.intermediate_size=64")
    # Achieved FLOP/s count the parameters a token passes through (top-2 of 4 experts), not all of them.
    model = build_model(cfg.model, load_split(cfg.data.train, "data.train").vocab_size, seed=0)
    total, active = param_counts(model, cfg.model)
    assert total == summary["params"] and active < total
    for r in recs:
        assert r["tflops_per_worker"] * 1e12 * 2 / r["tokens_per_s"] == pytest.approx(
            flops_per_token(active, cfg.model), rel=1e-9)
    aux = [r["aux_loss"] for r in recs]
    # Mixtral's load-balancing loss is E * sum(fraction_routed * mean_prob) per layer: top_k (2) when perfectly
    # balanced, larger when not; it is finite and positive at every logged step.
    assert all(1.5 < a < 4.0 for a in aux), aux
    meta, model = _export_loads(summary, tmp_path / "moe-hf")
    assert model.config.model_type == "mixtral" and model.config.num_local_experts == 4
    assert model.config.num_experts_per_tok == 2


def test_moe_aux_loss_is_in_the_training_loss():
    """The loop adds coef * aux to the loss it backpropagates: the router weights get its gradient."""
    cfg = load_config("tiny", ["model.family=mixtral", "model.n_layer=1", "model.hidden_size=32", "model.n_head=2",
                               "model.moe_experts=4", "model.moe_top_k=1", "model.seq_len=16"]).model
    model = build_model(cfg, 50, seed=0)
    x = torch.randint(0, 50, (2, 16))
    out = model(input_ids=x)
    aux = moe_aux_loss(model)
    assert aux is out.aux_loss and aux.requires_grad and aux.item() > 0
    aux.backward()
    router = [p for n, p in model.named_parameters() if "gate" in n and "experts" not in n]
    assert router and all(p.grad is not None and p.grad.abs().sum() > 0 for p in router)


def test_moe_active_params_count_top_k_of_the_experts():
    """Mixtral: each token runs through top_k of the experts, so FLOPs per token use that count, not the total."""
    cfg = load_config("tiny", ["model.family=mixtral", "model.n_layer=2", "model.hidden_size=32", "model.n_head=2",
                               "model.moe_experts=4", "model.moe_top_k=1", "model.intermediate_size=48",
                               "model.seq_len=16"]).model
    total, active = param_counts(build_model(cfg, 50, seed=0), cfg)
    expert = 3 * 32 * 48  # gate, up and down projections of one expert
    assert total - active == 2 * (4 - 1) * expert  # per layer, 3 of the 4 experts are idle for a token
    assert shape_of(cfg, 50).active_params == active  # the planner and the loop's MFU agree
    assert flops_per_token(active, cfg) < flops_per_token(total, cfg)
    dense = load_config("tiny", ["model.family=llama"]).model
    model = build_model(dense, 50, seed=0)
    assert param_counts(model, dense) == (sum(p.numel() for p in model.parameters()),) * 2


def _counting(fn, counter: list):
    def wrapped(*args, **kwargs):
        counter[0] += 1
        return fn(*args, **kwargs)
    return wrapped


def test_activation_checkpointing_recomputes_each_block_in_backward():
    """model.activation_checkpointing: every transformer block runs twice per step (forward, then recomputed
    in backward), instead of keeping its activations."""
    calls = {}
    for on in (False, True):
        cfg = load_config("tiny", ["model.family=llama", "model.n_layer=2", "model.hidden_size=32",
                                   "model.n_head=2", "model.seq_len=16", f"model.activation_checkpointing={str(on).lower()}"]).model
        model = build_model(cfg, 50, seed=0).train()
        n = [0]
        for layer in model.model.layers:
            layer.mlp.forward = _counting(layer.mlp.forward, n)  # module hooks do not fire in the recompute
        x = torch.randint(0, 50, (2, 16))
        model(input_ids=x, labels=x).loss.backward()
        calls[on] = n[0]
    assert calls == {False: 2, True: 4}


@pytest.mark.parametrize("overrides, message", [
    (["scaling.num_workers=3"], "deepspeed.tensor_parallel_size=2 must divide scaling.num_workers=3"),
    (["model.family=gpt2"], "deepspeed.tensor_parallel_size=2 needs model.family=llama"),
    (["model.family=mixtral"], "deepspeed.tensor_parallel_size=2 needs model.family=llama"),
    (["model.n_head=1"], "deepspeed.tensor_parallel_size=2 must divide model.n_head=1"),
    (["model.n_kv_head=1"], "deepspeed.tensor_parallel_size=2 must divide model.n_kv_head=1"),
    (["deepspeed.zero_stage=0"], "deepspeed.tensor_parallel_size=2 needs deepspeed.zero_stage >= 1"),
])
def test_tensor_parallel_config_errors_name_the_key(overrides, message):
    with pytest.raises(UserError) as e:
        load_config("tiny", ["model.family=llama", "model.n_head=2", "model.hidden_size=32",
                             "deepspeed.tensor_parallel_size=2", *overrides])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_tensor_parallel_batch_is_per_data_parallel_group():
    """4 workers in tensor-parallel pairs: 2 data-parallel groups, so the global batch counts 2 slices, not 4."""
    cfg = load_config("tiny", ["model.family=llama", "model.n_head=2", "model.hidden_size=32", "scaling.num_workers=4",
                               "deepspeed.tensor_parallel_size=2", "batch.micro_batch_size=4",
                               "batch.gradient_accumulation_steps=null", "batch.global_batch_size=16"])
    assert (cfg.data_parallel_size, cfg.accumulation, cfg.global_batch) == (2, 2, 16)
    ds = build_ds_config(cfg, 4, "fp32", cuda=False)
    assert ds["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": False}
    assert "train_batch_size" not in ds  # DeepSpeed derives it per its own (data-parallel) world
    assert "tensor_parallel" not in build_ds_config(load_config("tiny"), 2, "fp32", cuda=False)


@pytest.mark.slow
def test_tensor_parallel_matches_one_worker_through_a_crash_and_exports(ray_cluster, tiny_data, tmp_path):
    """2 workers, AutoTP size 2 (one data-parallel group; activation checkpointing on) against 1 worker without
    tensor parallelism: the same batches, the same losses, step by step through a crash and resume, and the
    exported model holds the same weights."""
    llama = ("model.family=llama", "model.n_head=2", "model.intermediate_size=64")
    one = tiny_cfg(tiny_data, tmp_path, "tp1", *llama, "run.max_steps=12", "checkpoint.every_n_steps=4",
                   "scaling.num_workers=1")
    want_summary = train(one, log=lambda *_: None)
    want = {r["step"]: r for r in _metrics(one.run_uri) if "loss" in r}
    cfg, summary, recs = _run_with_one_crash(tiny_data, tmp_path, "tp2", *llama, "deepspeed.tensor_parallel_size=2",
                                             "model.activation_checkpointing=true")
    assert cfg.global_batch == one.global_batch == 4
    for r in recs:
        assert r["batch_crc32"] == want[r["step"]]["batch_crc32"], r["step"]  # the same samples in each step
        assert r["content_checksum"] == want[r["step"]]["content_checksum"], r["step"]  # the same bytes, counted once
        assert r["loss"] == pytest.approx(want[r["step"]]["loss"], abs=1e-4), r["step"]
    engine = tmp_path / "tp2" / "checkpoint_00000012" / "engine"
    # One slice of the model per tensor-parallel rank.
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= {p.name for p in engine.iterdir()}
    _, model = _export_loads(summary, tmp_path / "tp2-hf")
    assert summary["params"] == want_summary["params"]
    ref = load_checkpoint(want_summary["checkpoint"]).model.state_dict()
    got = model.state_dict()
    assert set(got) == set(ref)
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-3
