"""raytrain's step path without Ray: the model, engine, kernels and loss the training worker builds
(raytrain.worker.engine.make_engine, raytrain.worker.loss.StepLoss), driven over given rows on one rank.

For the numerics test against commit 3653663 (tests/test_step_path.py) and the GPU check (scripts/gpu_check.py),
where Ray is not installed. Works from 3653663's tree too (`make_engine` absent there: its own build).
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np


def counting_rows(n: int, width: int, vocab: int, seed: int = 0) -> np.ndarray:
    """Rows of consecutive token ids from random starts (mod vocab): learnable, so the loss falls fast."""
    starts = np.random.default_rng(seed).integers(0, vocab, n)
    return ((starts[:, None] + np.arange(width)[None, :]) % vocab).astype(np.int64)


def init_single_rank(backend: str) -> None:
    """A one-rank process group (gloo on CPU, nccl on GPU), as Ray Train would have set up."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"})
    dist.init_process_group(backend, rank=0, world_size=1)


def run(cfg, rows: np.ndarray, *, vocab: int, cuda: bool, steps: int, warmup: int = 0, sync_every_step: bool = True) -> dict:
    """Train `steps` optimizer steps over rows (micro_batch x accumulation rows per step, in order) the way the
    worker does; {"losses", "tokens_per_s" (after warmup steps), "kernels", "step_s"}."""
    import torch

    from raytrain.ds_config import build_ds_config
    from raytrain.model import build_model
    from raytrain.quiet import quiet_deepspeed
    from raytrain.worker.loss import StepLoss

    quiet_deepspeed()
    init_single_rank("nccl" if cuda else "gloo")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = "bf16" if cuda else "fp32"
    ds_config = build_ds_config(cfg, 1, dtype, cuda)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, vocab, cfg.run.seed, ds_config=ds_config)
    try:
        from raytrain.worker.engine import make_engine
    except ImportError:  # commit 3653663: its worker's build, inline
        make_engine = _engine_3653663
    engine, kernels = make_engine(model, cfg, ds_config=ds_config, cuda=cuda)
    mb, acc, seq = cfg.batch.micro_batch_size, cfg.accumulation, cfg.model.seq_len
    loss_fn = StepLoss(cfg.data, window=seq + 1, accumulation=acc, world=1, dp_size=1, device=device)
    losses, t0 = [], None
    per_step = mb * acc
    for step in range(steps):
        if step == warmup:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        take = rows[(step * per_step) % len(rows):][:per_step]
        loss_fn.begin(take)
        total = torch.zeros((), device=device)
        for a in range(acc):
            x = torch.from_numpy(np.ascontiguousarray(take[a * mb:(a + 1) * mb], dtype=np.int32))
            # as the worker does it: pinned memory, a non-blocking copy of the int32 ids, widened on the device
            x = (x.pin_memory().to(device, non_blocking=True) if cuda else x).long()
            loss = loss_fn(engine, x)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        losses.append(total / acc if not sync_every_step else float(total) / acc)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0 if t0 is not None else float("nan")
    timed = steps - warmup
    return {"losses": [float(x) for x in losses], "kernels": kernels, "step_s": elapsed / max(timed, 1),
            "tokens_per_s": timed * per_step * seq / elapsed if timed > 0 else None}


def _engine_3653663(model, cfg, *, ds_config: dict, cuda: bool):
    import deepspeed
    import torch

    from raytrain.ds_config import lr_lambda
    from raytrain.model import compile_engine, param_groups

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, cfg.optim.weight_decay), config=ds_config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)), dist_init_required=False)
    compile_engine(engine, cfg.model)
    return engine, {"compiled": str(cfg.model.compile), "loss": "full", "optimizer": "3653663"}
