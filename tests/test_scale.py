"""Scale features at tiny size on CPU: ZeRO-3 with CPU offload of optimizer and parameters plus activation
checkpointing, and a Mixture-of-Experts (Mixtral) model whose router aux loss is trained and logged.

Each run crashes a worker once after a checkpoint, so it also proves resume (restarted from the checkpoint,
every step logged once), then trains to the end with falling loss and is exported to a Hugging Face directory.
"""

import json

import pytest
import torch

from raytrain import storage
from raytrain.config import load_config
from raytrain.ds_config import build_ds_config
from raytrain.export import export
from raytrain.model import build_model, moe_aux_loss
from raytrain.trainer import train
from tests.conftest import tiny_cfg


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
        tiny_data, tmp_path, "z3off", "deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu",
        "deepspeed.offload_param=cpu", "model.activation_checkpointing=true")
    ds = json.loads(json.dumps(build_ds_config(cfg, 2, "fp32", cuda=False)))["zero_optimization"]
    assert ds["offload_optimizer"]["device"] == "cpu" and ds["offload_param"]["device"] == "cpu"
    ckpt = tmp_path / "z3off" / "checkpoint_00000012" / "engine"
    # ZeRO-3 shards: one optimizer-state file per rank, each holding its partition.
    assert sorted(p.name for p in ckpt.iterdir() if "optim_states" in p.name) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    _export_loads(summary, tmp_path / "z3off-hf")


@pytest.mark.slow
def test_mixture_of_experts_trains_logs_aux_loss_resumes_and_exports(ray_cluster, tiny_data, tmp_path):
    cfg, summary, recs = _run_with_one_crash(
        tiny_data, tmp_path, "moe", "model.family=mixtral", "model.moe_experts=4", "model.moe_top_k=2",
        "model.moe_aux_loss_coef=0.02", "model.n_head=2", "model.n_kv_head=1", "model.intermediate_size=64")
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
