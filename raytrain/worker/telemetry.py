"""What the training loop calls at its log steps: phase timers, MFU, memory, the Prometheus exporter, the health rules.
Records reach TensorBoard, Prometheus and the other sinks through worker/records.py.
The loop stays "take a batch, step the engine"; everything observed is here (the rollback is raytrain/worker/rollback.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import Optional

import torch

from raytrain.config import Config
from raytrain.errors import UserError
from raytrain.rundir import HEALTH, RunDir
from raytrain.worker.health import HealthMonitor, Thresholds
from raytrain.worker.metrics import PHASES, RayMetrics

# Dense bf16/fp16 tensor-core peak TFLOP/s per device (vendor datasheets, SXM parts where there are two).
# Matched by substring of torch.cuda.get_device_name(), first match wins; metrics.peak_tflops overrides.
PEAK_TFLOPS = (
    ("H200", 989.0), ("H100", 989.0), ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0),
    ("L40S", 362.0), ("L40", 181.0), ("A6000", 155.0), ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0),
    ("V100", 125.0), ("T4", 65.0), ("MI300X", 1307.0), ("MI250", 362.0),
)


def peak_tflops(cfg: Config, device_name: Optional[str]) -> float:
    """Peak TFLOP/s of one worker: the override, the GPU table, or on CPU the measured matmul rate."""
    if cfg.metrics.peak_tflops:
        return cfg.metrics.peak_tflops
    if device_name:
        for key, value in PEAK_TFLOPS:
            if key.lower() in device_name.lower():
                return value
        return 100.0  # an unknown GPU: a round figure; set metrics.peak_tflops for a real MFU
    return measured_cpu_peak_tflops(torch.get_num_threads())


def measured_cpu_peak_tflops(threads: int, n: int = 512) -> float:
    """Dense fp32 matmul TFLOP/s on this worker's threads: best of a few short timed runs (~0.2 s), measured
    once per machine and thread count and cached in ~/.cache/raytrain/cpu_peak.json (delete it to measure
    again). No CPU has a datasheet peak that a nominal figure could stand for."""
    import json
    import platform

    model = platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    key = f"{model} | {threads} threads | torch {torch.__version__}"
    path = os.path.join(os.path.expanduser("~"), ".cache", "raytrain", "cpu_peak.json")
    cache: dict = {}
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            cache = json.load(f)
    if isinstance(cache.get(key), (int, float)) and cache[key] > 0:
        return float(cache[key])
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b  # warm-up: the first call allocates and picks its kernel
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        best = min(best, time.perf_counter() - t)
    peak = 4 * 2 * n**3 / best / 1e12
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({**cache, key: peak}, f)
        os.replace(tmp, path)  # workers measuring at once: the last complete file wins, never a torn one
    return peak


_PROCESS = None


def device_memory(cuda: bool) -> dict:
    """Host RSS of this process and, on GPU, allocated / reserved / peak accelerator memory (GiB) and the used
    fraction of the device (on CPU: of the host), which the memory rule watches."""
    import psutil

    global _PROCESS
    if _PROCESS is None or _PROCESS.pid != os.getpid():
        _PROCESS = psutil.Process()  # made once: psutil.Process() reads /proc for the process's identity
    m = {"host_rss_gb": _PROCESS.memory_info().rss / 2**30}
    if cuda:
        free, total = torch.cuda.mem_get_info()
        m.update({"gpu_mem_alloc_gb": torch.cuda.memory_allocated() / 2**30,
                  "gpu_mem_reserved_gb": torch.cuda.memory_reserved() / 2**30,
                  "gpu_mem_peak_gb": torch.cuda.max_memory_allocated() / 2**30,
                  "memory_used_frac": 1 - free / total})
    else:
        m["memory_used_frac"] = psutil.virtual_memory().percent / 100
    return m


def first_step_memory(cfg: Config, *, n_params: int, vocab: int, cuda: bool) -> dict:
    """What the first step used against what was planned for it (raytrain/sweep/memory_estimate.py, the estimate
    `micro_batch_size: auto` and `raytrain plan` size by): on GPU the peak allocated memory, on CPU the process's
    resident memory, which also holds the Python and torch runtime the estimate leaves out. GiB; one line to say."""
    from raytrain.sweep.memory_estimate import estimate_mb

    est = estimate_mb(cfg, vocab, n_params)
    m = device_memory(cuda)
    measured = m["gpu_mem_peak_gb"] if cuda else m["host_rss_gb"]
    planned = est["total_mb"] / 1024
    what = "GPU peak allocated" if cuda else "host resident (with the Python and torch runtime)"
    line = (f"[raytrain] memory at the first step: {what} {measured:.2f} GiB per rank, planned {planned:.2f} GiB "
            f"(model states {est['model_states_mb'] / 1024:.2f} + activations {est['activations_mb'] / 1024:.2f}, "
            f"micro-batch {cfg.batch.micro_batch_size})" + (f": {measured / planned:.0%} of the plan" if cuda else ""))
    return {"device": "gpu" if cuda else "host", "measured_gib": round(measured, 3), "planned_gib": round(planned, 3),
            "line": line}


class PhaseTimer:
    """Seconds per phase since the last log step.

    On GPU, timing a phase means synchronising at its end (so the time of asynchronous kernels is
    charged to the phase that launched them), and every sync stops the host from queueing work ahead.
    So on GPU the device phases are timed on sampled steps only (the loop samples its log steps) and
    averaged over those; host-timed phases (data wait, checkpoint stall) count on every step.
    """

    DEVICE_PHASES = ("forward_backward", "optimizer")

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.total = dict.fromkeys(PHASES, 0.0)
        self.sampling, self.sampled = True, 0

    def step(self, sample: bool) -> None:
        """At the start of each step: whether this one's device phases are timed (always on CPU)."""
        self.sampling = sample or not self.cuda
        self.sampled += self.sampling

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if not self.sampling:
            yield
            return
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.total[phase] += time.perf_counter() - t

    def add(self, phase: str, seconds: float) -> None:
        self.total[phase] += seconds

    def take(self, steps: int) -> dict:
        out = {f"phase_{p}_s": v / max(1, self.sampled if p in self.DEVICE_PHASES else steps)
               for p, v in self.total.items()}
        self.total, self.sampled = dict.fromkeys(PHASES, 0.0), 0
        return out


