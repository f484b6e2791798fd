"""Ray Tune sweeps (`raytrain tune`): every trial a real Train + DeepSpeed run on the session's Ray cluster.

Quick tests: the sweep config's errors name their key; the micro-batch searcher's stopping rule; the
memory estimate. Slow tests: a micro-batch sweep where one trial exceeds the memory cap (infeasible, the
sweep completes and names the best setting, whose written config then trains as is), with its driver
killed after the first trial and the sweep resumed; an ASHA sweep of 4 trials of which at least one is
stopped early.
"""

import csv
import json
import math
import os
import subprocess
import sys
import time

import pytest
import ray

from raytrain.cli import main
from raytrain.config import load_config
from raytrain.errors import UserError
from raytrain.sweep.memory_estimate import estimate_mb
from raytrain.sweep.space import MicroBatchSearcher
from raytrain.sweep.spec import load_spec, microbatch_grid, trial_config

# The model of tests.helpers.tiny_cfg, as dotted overrides; one worker per trial so two trials fit the
# session's 4-CPU cluster at once (1 worker + 0.5 data CPUs + the trial driver each).
TINY = ["model.n_layer=1", "model.hidden_size=32", "model.n_head=2", "model.seq_len=32", "optim.warmup_steps=2",
        "data.eval_samples=16", "scaling.num_workers=1", "scaling.data_cpus=0.5", "run.max_failures=0"]


def _data(tiny_data) -> list[str]:
    return [f"data.train={tiny_data}/train", f"data.val={tiny_data}/val"]


@pytest.mark.parametrize("override, needle", [
    ("search.methd=grid", "search.methd"),
    ("space.optim.lrr={choice: [1]}", "optim.lrr"),
    ("trial_overrides.run.evel_every=2", "run.evel_every"),
    ("nosuch=1", "nosuch"),
    ("objective.metric=accuracy", "objective.metric"),
    ("space.optim.lr={loguniform: [0, 1]}", "space.optim.lr"),
    ("space.optim.decay={choice: [cosine, sqrt]}", "optim.decay"),
    ("scheduler.grace_period=1000", "grace_period"),
])
def test_bad_tune_config_names_the_key(tiny_data, override, needle):
    with pytest.raises(UserError, match=needle.replace(".", r"\.")):
        load_spec("tune_configs/lr_warmup_asha.yaml", [*_data(tiny_data), override])


def test_a_sweep_refuses_a_range_of_workers(tiny_data):
    with pytest.raises(UserError, match=r"trials run at one size: set scaling.num_workers to one number"):
        load_spec("tune_configs/lr_warmup_asha.yaml", [*_data(tiny_data), "trial_overrides.scaling.num_workers=[1,2]",
                                                       "trial_overrides.batch.global_batch_size=16"])


def test_cli_bad_tune_config_is_one_line(tiny_data):
    # A fresh process, as a user runs it: in this one, the session's Ray cluster forwards other tests' worker
    # logs to stderr at any moment, so capturing stderr here would not show what the user sees.
    r = subprocess.run([sys.executable, "-m", "raytrain", "tune", "--config", "tune_configs/lr_warmup_asha.yaml",
                        *_data(tiny_data), "budget.num_sample=3"], capture_output=True, text=True, timeout=120)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(err) == 1 and "budget.num_sample" in err[0] and err[0].startswith("raytrain: error:"), err


def test_microbatch_grid_holds_global_batch(tiny_data):
    spec = load_spec("tune_configs/microbatch_throughput.yaml", [*_data(tiny_data), *TINY, "batch.global_batch_size=24"])
    assert microbatch_grid(spec) == [1, 2, 4, 8]  # powers of two dividing 24 per worker
    for mb in microbatch_grid(spec):
        cfg = trial_config(spec, {"batch.micro_batch_size": mb})
        assert cfg.global_batch == 24 and cfg.accumulation == 24 // mb


