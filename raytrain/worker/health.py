"""Health rules as small objects checked in the training loop, and the advice each violation carries.

A rule looks at one record (a step's loss, or a log step's metrics) and returns a Violation or None.
The monitor logs a rule's first violation with its advice, counts every one (metrics and summary), and
says which action the loop must take: "warn", "rollback" (NaN/inf or spiking loss) or "stop".
Every rank sees the same all-reduced loss, so every rank takes the same decision at the same step.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from raytrain.config import Config, HealthSection

# The thresholds for GPU runs, and what a CPU run gets instead (a tiny model at a high learning rate on one core has
# bigger gradients and far lower FLOP/s than anything the GPU numbers were made for).
GPU_DEFAULTS = {"min_tflops_per_worker": 0.8, "grad_norm_max": 1.0}
CPU_DEFAULTS = {"min_tflops_per_worker": 1e-4, "grad_norm_max": 10.0}


@dataclass
class Violation:
    rule: str
    action: str  # "warn" | "rollback" | "stop"
    message: str
    advice: str


@dataclass
class Thresholds:
    min_tflops_per_worker: float
    grad_norm_max: float
    grad_norm_min: float
    memory_frac_max: float
    memory_minutes: float
    eval_patience: int
    spike_zscore: float
    spike_window: int
    grace_steps: int

    @classmethod
    def resolve(cls, h: HealthSection, on_gpu: bool) -> "Thresholds":
        d = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
        return cls(
            min_tflops_per_worker=d["min_tflops_per_worker"] if h.min_tflops_per_worker is None else h.min_tflops_per_worker,
            grad_norm_max=d["grad_norm_max"] if h.grad_norm_max is None else h.grad_norm_max,
            grad_norm_min=h.grad_norm_min, memory_frac_max=h.memory_frac_max, memory_minutes=h.memory_minutes,
            eval_patience=h.eval_patience, spike_zscore=h.spike_zscore, spike_window=h.spike_window,
            grace_steps=h.grace_steps,
        )


# ---- advice: what to tell a person when things go wrong ----

def convergence_advice(history: "History") -> str:
    lrs = ", ".join(f"{s}:{v:.2e}" for s, v in history.lr[-5:]) or "-"
    gns = ", ".join(f"{s}:{v:.3g}" for s, v in history.grad_norm[-5:]) or "-"
    gap = ""
    if history.loss and history.val_loss:
        t, v = history.loss[-1][1], history.val_loss[-1][1]
        gap = (f"; last train loss {t:.4f} vs val loss {v:.4f}" +
               (" - val far above train: check that train and val data look alike (`raytrain data compare`)"
                if v > 1.5 * t else ""))
    return (f"learning rate applied (step:lr) {lrs}; gradient norm history {gns}{gap}. Try a lower optim.lr or "
            "a longer optim.warmup_steps, keep optim.grad_clip=1.0, and check the data")


def oom_message(cfg: Config, world: int, memory: Optional[dict] = None) -> str:
    """One line for an accelerator out-of-memory: the sizes involved, the settings, a concrete smaller setting."""
    mb, seq, acc = cfg.batch.micro_batch_size, cfg.model.seq_len, cfg.accumulation
    ds = cfg.deepspeed
    mem = ""
    if memory:
        mem = " | memory: " + ", ".join(f"{k} {v:.2f}" for k, v in memory.items() if isinstance(v, (int, float)))
    tries = []
    if mb > 1:
        tries.append(f"batch.micro_batch_size={mb // 2} batch.gradient_accumulation_steps={acc * 2} "
                     f"(same global batch {cfg.global_batch})")
    if not cfg.model.activation_checkpointing:
        tries.append("model.activation_checkpointing=true")
    if ds.zero_stage < 3:
        tries.append(f"deepspeed.zero_stage={ds.zero_stage + 1}")
    elif ds.offload_optimizer == "none":
        tries.append("deepspeed.offload_optimizer=cpu")
    elif ds.offload_param == "none":
        tries.append("deepspeed.offload_param=cpu")
    if not tries:
        tries.append(f"model.seq_len={seq // 2} or more workers (scaling.num_workers={world * 2})")
    return (f"accelerator out of memory: micro_batch {mb} x seq_len {seq} = {mb * seq} tokens per forward, "
            f"ZeRO-{ds.zero_stage}, offload optimizer={ds.offload_optimizer} param={ds.offload_param}, "
            f"activation checkpointing {'on' if cfg.model.activation_checkpointing else 'off'}, {world} workers{mem}. "
            f"Try: {'; or '.join(tries)}")


# ---- the rules ----

@dataclass
class History:
    """Short histories the advice quotes (step, value)."""
    loss: list = field(default_factory=list)
    val_loss: list = field(default_factory=list)
    lr: list = field(default_factory=list)
    grad_norm: list = field(default_factory=list)

    def add(self, rec: dict, keep: int = 50) -> None:
        for key in ("loss", "val_loss", "lr", "grad_norm"):
            v = rec.get(key)
            if isinstance(v, (int, float)):
                seq = getattr(self, key)
                seq.append((rec["step"], float(v)))
                del seq[:-keep]


class NonFiniteLoss:
    name = "loss_not_finite"

    def check_step(self, step: int, loss: float) -> Optional[Violation]:
        if math.isfinite(loss):
            return None
        return Violation(self.name, "rollback", f"loss is {loss} at step {step}",
                         "a NaN/inf loss usually means a bad batch or a too-high learning rate; "
                         "the run rolls back to its last complete checkpoint and skips that data")


class LossSpike:
    name = "loss_spike"

    def __init__(self, zscore: float, window: int, grace: int):
        self.z, self.grace = zscore, grace
        self.recent: deque = deque(maxlen=window)
        self.since_start = 0

    def reset(self) -> None:
        self.since_start = 0

    def check_step(self, step: int, loss: float) -> Optional[Violation]:
        if not math.isfinite(loss):
            return None
        self.since_start += 1
        n = len(self.recent)
        if self.z > 0 and n >= 5 and self.since_start > self.grace:
            mean = sum(self.recent) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in self.recent) / n)
            z = (loss - mean) / max(std, 1e-8)
            if z > self.z:
                # The spiking value stays out of the window: it must not become the new normal.
                return Violation(self.name, "rollback",
                                 f"loss {loss:.4f} at step {step} is {z:.1f} standard deviations above the last "
                                 f"{n} steps (mean {mean:.4f})",
                                 "a loss spike is usually a bad data window or an unstable learning rate; the run "
                                 "rolls back and skips that data (lower optim.lr if it recurs)")
        self.recent.append(loss)
        return None


class GradNorm:
    name = "grad_norm"

    def __init__(self, high: float, low: float, grace: int):
        self.high, self.low, self.grace = high, low, grace

    def check(self, rec: dict, steps_since_start: int, history: History) -> Optional[Violation]:
        g = rec.get("grad_norm")
        if not isinstance(g, (int, float)) or not math.isfinite(g) or steps_since_start <= self.grace:
            return None
        if g > self.high:
            return Violation(self.name, "warn", f"gradient norm {g:.3g} > {self.high:g} at step {rec['step']}",
                             convergence_advice(history))
        if g < self.low:
            return Violation(self.name, "warn", f"gradient norm {g:.3g} < {self.low:g} at step {rec['step']}",
                             "vanishing gradients: check the learning-rate schedule and the init, or whether "
                             "training has stalled. " + convergence_advice(history))
        return None


class Throughput:
    name = "throughput"

    def __init__(self, min_tflops: float, grace: int):
        self.min, self.grace = min_tflops, grace

    def check(self, rec: dict, steps_since_start: int, history: History) -> Optional[Violation]:
        t = rec.get("tflops_per_worker")
        if not isinstance(t, (int, float)) or steps_since_start <= self.grace or t >= self.min:
            return None
        wait = rec.get("data_wait_frac")
        hint = (f"data wait is {wait:.0%} of step time: the reader cannot keep up; check the storage's throughput "
                "(data_bytes_fetched_* in metrics), give workers more CPUs (scaling.cpus_per_worker) or store the data "
                "nearer the nodes"
                if isinstance(wait, (int, float)) and wait > 0.2 else
                "raise batch.micro_batch_size if memory allows, use bf16, check model.attn_implementation=sdpa")
        return Violation(self.name, "warn", f"achieved {t:.3g} TFLOP/s per worker < {self.min:g} at step {rec['step']}",
                         hint)


class Memory:
    name = "memory"

    def __init__(self, frac: float, minutes: float, clock: Callable[[], float] = time.monotonic):
        self.frac, self.seconds, self.clock = frac, minutes * 60, clock
        self.high_since: Optional[float] = None

    def check(self, rec: dict, steps_since_start: int, history: History) -> Optional[Violation]:
        used = rec.get("memory_used_frac")
        if not isinstance(used, (int, float)):
            return None
        if used < self.frac:
            self.high_since = None
            return None
        now = self.clock()
        self.high_since = now if self.high_since is None else self.high_since
        if now - self.high_since >= self.seconds:
            return Violation(self.name, "warn",
                             f"memory at {used:.0%} (>= {self.frac:.0%}) for {(now - self.high_since) / 60:.1f} min",
                             "close to out of memory: lower batch.micro_batch_size, enable "
                             "model.activation_checkpointing, or raise deepspeed.zero_stage / offload")
        return None


class NoImprovement:
    name = "no_improvement"

    def __init__(self, patience: int):
        self.patience = patience
        self.best = math.inf
        self.stale = 0

    def check(self, rec: dict, steps_since_start: int, history: History) -> Optional[Violation]:
        v = rec.get("val_loss")
        if not isinstance(v, (int, float)):
            return None
        if v < self.best:
            self.best, self.stale = v, 0
            return None
        self.stale += 1
        if self.stale >= self.patience:
            return Violation(self.name, "warn",
                             f"validation loss has not improved for {self.stale} evaluations (best {self.best:.4f}, "
                             f"now {v:.4f}) at step {rec['step']}", convergence_advice(history))
        return None


class HealthMonitor:
    """All rules of one worker. `log` prints (rank 0), `count` feeds the metrics exporter."""

    def __init__(self, th: Thresholds, on_bad_loss: str = "rollback", enabled: bool = True,
                 log: Callable[[str], None] = print, count: Callable[[str], None] = lambda rule: None,
                 clock: Callable[[], float] = time.monotonic):
        self.th, self.on_bad_loss, self.enabled, self.log, self.count = th, on_bad_loss, enabled, log, count
        self.nonfinite = NonFiniteLoss()
        self.spike = LossSpike(th.spike_zscore, th.spike_window, th.grace_steps)
        self.rules = [GradNorm(th.grad_norm_max, th.grad_norm_min, th.grace_steps),
                      Throughput(th.min_tflops_per_worker, th.grace_steps),
                      Memory(th.memory_frac_max, th.memory_minutes, clock), NoImprovement(th.eval_patience)]
        self.history = History()
        self.counts: dict[str, int] = {}
        self.first: dict[str, str] = {}  # rule -> first message (for the report)
        self.steps_since_start = 0

    def restarted(self) -> None:
        """After a rollback: warm-up again before the grace-gated rules apply."""
        self.steps_since_start = 0
        self.spike.reset()

    def _record(self, v: Violation) -> Violation:
        self.counts[v.rule] = self.counts.get(v.rule, 0) + 1
        self.count(v.rule)
        if v.rule not in self.first:
            self.first[v.rule] = v.message
            self.log(f"health: {v.message}. Advice: {v.advice}")
        return v

    def check_step(self, step: int, loss: float) -> Optional[Violation]:
        """Every step, on the all-reduced loss. Returns a violation whose action the loop must take."""
        if not self.enabled:
            return None
        self.steps_since_start += 1
        v = self.nonfinite.check_step(step, loss) or self.spike.check_step(step, loss)
        if v is None:
            return None
        v.action = {"rollback": "rollback", "stop": "stop", "warn": "warn"}[self.on_bad_loss]
        return self._record(v)

    def check_log(self, rec: dict) -> list[Violation]:
        """At log / eval steps: the warning rules."""
        self.history.add(rec)
        if not self.enabled:
            return []
        found = [v for r in self.rules if (v := r.check(rec, self.steps_since_start, self.history))]
        return [self._record(v) for v in found]
