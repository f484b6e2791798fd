"""LoRA adapters through `peft` (model.lora): wrapping the model, the base model's identity kept with every
checkpoint, and turning a checkpoint's adapter into a merged model (the settings it cannot honour are checked in
raytrain/config.py; the PEFT directory export is raytrain/export.py's).

Only the adapter's parameters train: the optimizer holds only them (param_groups takes trainable parameters) and
DeepSpeed saves only them (exclude_frozen_parameters); the frozen base is rebuilt on resume and export from the
run's own config (model.init_from or the seeded random init) and checked against the sha256 the checkpoint holds.
peft is imported only here, and only when model.lora.r > 0.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch

from raytrain.errors import UserError

BASE_DIR = "base"  # `raytrain export --adapter` of a run without model.init_from: the frozen base beside the adapter


def enabled(model_cfg) -> bool:
    return model_cfg.lora.r > 0


def base_sha256(model: torch.nn.Module) -> str:
    """The frozen base's identity: sha256 over its tensors' names, shapes and values, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        # bf16 as the canonical precision: a base built in the training dtype on a GPU and in fp32 for export
        # from the same fp32 files hash alike
        t = p.detach().to("cpu")
        t = (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def wrap(model: torch.nn.Module, model_cfg) -> torch.nn.Module:
    """The peft model with adapters on model.lora.target_modules (only they train). Names that match no module are
    a one-line error listing some that exist."""
    from peft import LoraConfig, get_peft_model

    lc = model_cfg.lora
    targets = list(lc.target_modules) or None
    _check_names(model, model_cfg)
    cfg = LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=targets,
                     task_type="CAUSAL_LM", fan_in_fan_out=model_cfg.family == "gpt2")  # GPT-2's Conv1D: [in, out]
    try:
        peft_model = get_peft_model(model, cfg)
    except ValueError as e:
        raise UserError(f"model.lora: {str(e).splitlines()[0]}") from None
    if model_cfg.activation_checkpointing:
        peft_model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks still need grads in
    return peft_model


def trainable_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def identity(model_cfg, *, seed: int, sha256: str) -> dict:
    """What a checkpoint records of the frozen base: where it came from and its sha256."""
    return {"init_from": model_cfg.init_from, "seed": None if model_cfg.init_from else seed,
            "family": model_cfg.family, "sha256": sha256}


def check_base(saved: Optional[dict], sha256: str, where: str) -> None:
    """The base this process built must be the one the adapter was trained on."""
    if saved and saved.get("sha256") != sha256:
        raise UserError(f"{where}: its LoRA adapter was trained on a base model with sha256 {saved['sha256'][:12]}..., "
                        f"but the base built now has {sha256[:12]}... (model.init_from or its files changed); "
                        "restore that base or start a new run")


def adapter_model(base: torch.nn.Module, model_cfg, adapter_sd: dict) -> torch.nn.Module:
    """The peft model of a checkpoint: base + the saved adapter weights (all of them must fit)."""
    model = wrap(base, model_cfg)
    missing, unexpected = model.load_state_dict(adapter_sd, strict=False)
    lora_missing = [k for k in missing if "lora_" in k]
    if lora_missing or unexpected:
        raise UserError(f"saved adapter weights do not fit model.lora (missing {lora_missing[:3]}, unexpected "
                        f"{list(unexpected)[:3]})")
    return model.eval()


def prepare_model(model: torch.nn.Module, model_cfg, *, seed: int) -> tuple[torch.nn.Module, Optional[dict]]:
    """(the model to train, the base identity) - the peft model when model.lora.r > 0, else the model as it is."""
    if not enabled(model_cfg):
        return model, None
    ident = identity(model_cfg, seed=seed, sha256=base_sha256(model))
    return wrap(model, model_cfg), ident


def describe(model: torch.nn.Module, model_cfg, base_params: int) -> str:
    lc, n = model_cfg.lora, trainable_count(model)
    targets = sorted(next(iter(model.peft_config.values())).target_modules)
    return (f"LoRA r={lc.r} alpha={lc.alpha:g} dropout={lc.dropout:g} on {', '.join(targets)}: {n:,} trainable "
            f"parameters (the adapter's), base {base_params:,} frozen ({100 * n / max(1, base_params):.2f}%)")