def test_searcher_stops_on_plateau_and_on_memory():
    s = MicroBatchSearcher([1, 2, 4, 8, 16, 32], "tokens_per_s", "max", plateau_pct=5.0)
    got = []
    for tps in (100.0, 180.0, 185.0):  # +80 %, then +2.8 %: plateau
        cfg = s.suggest(f"t{len(got)}")
        got.append(cfg["batch.micro_batch_size"])
        assert s.suggest("other") is None  # one trial at a time
        s.on_trial_complete(f"t{len(got) - 1}", {"micro_batch_size": got[-1], "tokens_per_s": tps})
    assert got == [1, 2, 4] and s.suggest("t9") == MicroBatchSearcher.FINISHED
    assert "plateau at micro_batch_size=4" in s.stop_reason and s.summary()["trials"] == 3

    s = MicroBatchSearcher([1, 2, 4, 8], "tokens_per_s", "max", plateau_pct=None)
    for i, (tps, infeasible) in enumerate([(100.0, False), (90.0, False), (math.nan, True)]):
        mb = s.suggest(f"t{i}")["batch.micro_batch_size"]
        s.on_trial_complete(f"t{i}", {"micro_batch_size": mb, "tokens_per_s": tps, "infeasible": infeasible,
                                      "reason": "estimated 9 MB > cap"})
    assert s.suggest("t3") == MicroBatchSearcher.FINISHED and "micro_batch_size=4 infeasible" in s.stop_reason


def test_memory_estimate_grows_with_micro_batch(tiny_data):
    spec = load_spec("tune_configs/microbatch_throughput.yaml", [*_data(tiny_data), *TINY, "batch.global_batch_size=16"])
    est = [estimate_mb(trial_config(spec, {"batch.micro_batch_size": m}), 300)["total_mb"] for m in (1, 2, 4, 8)]
    assert all(b > a for a, b in zip(est, est[1:]))
    ckpt = estimate_mb(trial_config(spec, {"batch.micro_batch_size": 8, "model.activation_checkpointing": True}), 300)
    assert ckpt["activations_mb"] < estimate_mb(trial_config(spec, {"batch.micro_batch_size": 8}), 300)["activations_mb"]


