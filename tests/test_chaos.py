"""Chaos on a local multi-node Ray cluster (scripts/chaos.py in a subprocess), checkpoints on the local S3 server.

Each training worker has a node of its own. The drill SIGKILLs worker processes at random steps and
removes a node once (the harness adds a spare, as an autoscaler would), then drains a node for
preemption with a deadline. The runs must train on exactly the samples, in the same order, and reach
exactly the losses of the same run without faults.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model.n_layer=1", "model.hidden_size=32", "model.n_head=2", "model.seq_len=32", "batch.micro_batch_size=4",
        "optim.lr=3e-3", "optim.warmup_steps=2", "data.eval_samples=16"]


def _drill(tmp_path, *args) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "chaos.py"), "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_kills_a_lost_node_and_a_drain_train_on_the_same_samples_with_the_same_losses(s3_server, tiny_data, tmp_path):
    """A SIGKILL, a node lost without notice and a preemption drain in one run (one cluster, one baseline).
    run.max_failures=2 is exactly the kill and the lost node: the run finishes only if the drain's restart is
    charged to the preemption budget. (One kill, not two: a restart costs ~30 s of the suite here, and repeated kills
    in one run are the recovery bench's, section 4b.)"""
    res = _drill(tmp_path, "--data", str(tiny_data), "--storage", "s3://raytrain-test/chaos", "--steps", "18",
                 "--every", "4", "--kills", "1", "--remove-node-at", "9", "--drain-at", "14", "--drain-deadline", "12",
                 "--seed", "3", "--baseline", *TINY, "run.max_failures=2", "run.max_preemptions=1")
    kinds = [e["signal"] for e in res["events"]]
    assert kinds.count("SIGKILL") == 1 and kinds.count("REMOVE_NODE") == 1 and kinds.count("DRAIN_NODE") == 1
    assert res["summary"]["steps"] == 18 and res["summary"]["restarts"] == 3
    assert len(res["recovery"]) == 3 and all(r["resumed_from"] is not None for r in res["recovery"])
    assert sorted(map(int, res["chaos"])) == list(range(1, 19))
    assert res["same_batches"], "a sample was skipped or repeated"
    assert res["max_loss_diff"] <= 1e-5
    for r in res["recovery"]:
        # A killed worker resumes from its node's memory snapshots (the tier is on by default): the step it died
        # in, or the one before. A drained node checkpoints at once: at most one step. A lost node: from its peer
        # copy (usually one step too), else from storage - at most the steps since the newest committed
        # checkpoint, up to two intervals with the async upload.
        assert 0 <= r["steps_lost"] <= (2 * 4 if r["signal"] == "REMOVE_NODE" else 1), r


def test_every_run_in_a_process_gets_a_drain_watcher(monkeypatch):
    """Ray's own watcher is switched off once per process: the second run of a process (a Tune trial, the drill's
    chaos run after its baseline) still gets ours. It once got none, and its drains went unnoticed. A user's own
    setting of Ray's switch is left alone."""
    from ray.train.v2._internal.constants import ENABLE_PREEMPTION_WATCHER_ENV_VAR as SWITCH

    from raytrain import ray_internals

    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.setattr(ray_internals, "_WATCHER_SWITCHED_OFF", [])
    for _ in range(3):
        names = [type(c).__name__ for c in ray_internals.watch_drains_in_controller([])]
        assert names == ["ControllerPreemptionCallback"] and os.environ[SWITCH] == "0"
    monkeypatch.setattr(ray_internals, "_WATCHER_SWITCHED_OFF", [])
    monkeypatch.setenv(SWITCH, "1")
    assert ray_internals.watch_drains_in_controller([]) == []


def test_no_dataset_manager_process_on_group_starts_without_ray_datasets():
    """Ray adds a DatasetsCallback to every trainer, which starts a DatasetManager actor (a process importing Ray
    Data) on every worker group start and restart; raytrain passes no Ray Datasets, so its trainer leaves it out.
    A trainer given datasets keeps it."""
    from ray.train import ScalingConfig

    from raytrain.trainer import _trainer_class

    def names(**kw):
        trainer = _trainer_class()(lambda: None, scaling_config=ScalingConfig(num_workers=1), **kw)
        return [type(c).__name__ for c in trainer._create_default_callbacks()]

    plain = names()
    assert "DatasetsCallback" not in plain and "BackendSetupCallback" in plain
    assert "DatasetsCallback" in names(datasets={"train": lambda: None})



def test_placement_group_cleaner_only_where_a_driver_outlives_its_runs(ray_cluster):
    """Ray's PlacementGroupCleaner (a process per run) is left out in a driver, whose exit removes the run's placement
    groups anyway (checked by hand: a SIGKILLed `raytrain train` driver's group was REMOVED at once, docs/BENCHMARKS.md);
    inside a Ray task or actor (a Tune trial, which ASHA may stop while the sweep's driver lives on) it stays."""
    import ray

    def names() -> list:  # defined here: Ray ships it by value (this test module is not importable on a worker)
        from ray.train import ScalingConfig

        from raytrain.trainer import _trainer_class

        trainer = _trainer_class()(lambda: None, scaling_config=ScalingConfig(num_workers=1))
        return [type(c).__name__ for c in trainer._create_default_callbacks()]

    assert "PlacementGroupCleanerCallback" not in names()
    in_a_task = ray.get(ray.remote(num_cpus=0)(names).remote())
    assert "PlacementGroupCleanerCallback" in in_a_task and "BackendSetupCallback" in in_a_task


def test_the_first_resource_request_does_not_hold_back_the_first_worker_group(ray_cluster, monkeypatch):
    """Ray's controller waited (up to 5 s, then printed a traceback into the job's output) for the cluster's
    AutoscalingCoordinator, a new process on a fresh cluster, before starting the first worker group. Ours sends
    the request without waiting; the coordinator still gets it."""
    import types

    import cloudpickle
    import ray
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision, create_scaling_policy

    from raytrain.ray_internals import scaling_policy_not_waiting_for_the_coordinator

    policy = scaling_policy_not_waiting_for_the_coordinator(create_scaling_policy(ScalingConfig(num_workers=2)))
    policy = cloudpickle.loads(cloudpickle.dumps(policy))  # as the controller gets it
    real_get, waits = ray.get, []
    # Recorded, not raised: Ray's client turns any error of its wait into a warning.
    monkeypatch.setattr(ray, "get", lambda *args, **kwargs: waits.append(kwargs.get("timeout")))
    policy.after_controller_start(types.SimpleNamespace(run_id="first-request"))
    decision = policy.make_decision_for_non_running_worker_group()
    monkeypatch.setattr(ray, "get", real_get)
    assert waits == [], "the controller waited on the coordinator before its first worker group"
    assert isinstance(decision, ResizeDecision) and decision.num_workers == 2

    coordinator = policy._autoscaling_coordinator
    reserved = ray.get(coordinator.get_reserved_resources.remote("train-first-request", recompute=True), timeout=60)
    assert reserved, "the coordinator never got the run's request"
    policy.before_controller_abort()  # cancels it (the coordinator is up now: a short wait)
    assert ray.get(coordinator.get_reserved_resources.remote("train-first-request", recompute=True)) == {}


def test_the_controller_side_of_the_process_group_never_imports_torch():
    """What a Train controller unpickles and calls of the run's backend config (raytrain.torch_backend): no torch
    import (Ray's TorchConfig costs every run's controller 2.2 s of torch import before its first worker group)."""
    import pickle

    from raytrain.torch_backend import ProcessGroupBackend, ProcessGroupConfig

    blob = pickle.dumps(ProcessGroupConfig(backend="gloo", timeout_s=60))
    probe = ("import pickle, sys; cfg = pickle.loads(sys.stdin.buffer.read()); b = cfg.backend_cls(); "
             "print(type(b).__name__, b.share_cuda_visible_devices, cfg.framework.name, cfg.to_dict()['backend'], "
             "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], input=blob, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().split() == [ProcessGroupBackend.__name__, "True", "TORCH", "gloo", "False"]

