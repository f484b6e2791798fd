"""Hand-written training loops the benchmark compares raytrain against: what a person would write without it.

Same model (raytrain.model.build_model), same micro-batch, same optimizer settings, same thread count;
no Ray, no DeepSpeed (CPU), data read once into memory up front so the baseline pays nothing for it.
Each loop runs in fresh processes (torch.multiprocessing, spawn) so thread settings and imports
start clean, and writes its per-window tokens/s to a JSON file.

Frozen as of commit 3653663 (but `kernels=True`): the loops do not inherit raytrain's later step-path work (its
chunked loss, fused CPU AdamW, compilation by default); `kernels=True` is DeepSpeed with that step path, the
baseline of the loop's own overhead. Their DeepSpeed config is 3653663's (`frozen_ds_config`), the loss is full
logits then cross entropy, and they compile only with model.compile=true, the whole model as 3653663 did.
"""

from __future__ import annotations

import json
import os
import socket
import time

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def frozen_ds_config(cfg, world: int, dtype: str, cuda: bool) -> dict:
    """The DeepSpeed config raytrain built at commit 3653663 for these loops (no offload, no tensor parallelism):
    torch's AdamW, fused on GPU, plain on CPU."""
    o = cfg.optim
    conf = {
        "train_micro_batch_size_per_gpu": cfg.batch.micro_batch_size,
        "gradient_accumulation_steps": cfg.accumulation,
        "train_batch_size": cfg.batch.micro_batch_size * cfg.accumulation * world,
        "gradient_clipping": o.grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                                                  "weight_decay": o.weight_decay, "torch_adam": True,
                                                  **({"fused": True} if cuda else {})}},
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        conf["bf16"] = {"enabled": True}
    return conf


def _rows(split_dict: dict) -> np.ndarray:
    from raytrain.data.manifest import Split
    from raytrain.data.reader import read_rows

    split = Split.from_dict(split_dict)
    return read_rows(split, 0, split.num_samples)


