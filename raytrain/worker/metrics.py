"""raytrain_* series on Ray's Prometheus endpoint: one gauge or counter per metric, labelled run and worker.

Ray's exporter prefixes every application metric with `ray_`; the scrape config in observability/
strips it again (metric_relabel_configs), so Prometheus, the alert rules and the dashboard see the
names below. Units are in the names and are base units (seconds, bytes, FLOP/s, ratios).
Ray drops a gauge that has not been set for two report intervals, so the last values are set again
every second from a daemon thread: a series stays alive between log steps, and ends with the worker.
"""

from __future__ import annotations

import threading
from typing import Optional

# metric name -> (kind, help, the metrics.jsonl key it comes from and its factor to base units)
CATALOGUE: dict[str, tuple[str, str, Optional[str], float]] = {
    "raytrain_step": ("gauge", "optimizer steps completed", "step", 1.0),
    "raytrain_max_steps": ("gauge", "run.max_steps", "max_steps", 1.0),
    "raytrain_loss": ("gauge", "training loss (mean over workers) at the last log step", "loss", 1.0),
    "raytrain_perplexity": ("gauge", "exp(training loss)", "ppl", 1.0),
    "raytrain_val_loss": ("gauge", "validation loss at the last evaluation", "val_loss", 1.0),
    "raytrain_val_perplexity": ("gauge", "validation perplexity at the last evaluation", "val_ppl", 1.0),
    "raytrain_learning_rate": ("gauge", "learning rate applied", "lr", 1.0),
    "raytrain_grad_norm": ("gauge", "global gradient norm before clipping", "grad_norm", 1.0),
    "raytrain_tokens_per_second": ("gauge", "training tokens per second, whole run", "tokens_per_s", 1.0),
    "raytrain_samples_per_second": ("gauge", "training sequences per second, whole run", "samples_per_s", 1.0),
    "raytrain_achieved_flops_per_second": ("gauge", "model FLOP/s achieved by this worker",
                                           "tflops_per_worker", 1e12),
    "raytrain_mfu_ratio": ("gauge", "model FLOPs utilisation: achieved / peak FLOP/s of this worker", "mfu", 1.0),
    "raytrain_step_time_seconds": ("gauge", "wall time per optimizer step", "step_time_s", 1.0),
    "raytrain_step_phase_seconds": ("gauge", "time per step by phase (label phase)", None, 1.0),
    "raytrain_host_memory_rss_bytes": ("gauge", "resident memory of this worker process", "host_rss_gb", 2**30),
    "raytrain_memory_used_ratio": ("gauge", "used fraction of the accelerator's (CPU: the host's) memory",
                                   "memory_used_frac", 1.0),
    "raytrain_accelerator_memory_allocated_bytes": ("gauge", "accelerator memory allocated by tensors",
                                                    "gpu_mem_alloc_gb", 2**30),
    "raytrain_accelerator_memory_reserved_bytes": ("gauge", "accelerator memory reserved by the allocator",
                                                   "gpu_mem_reserved_gb", 2**30),
    "raytrain_accelerator_memory_peak_bytes": ("gauge", "peak accelerator memory allocated", "gpu_mem_peak_gb", 2**30),
    "raytrain_tokens_seen": ("gauge", "tokens trained on since the run began (kept across restarts)",
                             "tokens_seen", 1.0),
    "raytrain_restarts": ("gauge", "times this run was restarted from a checkpoint", "restarts", 1.0),
    "raytrain_preemptions": ("gauge", "preemptions this run survived", "preemptions", 1.0),
    "raytrain_rollbacks": ("gauge", "automatic rollbacks after a NaN/inf or spiking loss", "rollbacks", 1.0),
    "raytrain_checkpoints_total": ("counter", "checkpoints saved by this worker process", None, 1.0),
    "raytrain_health_violations_total": ("counter", "health-rule violations (label rule)", None, 1.0),
    "raytrain_eval_score": ("gauge", "downstream evaluation (lm-evaluation-harness) of the newest evaluated "
                            "checkpoint (labels task, metric)", None, 1.0),
}
ACCELERATOR_ONLY = {"raytrain_accelerator_memory_allocated_bytes", "raytrain_accelerator_memory_reserved_bytes",
                    "raytrain_accelerator_memory_peak_bytes"}
PHASES = ("data_wait", "forward_backward", "optimizer", "checkpoint_stall")


class RayMetrics:
    """One worker's exporter. Disabled (no Ray metrics objects at all) when metrics.prometheus=false."""

    def __init__(self, run: str, worker: int, enabled: bool = True, refresh_s: float = 1.0):
        self.enabled = enabled
        self.tags = {"run": run, "worker": str(worker)}
        self._last: dict[tuple[str, tuple], tuple[float, dict]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if not enabled:
            return
        from ray.util.metrics import Counter, Gauge

        self._m = {}
        for name, (kind, help_, _, _) in CATALOGUE.items():
            keys = ("run", "worker") + (("phase",) if name == "raytrain_step_phase_seconds" else ()) + \
                (("rule",) if name == "raytrain_health_violations_total" else ()) + \
                (("task", "metric") if name == "raytrain_eval_score" else ())
            self._m[name] = (Gauge if kind == "gauge" else Counter)(name, description=help_, tag_keys=keys)
        self._thread = threading.Thread(target=self._refresh, args=(refresh_s,), daemon=True,
                                        name="raytrain-metrics")
        self._thread.start()

    def _set(self, name: str, value: float, **extra: str) -> None:
        tags = {**self.tags, **extra}
        with self._lock:
            self._last[(name, tuple(sorted(extra.items())))] = (value, tags)
        self._m[name].set(value, tags=tags)

    def _refresh(self, every: float) -> None:
        while not self._stop.wait(every):
            with self._lock:
                items = list(self._last.items())
            for (name, _), (value, tags) in items:
                self._m[name].set(value, tags=tags)

    def record(self, rec: dict) -> None:
        """A metrics.jsonl record (plus its `phase_<name>_s` keys) -> gauges; absent keys are left alone."""
        if not self.enabled:
            return
        for name, (kind, _, key, factor) in CATALOGUE.items():
            v = rec.get(key) if key else None
            if kind == "gauge" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self._set(name, float(v) * factor)
        for key, v in rec.items():
            if key.startswith("eval/") and isinstance(v, (int, float)) and key.count("/") >= 2:
                _, task, metric = key.split("/", 2)
                self._set("raytrain_eval_score", float(v), task=task, metric=metric)
        for phase in PHASES:
            v = rec.get(f"phase_{phase}_s")
            if isinstance(v, (int, float)):
                self._set("raytrain_step_phase_seconds", float(v), phase=phase)

    def count(self, name: str, **extra: str) -> None:
        if self.enabled:
            self._m[name].inc(1.0, tags={**self.tags, **extra})

    def close(self) -> None:
        self._stop.set()
