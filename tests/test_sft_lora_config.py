"""LoRA settings without Ray: adapters on the named modules only, one-line refusals for what cannot run, the base's
sha256 check; and the bad-input CLI exit codes."""

import subprocess
import sys

import pytest
import torch

from raytrain import lora
from raytrain.config import load_config
from raytrain.errors import UserError
from raytrain.model import build_model
from raytrain.trainer import check_inputs

SMALL = ["model.hidden_size=16", "model.n_head=2", "model.n_layer=1", "model.lora.r=2"]


@pytest.mark.parametrize("family,targets,want", [
    ("gpt2", [], ["c_attn"]), ("llama", ["q_proj", "down_proj"], ["down_proj", "q_proj"])])
def test_only_the_adapter_trains(family, targets, want):
    cfg = load_config(None, [f"model.family={family}", *SMALL, f"model.lora.target_modules={targets}"])
    model, ident = lora.prepare_model(build_model(cfg.model, 64, 0), cfg.model, seed=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}) == want
    assert ident["sha256"] == lora.base_sha256(build_model(cfg.model, 64, 0)) and ident["seed"] == 0
    with pytest.raises(UserError, match="trained on a base model with sha256"):
        lora.check_base(ident, lora.base_sha256(build_model(cfg.model, 64, 1)), "ckpt")


def test_target_names_that_match_nothing_fail_before_any_worker(tiny_data):
    cfg = load_config("tiny", [f"data.train={tiny_data}/train", "data.val=null", "model.seq_len=32", *SMALL,
                               "model.lora.target_modules=[q_proj]"])
    with pytest.raises(UserError, match=r"\['q_proj'\] match no module of the gpt2 model; its linear layers are named "
                                        r"c_attn, c_fc, c_proj, lm_head"):
        check_inputs(cfg)


def test_settings_lora_cannot_honour_are_one_line_and_exit_2():
    for extra, msg in ((["model.compile=true"], "model.lora with model.compile=true is not supported"),
                       (["deepspeed.tensor_parallel_size=2", "model.family=llama"], "deepspeed.tensor_parallel_size"),
                       (["model.lora.r=-1"], "model.lora.r")):
        with pytest.raises(UserError, match=msg):
            load_config("tiny", ["model.lora.r=4", *extra])
    r = subprocess.run([sys.executable, "-m", "raytrain", "config", "--config", "tiny", "model.lora.r=4",
                        "deepspeed.zero_stage=3"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "model.lora with deepspeed.zero_stage=3 is not supported" in r.stderr


def test_canonical_hash_ignores_the_build_dtype():
    cfg = load_config(None, ["model.family=llama", *SMALL])
    m = build_model(cfg.model, 64, 0)
    assert lora.base_sha256(m) == lora.base_sha256(m.to(torch.bfloat16).float().to(torch.bfloat16))
