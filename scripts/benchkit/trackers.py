"""Benchmark part `trackers`: a step's cost with W&B (offline) + MLflow (a local server) beside the same run without,
and the training loop's pause to hand a committed checkpoint to a downstream (lm-eval) evaluation task.

Runs alternate A (no tracker) / B (trackers) / A / B on the same data and config, logging every step (the
worst case for a tracker: one record per step); the figure is B's median step time over A's. On a 2-core
machine the evaluation tasks of the hand-over run compete with training for CPU; the pause measured is the
loop's own (task submission and the queue line), which that contention does not hide.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
from pathlib import Path
from typing import Callable

from benchkit.parts import figure, measured, metrics, prepare_data, train_cfg


def _median_step_s(run_uri: str) -> float:
    recs = [r for r in metrics(run_uri) if "step_time_s" in r]
    return statistics.median(r["step_time_s"] for r in recs[len(recs) // 5:])  # past the first fifth: warm-up


def trackers(tmp: str, quick: bool, log: Callable = print) -> list[dict]:
    from raytrain.trainer import train
    from tests.helpers import write_lm_eval_tasks
    from tests.test_trackers import _start_mlflow_server

    data = prepare_data(os.path.join(tmp, "data"), 300_000 if quick else 1_500_000)
    steps = 60 if quick else 200
    proc, uri = _start_mlflow_server(Path(tempfile.mkdtemp(prefix="mlflow-", dir=tmp)))
    figs = []
    try:
        with_trackers = (f"metrics.mlflow.tracking_uri={uri}", "metrics.mlflow.experiment=bench",
                         "metrics.wandb.project=bench", "metrics.wandb.mode=offline", f"metrics.wandb.dir={tmp}/wandb")
        times: dict[str, list[float]] = {"off": [], "on": []}
        for rep in range(2):
            for kind, extra in (("off", ()), ("on", with_trackers)):
                cfg = train_cfg(data, f"{tmp}/runs", f"trackers-{kind}-{rep}", 2, steps, 1, *extra)
                train(cfg, log=lambda *_: None)
                times[kind].append(_median_step_s(cfg.run_uri))
                log(f"  {kind:>3} (rep {rep}): median step {times[kind][-1] * 1e3:.1f} ms")
        off, on = statistics.mean(times["off"]), statistics.mean(times["on"])
        figs.append(figure("trackers", "step time with W&B offline + MLflow (local server), log every step", on, "s",
                           "the same run without trackers", measured(off), target="<= 1.01", met=on / off <= 1.01,
                           runs_off=times["off"], runs_on=times["on"], steps=steps))
        # The hand-over: a checkpoint every 10 steps, each evaluated on a Ray task of its own.
        tasks = write_lm_eval_tasks(Path(tempfile.mkdtemp(prefix="tasks-", dir=tmp)))
        cfg = train_cfg(data, f"{tmp}/runs", "handoff", 2, 40, 5, "checkpoint.every_n_steps=10",
                        "eval.tasks=[raytrain_tiny_mc]", "eval.limit=8", f"eval.include_path={tasks}")
        summary = train(cfg, log=lambda *_: None)
        pause = summary.get("eval_handoff_max_s")
        log(f"  hand-over to an evaluation task: longest pause {pause * 1e3:.1f} ms over {summary['eval_handoffs']} "
            f"hand-overs")
        # No baseline: 0.05 s is the target, not a figure of this run.
        figs.append(figure("trackers", "training loop's longest pause to hand a checkpoint to an evaluation task",
                           pause, "s", target="<= 0.05 s", met=pause is not None and pause <= 0.05,
                           handoffs=summary["eval_handoffs"]))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    return figs
