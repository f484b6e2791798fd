"""One sweep trial: a real raytrain training run (Ray Train v2 + DeepSpeed) driven from a Tune trial.

Ray 2.60's Tune/Train v2 pattern: the Tune trial is only a driver that calls `trainer.fit()`; the Train
workers' metric reports reach Tune through a Train callback (TuneReportCallback). Two things are added:

* Only reports that carry the objective go to Tune (checkpoint-only steps have no val_loss, and Tune
  rejects a result without its metric); the last step arrives as the trial's final report.
* A trial that Tune stops (ASHA) aborts its Train run first. Otherwise the run's placement group outlives
  the trial: Train's own cleaner needs the dashboard's state API, and without it the CPUs stay reserved
  and later trials wait forever.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Optional

import ray
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.trainable.function_trainable import wrap_function

from raytrain import storage
from raytrain.config import load_config
from raytrain.rundir import METRICS, RunDir
from raytrain.internals.registry import gate
from raytrain.internals.ray import CONTROLLER_CALLBACKS, TUNE_REPORT_QUEUE, abort_controller, \
    controller_callback_base, report_queue_empty
from raytrain.sweep.spec import SweepSpec, trial_overrides

# Per trial-actor process: the queue through which this trial's Train controller announces itself.
_RUN: dict[str, Any] = {}
_OOM_MARKERS = ("out of memory", "outofmemoryerror", "can't allocate memory", "memoryerror")


class _ReportObjective(TuneReportCallback):
    """TuneReportCallback that forwards only intermediate reports carrying the objective metric.

    The last step is left to the trial's own final report: a scheduler stops a trial that reaches its
    max_t, which would abort the run before it writes its summary."""

    def __init__(self, metric: str, max_steps: int):
        super().__init__()
        self._metric, self._max_steps = metric, max_steps

    def after_report(self, run_context, metrics, checkpoint):
        if metrics and self._metric in metrics[0] and metrics[0].get("step", 0) < self._max_steps:
            super().after_report(run_context, metrics, checkpoint)

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until Tune has taken the last forwarded report, so the trial's final report comes after it."""
        if not gate(TUNE_REPORT_QUEUE):
            time.sleep(2.0)
            return
        deadline = time.time() + timeout_s
        while time.time() < deadline and not report_queue_empty(self):
            time.sleep(0.2)
        time.sleep(0.5)


def _announce_controller(queue) -> Optional[Any]:
    """A callback that runs inside the Train controller and hands the trial a handle to it, for a clean abort on
    stop; None where Ray's controller internals are not the version it was written for."""
    if not gate(CONTROLLER_CALLBACKS):
        return None

    class AnnounceController(controller_callback_base()):
        def after_controller_start(self, train_run_context) -> None:
            queue.put(ray.get_runtime_context().current_actor)

    return AnnounceController()


def _abort_train_run() -> None:
    queue, run_uri = _RUN.pop("queue", None), _RUN.pop("run_uri", None)
    if queue is None:
        return
    try:
        controller = queue.get_nowait()
    except Exception:  # noqa: BLE001 - nothing announced (its gate closed, or not yet), or the queue is gone
        controller = None
    if controller is None:
        # Without the controller's handle, the trial actor's end takes the controller and its workers with it, but
        # not their placement group (it lives as long as the sweep's driver): removed here, by the id rank 0 recorded.
        _remove_placement_group(run_uri)
        return
    try:
        # abort() shuts the worker group down and removes its placement group, then exits the actor.
        abort_controller(controller, timeout_s=60)
    except Exception:  # noqa: BLE001 - the exit surfaces as an actor error; a finished run is gone already
        pass


def _remove_placement_group(run_uri: Optional[str]) -> None:
    """Ray's public API: the placement group of the run's newest attempt (attempts.jsonl), removed."""
    from ray.util import placement_group_table
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    from raytrain.rundir import ATTEMPTS

    if run_uri is None:
        return
    try:
        attempts = RunDir(run_uri).read_jsonl(ATTEMPTS)
        pg = attempts[-1].get("placement_group") if attempts else None
        if pg and placement_group_table().get(pg, {}).get("state", "REMOVED") != "REMOVED":  # not a finished run's
            remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg)))
    except Exception as e:  # noqa: BLE001 - a group already gone; the trial ends either way
        print(f"[raytrain] stopped trial: its placement group was not removed ({type(e).__name__}: {e})", flush=True)


