"""Per-worker accelerator memory estimate of a training config: model states (ZeRO-sharded) + activations.

Used by the micro-batch sweep to mark a trial infeasible before it starts (`microbatch.memory_cap_mb`).
It is an estimate, deliberately on the high side: model states as in the ZeRO paper (Rajbhandari et al.
2020, 2+2+12 bytes per parameter in mixed precision, 4+4+8 in fp32), activations as in Korthikanti et
al. 2022 (s*b*h*(34 + 5*a*s/h) bytes per layer at 16 bits, 2*s*b*h with activation checkpointing)
plus the logits and their gradient (with the chunked loss: one chunk's).
"""

from __future__ import annotations

from typing import Optional

from raytrain.config import Config


def param_count(cfg: Config, vocab_size: int) -> int:
    """Parameters of the configured model, counted on the meta device (nothing allocated)."""
    import torch

    from raytrain.model import build_model, param_count as count

    with torch.device("meta"):
        model = build_model(cfg.model, vocab_size, seed=0)
    return count(model)


def estimate_mb(cfg: Config, vocab_size: int, n_params: Optional[int] = None) -> dict:
    """{"total_mb", "model_states_mb", "activations_mb"} per worker for one micro-batch."""
    n = n_params if n_params is not None else param_count(cfg, vocab_size)
    m, s, w = cfg.model, cfg.model.seq_len, cfg.scaling.min_workers  # an elastic run's states are largest when smallest
    half = cfg.precision.dtype in ("bf16", "fp16") or (cfg.precision.dtype == "auto" and cfg.scaling.use_gpu)
    weights, grads, optim = (2, 2, 12) if half else (4, 4, 8)
    stage = cfg.deepspeed.zero_stage
    if cfg.deepspeed.offload_optimizer != "none":
        optim = 0
    per_param = (weights / (w if stage >= 3 and cfg.deepspeed.offload_param == "none" else 1)
                 * (0 if cfg.deepspeed.offload_param != "none" else 1)
                 + grads / (w if stage >= 2 else 1)
                 + optim / (w if stage >= 1 else 1))
    b, h, a = cfg.batch.micro_batch_size, m.hidden_size, m.n_head
    act_scale = 1.0 if half else 2.0  # the formula counts 16-bit activations
    per_layer = 2 * s * b * h if m.activation_checkpointing else s * b * h * (34 + 5 * a * s / h)
    if cfg.chunked_loss:
        from raytrain.worker.linear_ce import chunked_head_bytes

        logits = chunked_head_bytes(b * s, h, vocab_size)
    else:
        logits = b * s * vocab_size * (2 if half else 4) * 2 + b * s * vocab_size * 4  # logits + grad, fp32 loss
    activations = per_layer * m.n_layer * act_scale + logits
    states = n * per_param
    mb = 2.0 ** 20
    return {"total_mb": (states + activations) / mb, "model_states_mb": states / mb,
            "activations_mb": activations / mb, "params": n}
