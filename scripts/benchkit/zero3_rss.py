"""Bench part `memory`: each worker's peak host RSS for a ZeRO-3 model at 1, 2 and 4 workers (states shrink as 1/N)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Callable, Optional

# A ~322M-parameter Llama (20 x 1024, untied 32K embeddings) at micro-batch 1 and 32 tokens, so model states, not
# activations, dominate. DeepSpeed's bucket and live-parameter buffers are fixed sizes (5e8 / 1e9 elements by
# default) that at real model sizes are small next to the states but here would cover the whole model: set small.
MODEL = {
    "model": {"family": "llama", "n_layer": 20, "hidden_size": 1024, "n_head": 16, "intermediate_size": 2816,
              "vocab_size": 32000, "seq_len": 32, "tie_embeddings": False},
    "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": 1},
    "precision": {"dtype": "fp32"},
    "deepspeed": {"zero_stage": 3, "extra": {"zero_optimization": {
        "reduce_bucket_size": 1e6, "stage3_prefetch_bucket_size": 1e6, "stage3_max_live_parameters": 1e6,
        "stage3_param_persistence_threshold": 1e4, "allgather_bucket_size": 1e6}}},
}

# One worker process: the training loop's own calls (raytrain.ds_config, raytrain.model.build_model,
# deepspeed.initialize with the loop's parameter groups) and one optimizer step. Peak RSS is counted from right
# after the imports and the process group (VmHWM reset there); MALLOC_MMAP_THRESHOLD_ makes glibc hand freed
# tensor memory back, so RSS follows live tensors. It also runs against an older raytrain (PYTHONPATH) whose
# build_model takes no DeepSpeed config: the before/after comparison in docs/BENCHMARKS.md.
WORKER = r"""
import gc, inspect, json, os, sys
import psutil, torch
from raytrain.quiet import quiet_deepspeed
quiet_deepspeed()  # as a training worker imports it: no shm op built
import deepspeed
import torch.distributed as dist
from raytrain.config import load_config
from raytrain.ds_config import build_ds_config
from raytrain.model import build_model, param_count
from raytrain.worker.evaluate import lm_loss
from raytrain.model import param_groups
over = json.loads(sys.argv[1])
torch.set_num_threads(1)
dist.init_process_group("gloo")
deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
rank, world = dist.get_rank(), dist.get_world_size()
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := current RSS (Linux >= 4.0)
base = psutil.Process().memory_info().rss
cfg = load_config("tiny", over)
ds = build_ds_config(cfg, world, "fp32", cuda=False)
kw = {"ds_config": ds} if "ds_config" in inspect.signature(build_model).parameters else {}
model = build_model(cfg.model, cfg.model.vocab_size, 0, **kw)
after_build = psutil.Process().memory_info().rss
n = param_count(model)
engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.1), config=ds,
                                  dist_init_required=False)
torch.manual_seed(rank)
x = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_len + 1))
loss = lm_loss(engine, x); engine.backward(loss); engine.step()
with open("/proc/self/status") as f:
    peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
print("RESULT " + json.dumps({"rank": rank, "world": world, "after_imports": base, "peak": peak,
                              "build": max(0, after_build - base), "params": n, "loss": loss.item(),
                              "zero_init": bool(kw)}), flush=True)
dist.barrier()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(n: int, overrides: dict, pythonpath: str, timeout_s: float = 1800) -> list[dict]:
    """n worker processes in one gloo group on 127.0.0.1; each one's RESULT record."""
    import tempfile

    port = _free_port()
    procs, logs = [], []
    for r in range(n):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
               "WORLD_SIZE": str(n), "LOCAL_RANK": str(r), "MALLOC_MMAP_THRESHOLD_": "65536",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
        # cwd: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH.
        # Output to files, not pipes: a worker blocked on a full pipe would stall the others in a collective.
        logs.append(tempfile.TemporaryFile(mode="w+"))
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(overrides)], env=env, cwd=pythonpath,
                                      stdout=logs[-1], stderr=subprocess.STDOUT, text=True))
    out = []
    deadline = time.monotonic() + timeout_s
    try:
        for p, log in zip(procs, logs):
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
            log.seek(0)
            text = log.read()
            line = [x for x in text.splitlines() if x.startswith("RESULT ")]
            if p.returncode != 0 or not line:
                raise RuntimeError(f"memory worker exited {p.returncode}: {text.strip().splitlines()[-1:]}")
            out.append(json.loads(line[0].split(" ", 1)[1]))
    finally:
        for p, log in zip(procs, logs):
            if p.poll() is None:
                p.kill()
            log.close()
    return sorted(out, key=lambda r: r["rank"])


