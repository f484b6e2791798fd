"""batch.micro_batch_size=auto: the largest micro-batch whose estimated memory fits a worker, the global batch held.

Chosen once on the driver before the workers start, so every rank, the checkpoints and config.yaml carry one
concrete size: the largest divisor of the global batch's share per data-parallel worker whose estimate
(sweep/memory_estimate.py, deliberately on the high side) fits `batch.memory_cap_mb`, else 90 % of a GPU
worker's memory (asked of a GPU node through Ray), else on CPU the host's memory over the workers.
Accumulation follows: global batch = micro-batch x accumulation x data-parallel workers.
"""

from __future__ import annotations

import os
from typing import Callable

from raytrain.config import Config
from raytrain.errors import UserError

GPU_SHARE = 0.9  # of a GPU's memory for model states and activations: the rest for CUDA, NCCL, fragmentation


def resolve(cfg: Config, *, vocab: int, memory_mb: float, log: Callable[[str], None] = print) -> Config:
    """cfg with a concrete micro-batch (and accumulation) if it asked for auto; else cfg."""
    from raytrain.sweep.memory_estimate import estimate_mb, param_count

    if cfg.batch.micro_batch_size != "auto":
        return cfg
    # An elastic run: sized at its smallest usable size, whose ranks hold the largest share of batch and states;
    # each size then takes the largest micro-batch up to this one that divides its share (Config.sizes).
    smallest = min(cfg.sizes())
    share = cfg.batch.global_batch_size // (smallest // cfg.deepspeed.tensor_parallel_size)
    n_params = param_count(cfg, vocab)

    def with_mb(mb: int, at: int = smallest) -> Config:
        batch = cfg.batch.model_copy(update={"micro_batch_size": mb, "gradient_accumulation_steps": None})
        return cfg.model_copy(update={"batch": batch, "scaling": cfg.scaling.model_copy(update={"num_workers": at})})

    for mb in sorted((d for d in range(1, share + 1) if share % d == 0), reverse=True):
        need = estimate_mb(with_mb(mb), vocab, n_params)["total_mb"]
        if need <= memory_mb:
            out = Config.model_validate(with_mb(mb, cfg.scaling.num_workers).to_dict())
            log(f"[raytrain] batch.micro_batch_size=auto: {mb} (estimated {need / 1024:.2f} GiB of "
                f"{memory_mb / 1024:.2f} GiB a worker may use), gradient accumulation {out.accumulation}, global batch "
                f"{out.global_batch}")
            return out
    need = estimate_mb(with_mb(1), vocab, n_params)["total_mb"]
    raise UserError(f"batch.micro_batch_size=auto: even a micro-batch of 1 needs about {need / 1024:.2f} GiB by "
                    f"raytrain's estimate, more than the {memory_mb / 1024:.2f} GiB a worker may use; raise "
                    f"batch.memory_cap_mb, or shard more (deepspeed.zero_stage=3, model.activation_checkpointing=true)")


def worker_memory_mb(cfg: Config) -> float:
    """What a worker may use: batch.memory_cap_mb, else 90 % of a GPU worker's memory (Ray must be connected), else
    the host's memory over the workers."""
    if cfg.batch.memory_cap_mb is not None:
        return cfg.batch.memory_cap_mb
    if cfg.scaling.use_gpu:
        import ray

        total = ray.get(ray.remote(num_gpus=1, num_cpus=0)(_gpu_memory_bytes).remote(), timeout=600)
        return GPU_SHARE * total / 2**20
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / 2**20 / max(1, cfg.scaling.max_workers)


def _gpu_memory_bytes() -> int:
    import torch

    return torch.cuda.get_device_properties(0).total_memory