def _worker(rank: int, world: int, port: int, cfg_dict: dict, split_dict: dict, out: str, use_deepspeed: bool,
            kernels: bool = False) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from raytrain.config import Config
    from raytrain.ds_config import lr_lambda
    from raytrain.model import build_model, param_groups

    cfg = Config.model_validate(cfg_dict)
    torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_worker)))
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world)})  # DeepSpeed reads them
    if world > 1 or use_deepspeed or kernels:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if kernels:
        return _kernels_loop(rank, world, cfg, split_dict, out)
    rows = _rows(split_dict)
    vocab = cfg.model.vocab_size or split_dict["vocab_size"]
    model = build_model(cfg.model, vocab, cfg.run.seed, split_dict.get("eot_id"))
    o = cfg.optim
    engine = None
    if use_deepspeed:
        # raytrain's own DeepSpeed config, without Ray, Ray Data or raytrain's loop: splits the overhead
        # into what DeepSpeed costs and what the rest costs.
        from raytrain.quiet import quiet_deepspeed

        quiet_deepspeed()  # imported as a training worker does (no shm op built)
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, o.weight_decay),
            config=frozen_ds_config(cfg, world, "fp32", False), dist_init_required=False,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)))
        if cfg.model.compile is True:
            engine.compile()  # the whole model, as 3653663's loop did it
    else:
        opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        model.train()
        if cfg.model.compile is True:
            model.compile()
    mb, seq = cfg.batch.micro_batch_size, cfg.model.seq_len
    gb = mb * world
    windows, losses, pos, t = [], [], 0, time.perf_counter()
    for step in range(1, cfg.run.max_steps + 1):
        if pos + gb > len(rows):
            pos = 0
        x = torch.from_numpy(np.ascontiguousarray(rows[pos + rank * mb:pos + (rank + 1) * mb]))
        pos += gb
        logits = (engine or model)(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # a loop that logs its loss syncs here too
        t = _window(windows, t, step, cfg.run.log_every, gb * seq)
    _finish(rank, out, windows, losses)


def _kernels_loop(rank: int, world: int, cfg, split_dict: dict, out: str) -> None:
    """DeepSpeed with raytrain's own step path (raytrain.worker.engine.make_engine: its DeepSpeed config, fused
    AdamW, compilation as configured; raytrain.worker.loss.StepLoss: the chunked loss), no Ray and no raytrain loop:
    the baseline that isolates what the loop, Ray Train and the data plane cost (the kernels' own gain is the
    frozen column's)."""
    import torch
    import torch.distributed as dist

    from raytrain.ds_config import build_ds_config
    from raytrain.model import build_model
    from raytrain.quiet import quiet_deepspeed
    from raytrain.worker.engine import make_engine
    from raytrain.worker.loss import StepLoss

    quiet_deepspeed()
    rows = _rows(split_dict)
    vocab = cfg.model.vocab_size or split_dict["vocab_size"]
    ds_config = build_ds_config(cfg, world, "fp32", False)
    model = build_model(cfg.model, vocab, cfg.run.seed, split_dict.get("eot_id"), ds_config=ds_config)
    engine, _ = make_engine(model, cfg, ds_config=ds_config, cuda=False)
    mb, acc, seq = cfg.batch.micro_batch_size, cfg.accumulation, cfg.model.seq_len
    loss_fn = StepLoss(cfg.data, window=seq + 1, accumulation=acc, world=world, dp_size=world,
                       device=torch.device("cpu"))
    gb = mb * acc * world
    windows, losses, pos, t = [], [], 0, time.perf_counter()
    for step in range(1, cfg.run.max_steps + 1):
        if pos + gb > len(rows):
            pos = 0
        take = rows[pos + rank * mb * acc:pos + (rank + 1) * mb * acc]
        pos += gb
        loss_fn.begin(take)
        total = torch.zeros(())
        for a in range(acc):
            x = torch.from_numpy(np.ascontiguousarray(take[a * mb:(a + 1) * mb], dtype=np.int32)).long()
            loss = loss_fn(engine, x)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        losses.append(float(total) / acc)  # a loop that logs its loss reads it here
        t = _window(windows, t, step, cfg.run.log_every, gb * seq)
    _finish(rank, out, windows, losses)


def _window(windows: list[float], t: float, step: int, every: int, tokens_per_step: int) -> float:
    """At a log step: the window's tokens/s appended; returns the next window's start."""
    if step % every:
        return t
    now = time.perf_counter()
    windows.append(every * tokens_per_step / (now - t))
    return now


def _finish(rank: int, out: str, windows: list[float], losses: list[float]) -> None:
    import torch.distributed as dist

    if rank == 0:
        with open(out, "w") as f:
            json.dump({"tokens_per_s_windows": windows, "losses": losses}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def plain_loop(cfg, split_dict: dict, out: str, use_deepspeed: bool = False, kernels: bool = False) -> list[float]:
    """Tokens/s per log window of a plain PyTorch loop (one process) or DDP over gloo (num_workers processes);
    with use_deepspeed, the same loop driving 3653663's DeepSpeed engine config instead of AdamW / DDP; with
    kernels, DeepSpeed with raytrain's own step path (_kernels_loop)."""
    return plain_run(cfg, split_dict, out, use_deepspeed, kernels)["tokens_per_s_windows"]


def plain_run(cfg, split_dict: dict, out: str, use_deepspeed: bool = False, kernels: bool = False) -> dict:
    """plain_loop's whole record: {"tokens_per_s_windows": [...], "losses": [rank 0's loss per step]}."""
    import torch.multiprocessing as mp

    world = cfg.scaling.num_workers
    mp.start_processes(_worker, args=(world, _free_port(), cfg.to_dict(), split_dict, out, use_deepspeed, kernels),
                       nprocs=world, start_method="spawn", join=True)
    with open(out) as f:
        return json.load(f)


def deepspeed_gpu_loop(cfg, vocab: int, steps: int, warmup: int) -> float:
    """Plain PyTorch + DeepSpeed on one GPU, random tokens already on the device: tokens/s after warm-up.

    The same DeepSpeed config raytrain builds (bf16, fused Adam, ZeRO stage of the config) without Ray,
    Ray Data or raytrain's loop: the ceiling raytrain's GPU figure is judged against.
    """
    from raytrain.quiet import quiet_deepspeed

    quiet_deepspeed()  # imported as a training worker does
    import deepspeed
    import torch
    import torch.nn.functional as F

    from raytrain.model import build_model, param_groups

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed("nccl")
    model = build_model(cfg.model, vocab, cfg.run.seed)
    ds = frozen_ds_config(cfg, 1, "bf16", True)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, cfg.optim.weight_decay),
                                           config=ds, dist_init_required=False)
    mb, seq = cfg.batch.micro_batch_size, cfg.model.seq_len
    x = torch.randint(0, vocab, (mb, seq + 1), device=engine.device)
    t = None
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            t = time.perf_counter()
        logits = engine(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
    torch.cuda.synchronize()
    tps = steps * mb * seq / (time.perf_counter() - t)
    engine.destroy()
    return tps