def memory(log: Callable = print, workers: tuple[int, ...] = (1, 2, 4), pythonpath: Optional[str] = None) -> list[dict]:
    """Peak host RSS above the after-import RSS, per worker, at 1, 2 and 4 workers; ratios against 1 worker, and
    the decomposition peak(N) = fixed + states / N fitted to the three points."""
    from benchkit.parts import figure, measured

    root = pythonpath or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    peaks, detail = {}, {}
    for n in workers:
        t = time.perf_counter()
        recs = run_workers(n, MODEL, root)
        peaks[n] = max(r["peak"] - r["after_imports"] for r in recs)
        detail[n] = recs
        above = ", ".join(f"{(r['peak'] - r['after_imports']) / 2**20:,.0f}" for r in recs)
        build = ", ".join(f"{r['build'] / 2**20:,.0f}" for r in recs)
        log(f"  {n} worker(s): peak RSS above imports {above} MiB (model build {build} MiB; "
            f"{recs[0]['params'] / 1e6:.0f}M params, zero.Init {recs[0]['zero_init']}) in {time.perf_counter() - t:.0f}s")
    # Least squares of peak = a + b / N over the measured N: a = fixed (runtime, DeepSpeed's small buffers),
    # b = what is divided among the workers (model states).
    xs, ys = [1 / n for n in workers], [peaks[n] for n in workers]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    params = detail[workers[0]][0]["params"]
    log(f"  decomposition: peak(N) = {a / 2**20:,.0f} MiB + {b / 2**20:,.0f} MiB / N "
        f"({b / params:.1f} bytes/param divided among workers; fp32 ZeRO-3 holds 20: weights, master copy, "
        f"gradients, Adam m and v)")
    one = peaks[workers[0]]
    figs = []
    for n, target in ((2, 0.6), (4, 0.33)):
        if n in peaks:
            figs.append(figure("6 memory", f"peak host RSS per worker, {n} workers, ZeRO-3 {params / 1e6:.0f}M",
                               peaks[n] / 2**20, "MiB", "1 worker", measured(one / 2**20), target=f"<= {target}x 1 worker",
                               met=peaks[n] <= target * one, workers=detail[n]))
    builds = {n: max(r["build"] for r in detail[n]) for n in workers}
    for n in workers[1:]:
        figs.append(figure("6 memory", f"RSS growth while the model is built, per worker, {n} workers", builds[n] / 2**20,
                           "MiB", "1 worker", measured(builds[workers[0]] / 2**20), zero_init=detail[n][0]["zero_init"]))
    figs.append(figure("6 memory", "fixed per worker (fit: peak = fixed + states / N)", a / 2**20, "MiB",
                       "states divided among N (same fit)", measured(b / 2**20), bytes_per_param=b / params, params=params,
                       peaks_mib={n: p / 2**20 for n, p in peaks.items()}))
    return figs


# The measure (issue 27): whole `train()` runs of a ~57M Llama, the largest RayTrainWorker process's RSS
# sampled every 0.2 s from start-up to the final checkpoint, minus the same run with 1 layer (snapshots: whole_run).
WHOLE_RUN = ["model.family=llama", "model.hidden_size=768", "model.n_head=12", "model.seq_len=32",
             "batch.micro_batch_size=1", "deepspeed.zero_stage=3",
             "deepspeed.extra={zero_optimization: {reduce_bucket_size: 1000000, stage3_prefetch_bucket_size: 1000000, "
             "stage3_max_live_parameters: 1000000, allgather_bucket_size: 1000000}}"]


def _sample_workers(stop, peak: dict) -> None:
    import psutil

    while not stop.is_set():
        for p in psutil.process_iter(["cmdline"]):
            try:
                if "RayTrainWorker" in " ".join(p.info["cmdline"] or []):
                    peak[p.pid] = max(peak.get(p.pid, 0), p.memory_info().rss)
            except psutil.Error:
                pass
        time.sleep(0.2)


def whole_run(tmp: str, log: Callable = print, workers: tuple[int, ...] = (1, 2, 4), *,
              snapshots: bool = False) -> list[dict]:
    """Peak RSS of the largest training worker through whole ZeRO-3 runs (8 layers minus 1 layer) at 1 / 2 / 4
    workers, host-memory snapshots off or on, with the environment this bench runs in (a MALLOC_MMAP_THRESHOLD_
    set there replaces the workers' own heap settings)."""
    import threading

    import ray

    from benchkit.parts import figure, measured, prepare_data, train_cfg
    from raytrain.trainer import train

    data = prepare_data(os.path.join(tmp, "rss-data"), 300_000, seq_len=32)
    if not ray.is_initialized():
        from raytrain.ray_auth import ensure_token

        ensure_token()
        ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    peaks = {}
    for layers in (8, 1):
        for n in workers:
            cfg = train_cfg(data, f"{tmp}/rss-runs", f"rss-l{layers}-n{n}-s{int(snapshots)}", n, 3, 1,
                            f"model.n_layer={layers}", *WHOLE_RUN, f"checkpoint.memory={str(snapshots).lower()}")
            stop, peak = threading.Event(), {}
            sampler = threading.Thread(target=_sample_workers, args=(stop, peak), daemon=True)
            sampler.start()
            try:
                train(cfg, log=lambda *_: None)
            finally:
                stop.set()
                sampler.join()
            peaks[(layers, n)] = max(peak.values())
            log(f"  {layers} layer(s), {n} worker(s): largest worker's peak RSS {peaks[(layers, n)] / 2**20:,.0f} MiB")
    above = {n: peaks[(8, n)] - peaks[(1, n)] for n in workers}
    env = os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default")
    what = f"snapshots {'on' if snapshots else 'off'}, MALLOC_MMAP_THRESHOLD_={env}"
    log("  above the 1-layer run: " + ", ".join(f"{n} worker(s) {above[n] / 2**20:,.0f} MiB "
                                               f"({above[n] / above[workers[0]]:.2f}x)" for n in workers)
        + f"; {what}")
    part = "8c memory" if snapshots else "8b memory"
    return [figure(part, f"whole-run peak RSS of the largest worker above a 1-layer run, {n} workers, "
                   f"ZeRO-3 57M ({what})", above[n] / 2**20, "MiB", "1 worker",
                   measured(above[workers[0]] / 2**20), target=f"<= {t}x 1 worker", met=above[n] <= t * above[workers[0]])
            for n, t in ((2, 0.6), (4, 0.33)) if n in above]