@pytest.mark.slow
def test_microbatch_sweep_with_memory_cap_resume_then_train_best(ray_cluster, tiny_data, tmp_path, capsys):
    args = [*_data(tiny_data), *TINY, "batch.global_batch_size=16", "run.max_steps=4", f"storage={tmp_path}/sweeps",
            f"checkpoint.storage={tmp_path}/runs", "name=mb", "budget.max_steps=4", "trial_overrides.run.log_every=2",
            "microbatch.plateau_pct=null"]
    spec = load_spec("tune_configs/microbatch_throughput.yaml", args)
    est = {m: estimate_mb(trial_config(spec, {"batch.micro_batch_size": m}), 300)["total_mb"] for m in (2, 4)}
    cap = (est[2] + est[4]) / 2  # micro-batch 4 and up do not fit
    cmd = ["tune", "--config", "tune_configs/microbatch_throughput.yaml", *args, f"microbatch.memory_cap_mb={cap}"]
    # The sweep's driver dies (SIGKILL) once the first trial has finished; --resume continues the sweep.
    # The driver joins the session's cluster as its own job, as `ray job submit` would run it.
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    driver = subprocess.Popen([sys.executable, "-m", "raytrain", *cmd], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 600  # liveness guard: all of test_tune took 217 s in a suite run; 600 s catches a hang
    while not list((tmp_path / "sweeps" / "mb" / "trials").glob("*/summary.json")) and driver.poll() is None:
        assert time.time() < deadline, "the first trial did not finish"
        time.sleep(1)
    driver.kill()
    assert driver.wait() != 0, "the driver finished before it could be killed"
    assert main(["tune", "--config", "tune_configs/microbatch_throughput.yaml", *args]) == 2  # exists: needs --resume
    assert main([*cmd, "--resume"]) == 0
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "sweeps" / "mb" / "results.json").read_text())
    by_mb = {t["micro_batch_size"]: t for t in res["trials"]}
    assert sorted(by_mb) == [1, 2, 4]  # stopped growing at the first infeasible one
    assert by_mb[4]["status"] == "infeasible" and "memory_cap_mb" in by_mb[4]["detail"]
    assert all(by_mb[m]["status"] == "completed" and by_mb[m]["tokens_per_s"] > 0 for m in (1, 2))
    assert by_mb[1]["accumulation"] == 16 and by_mb[2]["accumulation"] == 8
    assert res["microbatch"]["trials_used"] == 3 and res["microbatch"]["grid_size"] == 5
    best = res["best"]
    assert best["micro_batch_size"] == max((1, 2), key=lambda m: by_mb[m]["tokens_per_s"])
    assert [t["rank"] for t in res["trials"]][:1] == [1] and res["trials"][0]["trial"] == best["trial"]
    assert "3 of 5 grid points" in out and f"batch.micro_batch_size={best['micro_batch_size']}" in out
    with open(tmp_path / "sweeps" / "mb" / "results.csv") as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["completed", "completed", "infeasible"]
    assert (tmp_path / "sweeps" / "mb" / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The written best config is a whole run config: `raytrain train --config` validates it the same way.
    trained = load_config(res["best_config"], [])
    assert trained.batch.micro_batch_size == best["micro_batch_size"] and trained.global_batch == 16
    assert trained.run.name == "mb-best" and trained.run.max_steps == 4


@pytest.mark.slow
def test_asha_lr_sweep_stops_a_trial_early(ray_cluster, tiny_data, tmp_path, monkeypatch):
    """With every gate of raytrain/internals closed (RAYTRAIN_INTERNALS=stock, as an upgraded Ray would; the session
    cluster runs no dashboard): ASHA stops a trial, the sweep finishes, and no placement group is left behind
    (the microbatch sweep's test runs with the gates open)."""
    from ray.util import placement_group_table

    from raytrain.internals.registry import FORCE_ENV

    monkeypatch.setenv(FORCE_ENV, "stock")  # the trials' too (make_trainable passes it on)
    before = {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    args = [*_data(tiny_data), *TINY, f"storage={tmp_path}", "name=asha", "budget.max_steps=6",
            "budget.num_samples=3", "scheduler.grace_period=2", "trial_overrides.run.eval_every=2",
            "trial_overrides.run.log_every=2", "trial_overrides.checkpoint.every_n_steps=100",
            "space.optim.warmup_steps={choice: [0, 4, 30]}",
            "resources.max_concurrent=1"]  # the seeded trials one after another: ASHA sees them in the same order
    assert main(["tune", "--config", "tune_configs/lr_warmup_asha.yaml", *args]) == 0
    res = json.loads((tmp_path / "asha" / "results.json").read_text())
    trials = res["trials"]
    assert len(trials) == 3 and not [t for t in trials if t["status"] == "error"]
    stopped = [t for t in trials if t["status"] == "stopped"]
    assert stopped and all(t["step"] < 6 for t in stopped), trials
    done = [t for t in trials if t["status"] == "completed"]
    assert done and all(t["step"] == 6 for t in done)
    assert [t["val_loss"] for t in done] == sorted(t["val_loss"] for t in done)
    assert res["best"]["trial"] == done[0]["trial"]
    assert 1e-4 <= res["best"]["settings"]["optim.lr"] <= 1e-2
    # The gates were closed in the trials: no memory snapshots (they rest on ZeRO's internals) in any trial's run.
    trial_metrics = list((tmp_path / "asha" / "trials").glob("*/metrics.jsonl"))
    assert len(trial_metrics) == 3, trial_metrics
    assert not [p for p in trial_metrics if "snapshot_every" in p.read_text()]
    deadline = time.time() + 60  # a stopped trial's group goes with its controller
    while (left := {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"} - before):
        assert time.time() < deadline, {k: placement_group_table()[k] for k in left}
        time.sleep(1)
    assert ray.is_initialized()
