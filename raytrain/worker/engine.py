"""The DeepSpeed engine of a built model, with the step path's kernels chosen by the config: the chunked loss,
the fused AdamW, compilation. Used by the training worker and, without Ray, by the GPU check."""

from __future__ import annotations

import torch

from raytrain.config import Config
from raytrain.ds_config import lr_lambda
from raytrain.internals.deepspeed import set_muon_aside
from raytrain.model import compile_engine, param_groups
from raytrain.quiet import no_stdout
from raytrain.worker.linear_ce import use_chunked_loss


def make_engine(model: torch.nn.Module, cfg: Config, *, ds_config: dict, cuda: bool) -> tuple[object, dict]:
    """(engine, kernels): kernels says what the step runs ({"compiled", "loss", "optimizer"}), for the banner and
    summary.json. The process group must exist (Ray Train's, or the caller's)."""
    import deepspeed

    if cfg.chunked_loss:
        use_chunked_loss(model)  # no [tokens, vocab] fp32 logits (worker/linear_ce.py)
    set_muon_aside(ds_config)  # DeepSpeed's Muon modules compile kernels at import (raytrain/internals/deepspeed.py)
    with no_stdout():
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, cfg.optim.weight_decay), config=ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)),
            dist_init_required=False)
    compiled = compile_engine(engine, cfg.model, cuda=cuda, zero_stage=cfg.deepspeed.zero_stage)
    return engine, {"compiled": compiled or "no", "loss": "chunked" if cfg.chunked_loss else "full",
                    "optimizer": optimizer_kind(engine)}


def optimizer_kind(engine) -> str:
    """What steps the weights: the torch or DeepSpeed optimizer class inside DeepSpeed's wrappers, and whether
    it runs fused (one kernel over all parameters) or multi-tensor (foreach)."""
    opt = engine.optimizer
    for _ in range(4):  # ZeRO / bf16 wrappers hold the real optimizer as .optimizer
        if isinstance(opt, torch.optim.Optimizer) and type(opt).__module__.startswith("torch."):
            break
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            break
        opt = inner
    name = type(opt).__name__
    defaults = getattr(opt, "defaults", {})
    if defaults.get("fused"):
        return f"{name} (fused)"
    if defaults.get("foreach"):
        return f"{name} (foreach)"
    return name
