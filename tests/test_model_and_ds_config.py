"""Model construction from config and the generated DeepSpeed config / LR schedule."""

import pytest
import torch

from raytrain.config import load_config
from raytrain.ds_config import build_ds_config, lr_lambda, resolve_dtype
from raytrain.model import build_model, flops_per_token, param_count


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_models_build_deterministically_and_run(family):
    cfg = load_config("tiny", [f"model.family={family}", "model.n_layer=1", "model.hidden_size=32",
                               "model.n_head=4", "model.seq_len=16"]).model
    a, b = build_model(cfg, 100, seed=1), build_model(cfg, 100, seed=1)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    logits = a(input_ids=torch.randint(0, 100, (2, 16))).logits
    assert logits.shape == (2, 16, 100)
    n = param_count(a)
    assert 0 < n < sum(p.numel() for p in a.parameters()) + 1
    assert flops_per_token(n, cfg) > 6 * n


@pytest.mark.parametrize("family", ["gpt2", "llama", "mixtral"])
def test_a_model_built_for_a_restore_skips_random_init_but_not_its_buffers(family):
    """init=False (a restore overwrites every weight): the weights are not the seed's, but the parameters are the same
    ones, tied as usual, every buffer (GPT-2's causal mask, Llama's rotary frequencies) is the seed's, and loading the
    weights gives the initialised model's outputs."""
    cfg = load_config("tiny", [f"model.family={family}", "model.n_layer=1", "model.hidden_size=32",
                               "model.n_head=4", "model.seq_len=16"]).model
    ref, bare = build_model(cfg, 100, seed=1), build_model(cfg, 100, seed=1, init=False)
    # The same parameters, tied ones included (GPT-2's output layer is its embedding: one parameter, not two).
    assert [n for n, _ in bare.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(ref.parameters(), bare.parameters()))
    bufs = dict(ref.named_buffers())
    assert dict(bare.named_buffers()).keys() == bufs.keys()
    assert all(torch.equal(b, bufs[n]) for n, b in bare.named_buffers())
    bare.load_state_dict(ref.state_dict())
    x = torch.randint(0, 100, (2, 16))
    assert torch.equal(bare(input_ids=x).logits, ref(input_ids=x).logits)


def test_ds_config_is_derived_from_ours():
    cfg = load_config("tiny", ["batch.micro_batch_size=4", "batch.gradient_accumulation_steps=3",
                               "scaling.num_workers=2", "optim.grad_clip=0.5", "deepspeed.zero_stage=3",
                               "deepspeed.extra.zero_optimization.reduce_bucket_size=1000"])
    ds = build_ds_config(cfg, world_size=2, dtype="bf16", cuda=True)
    assert ds["train_batch_size"] == 24 and ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 3 and ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["reduce_bucket_size"] == 1000
    fp16 = build_ds_config(cfg, 2, "fp16", True)["fp16"]
    assert fp16["enabled"] and fp16["loss_scale"] == 0  # 0 = dynamic loss scaling


def test_the_run_line_names_the_optimizer_the_engine_gets():
    from raytrain.trainer import optimizer_named

    assert optimizer_named(load_config("tiny", ["optim.lr=0.003"])) == "AdamW lr 0.003"
    muon = load_config("tiny", ["deepspeed.extra={optimizer: {type: Muon, params: {lr: 0.02, momentum: 0.95}}}"])
    assert optimizer_named(muon) == "Muon lr 0.02"
    assert build_ds_config(muon, 1, "fp32", cuda=False)["optimizer"]["type"] == "Muon"


def test_dtype_auto():
    cfg = load_config("tiny")
    assert resolve_dtype(cfg, cuda=False, bf16_supported=False) == "fp32"
    assert resolve_dtype(cfg, cuda=True, bf16_supported=True) == "bf16"
    assert resolve_dtype(cfg, cuda=True, bf16_supported=False) == "fp16"


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_lr_schedule_warmup_then_decay_to_min(decay):
    cfg = load_config("tiny", ["optim.warmup_steps=10", "run.max_steps=110", f"optim.decay={decay}",
                               "optim.min_lr_ratio=0.1"])
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 110))
