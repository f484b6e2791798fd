"""Our config -> DeepSpeed's JSON config and the LR schedule: one source of truth for batch, clipping, precision."""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

from raytrain.config import Config


def resolve_dtype(cfg: Config, cuda: bool, bf16_supported: bool) -> str:
    d = cfg.precision.dtype
    if d != "auto":
        return d
    if not cuda:
        return "fp32"  # CPU mixed precision is slower than fp32 for these kernels
    return "bf16" if bf16_supported else "fp16"


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_ds_config(cfg: Config, world_size: int, dtype: str, cuda: bool) -> dict[str, Any]:
    o, ds = cfg.optim, cfg.deepspeed
    mb, acc = cfg.batch.micro_batch_size, cfg.accumulation
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    for kind in ("optimizer", "param"):
        device = getattr(ds, f"offload_{kind}")
        if device != "none":
            zero[f"offload_{kind}"] = {"device": device, "pin_memory": cuda,
                                      **({"nvme_path": ds.nvme_path} if device == "nvme" else {})}
    if ds.zero_stage == 3:
        # Lets export consolidate full weights from shards without a separate conversion step.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    conf: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": acc,
        "train_batch_size": mb * acc * world_size,
        "gradient_clipping": o.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay},
        },
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,  # we log ourselves
        "wall_clock_breakdown": False,
    }
    conf["optimizer"]["params"].update(optimizer_impl(cfg, cuda))
    if ds.offload_optimizer == "cpu" and not cuda:
        conf["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW on offloaded state: see optimizer_impl
    if ds.tensor_parallel_size > 1:
        # AutoTP training (applied inside deepspeed.initialize). DeepSpeed checks train_batch_size against the
        # whole world in one place and against the data-parallel size in another (ZeRO-3), so it is left for
        # DeepSpeed to derive. The output head stays whole: our loss takes full-vocabulary logits.
        del conf["train_batch_size"]
        conf["tensor_parallel"] = {"autotp_size": ds.tensor_parallel_size, "vocab_parallel_lm_head": False}
    if dtype == "bf16":
        conf["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        conf["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": cfg.precision.initial_scale_power,
                        "loss_scale_window": cfg.precision.loss_scale_window}
    return _merge(conf, ds.extra)


def optimizer_impl(cfg: Config, cuda: bool) -> dict[str, Any]:
    """Which AdamW kernel DeepSpeed builds, as optimizer params: {} means DeepSpeed's own choice."""
    if cfg.deepspeed.offload_optimizer == "nvme":
        return {}  # DeepSpeed's optimizer swapper works with its own CPU Adam only
    if not cuda:
        # On CPU DeepSpeed's Adam variants, its CPU Adam for offloaded state too, need JIT builds (CPU Adam: ~70 s
        # of gcc on a 2-core machine at first use) and give nothing: every tensor is on the CPU already, and
        # torch's AdamW steps it there, fused (one pass over the state, built into torch) unless optim.fused=none.
        return {"torch_adam": True, "fused": cfg.optim.fused != "none"}
    if cfg.deepspeed.offload_optimizer != "none":
        return {}  # DeepSpeed's CPU Adam (SIMD, threaded) runs the offloaded step off the GPU
    if cfg.optim.fused == "torch":
        # One kernel launch for all parameters, built into torch (no JIT build, unlike DeepSpeed's FusedAdam).
        return {"torch_adam": True, "fused": True}
    if cfg.optim.fused == "none":
        return {"torch_adam": True, "foreach": True}
    return {}  # "deepspeed": FusedAdam, a CUDA op DeepSpeed JIT-builds on first use


def lr_lambda(cfg: Config) -> Callable[[int], float]:
    """Multiplier of optim.lr after `step` optimizer steps: linear warmup, then decay to min_lr_ratio."""
    o, total = cfg.optim, cfg.run.max_steps
    warm = o.warmup_steps

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if o.decay == "constant" or total <= warm:
            return 1.0
        frac = min(1.0, (step - warm) / max(1, total - warm))
        shape = 0.5 * (1 + math.cos(math.pi * frac)) if o.decay == "cosine" else 1.0 - frac
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * shape

    return f