class Window:
    """Time, steps and data wait since the last log line (throughput is measured per window)."""

    def __init__(self, timer: PhaseTimer):
        self.timer = timer
        self.t_start = time.perf_counter()
        self.reset()

    def reset(self) -> None:
        self.t, self.steps, self.data_wait = time.perf_counter(), 0, 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t

    def since_start(self) -> float:
        return time.perf_counter() - self.t_start

    @contextlib.contextmanager
    def waiting(self):
        """Around the wait for a batch: counted in the window and in the phase timer's data_wait."""
        t0 = time.perf_counter()
        yield
        waited = time.perf_counter() - t0
        self.data_wait += waited
        self.timer.add("data_wait", waited)


class Telemetry:
    def __init__(self, cfg: Config, rank: int, world: int, cuda: bool, flops_per_token: float, log=print):
        self.cfg, self.rank, self.world, self.cuda, self.fpt = cfg, rank, world, cuda, flops_per_token
        self.peak = peak_tflops(cfg, torch.cuda.get_device_name() if cuda else None)
        self.metrics = RayMetrics(cfg.run.name, rank, enabled=cfg.metrics.prometheus)
        self.timer = PhaseTimer(cuda)
        self.checkpoints = 0
        self.rollbacks = 0
        self.rolled_back: list[dict] = []  # {"step", "resumed_from", "skipped": [start, end), "rule"}
        self.health = HealthMonitor(Thresholds.resolve(cfg.health, cuda), cfg.health.on_bad_loss, cfg.health.enabled,
                                    log=log if rank == 0 else (lambda msg: None),
                                    count=lambda rule: self.metrics.count("raytrain_health_violations_total",
                                                                          rule=rule))

    def checkpoint_saved(self, seconds: float) -> None:
        self.checkpoints += 1
        self.timer.add("checkpoint_stall", seconds)
        self.metrics.count("raytrain_checkpoints_total")

    def log_step(self, rec: dict, state, steps: int, seconds: float) -> dict:
        """The keys a log step adds to its record: MFU, perplexity, step time and its phases, memory, counters."""
        add = {"max_steps": self.cfg.run.max_steps, "step_time_s": seconds / max(1, steps),
               **self.timer.take(steps), **device_memory(self.cuda),
               "restarts": state.restarts, "preemptions": state.preemptions,
               "rollbacks": self.rollbacks, "checkpoints": self.checkpoints}
        if isinstance(rec.get("loss"), (int, float)) and math.isfinite(rec["loss"]):
            add["ppl"] = math.exp(min(rec["loss"], 50.0))
        if isinstance(rec.get("tflops_per_worker"), (int, float)):
            add["mfu"] = rec["tflops_per_worker"] / self.peak
        return add

    def summary(self) -> dict:
        return {"rollbacks": self.rollbacks, "rolled_back": self.rolled_back, "checkpoints_saved": self.checkpoints,
                "health_violations": dict(self.health.counts), "health_first": dict(self.health.first)}

    def close(self) -> None:
        self.metrics.close()


@contextlib.contextmanager
def oom_guard(cfg: Config, world: int, cuda: bool):
    """An accelerator out-of-memory becomes one line with the sizes involved and a smaller setting to try."""
    try:
        yield
    except torch.OutOfMemoryError:
        from raytrain.worker.health import oom_message

        mem = device_memory(cuda) if cuda else None
        raise UserError(oom_message(cfg, world, mem)) from None


def stop(tel: Telemetry, run_uri: str, reason: str) -> None:
    """End the run with a health report (<run>/health.json) and one line saying why and what to do."""
    if tel.rank == 0:
        report = {"reason": reason, **tel.summary(), "history": dataclasses.asdict(tel.health.history)}
        RunDir(run_uri).write_json(HEALTH, report)
    raise UserError(f"training stopped by the health rules: {reason} (report: {RunDir(run_uri).uri(HEALTH)})")