def from_checkpoint(cfg, adapter_sd: dict, *, vocab: Optional[int], eot_id: Optional[int], saved: Optional[dict],
                    where: str, merge: bool) -> torch.nn.Module:
    """A LoRA checkpoint's model (fp32, eval): its base rebuilt from the run's config and checked by sha256, the
    adapter loaded on it, then merged into a plain `transformers` model (merge) or kept apart (the peft model)."""
    from raytrain.model import build_model

    if vocab is None:
        raise UserError(f"{where}: the vocabulary size of its base is unknown (its data.train is unreachable); "
                        "set model.vocab_size in the run's config")
    base = build_model(cfg.model, vocab, cfg.run.seed, eot_id)
    check_base(saved, base_sha256(base), where)
    model = adapter_model(base, cfg.model, adapter_sd)
    return model.merge_and_unload().eval() if merge else model


ADAPTER_CONFIG = "adapter_config.json"  # what makes a directory a PEFT adapter (peft's own name)
MERGED_DIR = "merged"  # `raytrain serve` of an adapter directory: its merge, made once beside it


def merged_dir(adapter_uri: str, log) -> str:
    """`raytrain serve` of a PEFT adapter directory: the adapter merged into its base, as a model directory written
    once into <adapter>/merged/ (reused while it is newer than the adapter)."""
    import os
    import shutil
    import tempfile

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from raytrain import storage

    out = storage.join(adapter_uri, MERGED_DIR)
    if storage.exists(storage.join(out, "config.json")):
        return out
    with tempfile.TemporaryDirectory(prefix="raytrain-merge-") as d:
        src = os.path.join(d, "adapter")
        storage.download_dir(adapter_uri, src)
        with open(os.path.join(src, ADAPTER_CONFIG)) as f:
            import json

            base_ref = json.load(f).get("base_model_name_or_path") or BASE_DIR
        base_path = base_ref if os.path.isabs(base_ref) else os.path.join(src, base_ref)
        if not os.path.isdir(base_path):
            raise UserError(f"{adapter_uri}: the adapter's base {base_ref!r} is not a local model directory; export "
                            "the checkpoint without --adapter, or put the base there")
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), src).merge_and_unload()
        dst = os.path.join(d, MERGED_DIR)
        model.save_pretrained(dst)
        for f in os.listdir(src):  # tokenizer, generation config, export metadata
            if os.path.isfile(os.path.join(src, f)) and not f.startswith("adapter_") and f != "config.json":
                shutil.copy(os.path.join(src, f), dst)
        for f in ("config.json", "generation_config.json"):
            if os.path.exists(os.path.join(base_path, f)):
                shutil.copy(os.path.join(base_path, f), dst)
        storage.upload_dir(dst, out)
    log(f"[raytrain] merged the LoRA adapter {adapter_uri} into its base for serving: {out}")
    return out


def check_targets(model_cfg, vocab: int) -> None:
    """Driver side, before any worker starts: model.lora.target_modules must name modules of the model (built on
    the meta device: no weights, no memory). A remote model.init_from is checked on the workers instead."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM

    from raytrain import storage
    from raytrain.model import hf_config

    if not enabled(model_cfg) or not model_cfg.lora.target_modules:
        return
    if model_cfg.init_from:
        if storage.is_remote(model_cfg.init_from) or not os.path.isdir(model_cfg.init_from):
            return
        conf = AutoConfig.from_pretrained(model_cfg.init_from)
    else:
        conf = hf_config(model_cfg, vocab)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
    _check_names(model, model_cfg)


def _check_names(model: torch.nn.Module, model_cfg) -> None:
    names = [n for n, _ in model.named_modules()]
    missing = [t for t in model_cfg.lora.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"})
        raise UserError(f"model.lora.target_modules {missing} match no module of the {model_cfg.family} model; "
                        f"its linear layers are named {', '.join(leaves)}")