def _oom_reason(err: BaseException) -> Optional[str]:
    seen: Optional[BaseException] = err
    while seen is not None:
        for line in str(seen).splitlines():
            if any(m in line.lower() for m in _OOM_MARKERS):
                return line.strip()[:300]
        seen = seen.__cause__ or seen.__context__
    return None


def _steady_mean(history: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in history if isinstance(r.get(key), (int, float))]
    steady = values[1:] or values  # the first window includes warm-up, as in the run summary
    return sum(steady) / len(steady) if steady else None


def run_trial(config: dict, spec_dict: dict, sweep_dir: str) -> None:
    """The trial function. `config` holds the trial's dotted training keys."""
    from ray.util.queue import Queue

    from raytrain.data.manifest import load_split
    from raytrain.sweep.memory_estimate import estimate_mb
    from raytrain.trainer import train

    spec = SweepSpec.model_validate(spec_dict)
    metric = spec.objective.metric
    overrides = trial_overrides(spec, dict(config))
    # Each trial is its own training run under the sweep; the Tune trial id is kept across
    # `raytrain tune --resume`, so a resumed trial continues its run from its newest checkpoint.
    overrides["checkpoint.storage"] = storage.join(sweep_dir, "trials")
    overrides["run.name"] = tune.get_context().get_trial_id()
    cfg = load_config(spec.base, overrides)
    info: dict[str, Any] = {"micro_batch_size": cfg.batch.micro_batch_size, "accumulation": cfg.accumulation,
                            "global_batch": cfg.global_batch, "run_uri": cfg.run_uri, "final": True}
    cap = spec.microbatch.memory_cap_mb if spec.search.method == "microbatch" else None
    if cap:
        from raytrain.data.sources import train_uri

        vocab = cfg.model.vocab_size or load_split(train_uri(cfg.data), "data.train").vocab_size
        est = estimate_mb(cfg, vocab)["total_mb"]
        info["memory_est_mb"] = round(est, 1)
        if est > cap:
            tune.report({**info, metric: float("nan"), "infeasible": True,
                         "reason": f"estimated {est:.4g} MB per worker > microbatch.memory_cap_mb={cap:.4g}"})
            return

    queue = _RUN["queue"] = Queue(maxsize=1, actor_options={"num_cpus": 0})
    _RUN["run_uri"] = cfg.run_uri
    forward = _ReportObjective(metric, cfg.run.max_steps)
    try:
        announce = _announce_controller(queue)
        summary = train(cfg, log=print, callbacks=[forward, *([announce] if announce is not None else [])])
    except Exception as e:  # noqa: BLE001 - out of memory is an outcome of the search, not a crash
        reason = _oom_reason(e)
        if reason is None:
            raise
        tune.report({**info, metric: float("nan"), "infeasible": True, "reason": f"out of memory: {reason}"})
        return
    history = RunDir(cfg.run_uri).read_jsonl(METRICS)
    result = {**info, "infeasible": False, "reason": "", "step": summary["steps"],
              "tokens_per_s": summary["tokens_per_s"], "samples_per_s": _steady_mean(history, "samples_per_s"),
              "tflops_per_worker": _steady_mean(history, "tflops_per_worker"), "loss": summary["final_loss"],
              "val_loss": summary["val_loss"], "val_ppl": summary["val_ppl"], "wall_s": summary["wall_s"]}
    peaks = [r["gpu_mem_peak_gb"] for r in history if isinstance(r.get("gpu_mem_peak_gb"), (int, float))]
    if cap and peaks and max(peaks) * 1024 > cap:
        result.update({"infeasible": True, "reason": f"measured peak {max(peaks) * 1024:.0f} MB per worker > "
                       f"microbatch.memory_cap_mb={cap:g}"})
    if result.get(metric) is None:
        result[metric] = float("nan")
    forward.drain()
    tune.report({k: (float("nan") if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()})


def make_trainable(spec: SweepSpec, sweep_dir: str):
    """The Tune trainable: run_trial plus an abort of the Train run when Tune stops the trial. The sweep's own
    environment that training workers take (trainer.PROPAGATED_ENV: RAYTRAIN_INTERNALS=stock among them) holds in
    every trial too, whose process the cluster started before the sweep."""
    from raytrain.trainer import worker_env

    spec_dict = spec.model_dump(mode="json")
    env = worker_env()

    def raytrain_trial(config):
        os.environ.update(env)
        run_trial(config, spec_dict, sweep_dir)

    class RaytrainTrial(wrap_function(raytrain_trial)):
        def cleanup(self):
            _abort_train_run()
            super().cleanup()

    return tune.with_resources(RaytrainTrial, {"cpu": spec.resources.driver_cpus})
