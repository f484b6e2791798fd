"""Experiment trackers against real components: an MLflow tracking server on 127.0.0.1 (one per module),
W&B in offline mode, an unreachable tracker, and bad tracker input (one line, exit 2)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from raytrain.rundir import METRICS, TRACKERS, RunDir
from raytrain.trainer import train
from tests.helpers import free_port, mlflow_server_exe, tensorboard_scalars, tiny_cfg


def _start_mlflow_server(d):
    """`mlflow server` on a free 127.0.0.1 port (sqlite backend), in a process group of its own; (process, URI)."""
    exe = mlflow_server_exe()
    port = free_port()
    proc = subprocess.Popen([exe, "server", "--backend-store-uri", f"sqlite:///{d}/mlflow.db",
                             "--default-artifact-root", str(d / "art"), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180  # ~12 s on a quiet machine (pitfalls #16), minutes on a loaded one
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2).read()
            return proc, uri
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail("mlflow server did not answer /health in 180 s")
            time.sleep(0.5)


def _stop_mlflow_server(proc):
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=3)
    except subprocess.TimeoutExpired:  # its workers finish their requests for ~20 s; nothing of theirs is needed
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    pytest.importorskip("mlflow", reason="the MLflow client is not installed: pip install 'raytrain[mlflow]'")
    proc, uri = _start_mlflow_server(tmp_path_factory.mktemp("mlflow"))
    yield uri
    _stop_mlflow_server(proc)


def _steps(run_dir, key):
    return [(r["step"], r[key]) for r in RunDir(str(run_dir)).read_jsonl(METRICS) if isinstance(r.get(key), float)]


def _report_recorder(path: Path):
    """A Ray Train callback (it runs in the Train controller) that appends rank 0's metrics of every report to
    `path`, one JSON line each: what Tune's TuneReportCallback would be handed in a sweep trial."""
    import ray.train

    class RecordReports(ray.train.UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            with open(path, "a") as f:
                f.write(json.dumps(metrics[0], default=str) + "\n")

    return RecordReports()


@pytest.fixture(scope="module")
def mlflow_run(ray_cluster, tiny_data, tmp_path_factory, mlflow_server, lm_eval_tasks):
    """A run through a SIGKILL, a resubmission resized 2 -> 1 and a health rollback, logged to MLflow and to W&B
    (offline) and TensorBoard, with downstream (lm-eval) evaluations of its checkpoints on Ray tasks; (run directory,
    the resubmission's summary). Beside the run directory: reports.jsonl, what Ray Train's reports carried."""
    pytest.importorskip("lm_eval", reason="the lm-evaluation-harness is not installed: pip install 'raytrain[eval]'")
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'raytrain[wandb]'")
    tmp_path = tmp_path_factory.mktemp("mlflow_run")
    # W&B offline too: one training run for every sink keeps the suite short.
    common = ("run.eval_every=5", f"metrics.mlflow.tracking_uri={mlflow_server}", "metrics.mlflow.experiment=crash",
              "metrics.wandb.project=raytrain-test", "metrics.wandb.mode=offline", f"metrics.wandb.dir={tmp_path / 'wandb'}",
              "eval.tasks=[raytrain_tiny_mc]", "eval.limit=8", f"eval.include_path={lm_eval_tasks}",
              "metrics.tensorboard=true")
    reports = _report_recorder(tmp_path / "reports.jsonl")
    cfg = tiny_cfg(tiny_data, tmp_path / "runs", "mlf", "run.max_failures=1", *common)
    summary = train(cfg, log=lambda *_: None, inject={"crash_at_step": 7, "marker": str(tmp_path / "crashed")},
                    callbacks=[reports])
    assert summary["restarts"] == 1 and summary["trackers"]["mlflow"]["error"] is None
    assert summary["trackers"]["wandb"]["error"] is None
    # The same run submitted again on 1 worker (a 2 -> 1 resize), for more steps: it resumes, and logs into the same
    # MLflow run, through a health rollback (a NaN on step 11's batch: back to checkpoint 10, that batch skipped).
    more = tiny_cfg(tiny_data, tmp_path / "runs", "mlf", "run.max_steps=12", "scaling.num_workers=1", *common)
    return tmp_path / "runs" / "mlf", train(more, log=lambda *_: None, inject={"nan_at_step": 11}, callbacks=[reports])


@pytest.mark.slow
def test_one_tracker_run_each_through_a_crash_a_resize_and_a_rollback(mlflow_run, mlflow_server):
    """One MLflow run, step for step, and one W&B run id; each checkpoint's downstream evaluation logged once at its
    step, in MLflow too."""
    from mlflow.tracking import MlflowClient

    run_dir, summary = mlflow_run
    assert summary["rollbacks"] == 1
    run_id = RunDir(str(run_dir)).read_json(TRACKERS)["mlflow"]["run_id"]
    assert summary["trackers"]["mlflow"]["run_id"] == run_id
    client = MlflowClient(tracking_uri=mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("crash").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id] and runs[0].info.status == "FINISHED"
    for key in ("loss", "val_loss"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        want = _steps(run_dir, key)
        assert [s for s, _ in history] == [s for s, _ in want]  # step for step: no duplicate, no gap
        assert [v for _, v in history] == pytest.approx([v for _, v in want], rel=1e-6)
    assert [s for s, _ in _steps(run_dir, "loss")] == list(range(1, 13))
    assert runs[0].data.params["optim.lr"] == "0.003" and runs[0].data.params["run.max_steps"] == "10"
    # Every checkpoint (5, 10, 12) evaluated and logged exactly once, though the crash took the first
    # attempt's evaluation of step 5 with it (or not: either way, once).
    key = "eval/raytrain_tiny_mc/acc"
    evals = _steps(run_dir, key)
    assert [s for s, _ in evals] == [5, 10, 12]
    assert all((run_dir / "eval" / str(s) / "raytrain_tiny_mc.json").exists() for s, _ in evals)
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
    assert [s for s, _ in history] == [5, 10, 12] and [v for _, v in history] == pytest.approx([v for _, v in evals])
    # W&B (offline): three attempts, one run id (on a loaded machine an attempt may die before W&B opened its
    # directory).
    wandb_id = RunDir(str(run_dir)).read_json(TRACKERS)["wandb"]["run_id"]
    assert summary["trackers"]["wandb"] == {**summary["trackers"]["wandb"], "run_id": wandb_id, "error": None}
    runs = sorted(p.name for p in (run_dir.parent.parent / "wandb" / "wandb").glob("offline-run-*"))
    assert 1 <= len(runs) <= 3 and all(r.endswith(f"-{wandb_id}") for r in runs), runs


@pytest.mark.slow
def test_every_sink_gets_every_kind_of_record_through_a_crash_a_resize_and_a_rollback(mlflow_run, mlflow_server):
    """One path (worker/records.py's RecordWriter): metrics.jsonl, TensorBoard and the tracker (MLflow) hold the
    step-0 validation, the steps, validations, checkpoints, the rollback and the downstream evaluations; Ray Train's
    reports (what Tune is handed) were the validation and checkpoint records only, a step's in one report. (Prometheus:
    the next test; the session cluster exports a gauge every 10 s, too seldom to see a short run's records.)"""
    from mlflow.tracking import MlflowClient

    run_dir, _ = mlflow_run
    recs = RunDir(str(run_dir)).read_jsonl(METRICS)
    val0 = [r["val_loss"] for r in recs if r["step"] == 0]
    rollbacks = [(r["step"], r["bad_step"], r["resumed_from"]) for r in recs if r.get("event") == "rollback"]
    checkpoints = [r["step"] for r in recs if "checkpoint" in r]
    evals = [r["step"] for r in recs if "eval/raytrain_tiny_mc/acc" in r]
    assert len(val0) == 1 and rollbacks == [(10, 11, 10)] and checkpoints == evals == [5, 10, 12], recs
    assert sorted(r["step"] for r in recs if "val_loss" in r) == [0, 5, 10, 12]

    tb = tensorboard_scalars(run_dir / "tensorboard")
    assert tb["val_loss"][0] == pytest.approx(val0[0], rel=1e-5) and sorted(tb["val_loss"]) == [0, 5, 10, 12]
    assert sorted(tb["loss"]) == list(range(1, 13))
    assert tb["bad_step"] == {10: 11.0} and tb["resumed_from"] == {10: 10.0}
    assert sorted(tb["ckpt_stall_s"]) == checkpoints and sorted(tb["eval/raytrain_tiny_mc/acc"]) == evals

    client = MlflowClient(tracking_uri=mlflow_server)
    run_id = RunDir(str(run_dir)).read_json(TRACKERS)["mlflow"]["run_id"]

    def history(key):
        return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))

    assert history("val_loss")[0] == (0, pytest.approx(val0[0], rel=1e-6))
    assert history("bad_step") == [(10, 11.0)] and client.get_run(run_id).data.tags["raytrain.event"] == "rollback"
    assert [s for s, _ in history("ckpt_stall_s")] == checkpoints

    # Tune's input: validations and checkpoints, never a plain step, the rollback or a downstream evaluation (rank 0
    # alone, at any step). A report lost with the killed attempt is gone, so 0 and 5 may be missing.
    reports = [json.loads(x) for x in (run_dir.parent.parent / "reports.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in reports]
    assert {10, 12} <= set(steps) <= {0, 5, 10, 12} and len(steps) == len(set(steps)), reports
    assert all(("checkpoint" in r) == (r["step"] > 0) and "val_loss" in r for r in reports), reports
    assert not [r for r in reports if "event" in r or any(k.startswith("eval/") for k in r)], reports


def test_prometheus_shows_the_newest_value_whatever_kind_of_record_brought_it(ray_cluster, tmp_path):
    """No training: rank 0's record writer as the loop drives it through a validation, a checkpoint, a rollback and a
    downstream evaluation, with the worker's Prometheus exporter (Ray metrics on the session cluster): after each
    record the gauges hold the newest values, and the report gets each step's validation and checkpoint as one."""
    from raytrain.worker.metrics import RayMetrics
    from raytrain.worker.records import RecordWriter
    from raytrain.worker.runlog import RunLog
    from raytrain.worker.trackers import Trackers

    cfg = tiny_cfg("data", tmp_path, "latest")
    prometheus, reported = RayMetrics("latest", 0), []
    records = RecordWriter(cfg, rank=0, log=RunLog(cfg.run_uri, 4, 0, enabled=True), prometheus=prometheus,
                           trackers=Trackers(cfg, enabled=False), report=reported.append)

    def shown(name, **labels):
        return prometheus._last[(name, tuple(sorted(labels.items())))][0]

    try:
        records.write({"step": 0, "val_loss": 5.0}, "validation")
        records.report()
        assert (shown("raytrain_step"), shown("raytrain_val_loss")) == (0, 5.0)
        records.write({"step": 1, "loss": 4.0}, "step")
        records.report()
        records.write({"step": 2, "loss": 3.0, "val_loss": 3.5}, "validation", sync=True)
        records.write({"step": 2, "checkpoint": "checkpoint_00000002", "ckpt_stall_s": 0.1}, "checkpoint")
        records.report()
        records.write({"step": 3, "loss": 2.5}, "step")
        records.report()
        assert (shown("raytrain_step"), shown("raytrain_loss"), shown("raytrain_val_loss")) == (3, 2.5, 3.5)
        records.log.rewind(2)
        records.write({"step": 2, "event": "rollback", "bad_step": 3, "resumed_from": 2}, "rollback", sync=True)
        records.write({"step": 2, "eval/tiny_mc/acc": 0.5}, "downstream", sync=True)
        records.report()
        assert shown("raytrain_step") == 2 and shown("raytrain_eval_score", task="tiny_mc", metric="acc") == 0.5
        records.write({"step": 3, "loss": 2.4, "val_loss": 2.6}, "validation", sync=True)
        records.report()
        assert (shown("raytrain_step"), shown("raytrain_loss"), shown("raytrain_val_loss")) == (3, 2.4, 2.6)
    finally:
        records.close()
        prometheus.close()
    assert reported == [{"step": 0, "val_loss": 5.0},
                        {"step": 2, "loss": 3.0, "val_loss": 3.5, "checkpoint": "checkpoint_00000002",
                         "ckpt_stall_s": 0.1},
                        {"step": 3, "loss": 2.4, "val_loss": 2.6}]
    assert [(r["step"], r.get("event")) for r in records.log.history] == [(0, None), (1, None), (2, None), (2, None),
                                                                          (2, "rollback"), (2, None), (3, None)]


@pytest.mark.slow
def test_an_mlflow_server_killed_mid_run_costs_one_warning_and_no_metrics_line(tmp_path):
    """No Ray: rank 0's record writer, run log and trackers as the loop drives them, the MLflow server SIGKILLed once
    the run is open and records were sent. Every write returns at once, metrics.jsonl has every record, one warning,
    and closing takes at most metrics.tracker_timeout_s."""
    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install 'raytrain[mlflow]'")
    from raytrain.worker.records import RecordWriter
    from raytrain.worker.runlog import RunLog
    from raytrain.worker.trackers import Trackers

    proc, uri = _start_mlflow_server(tmp_path)
    cfg = tiny_cfg("data", tmp_path / "runs", "killed", f"metrics.mlflow.tracking_uri={uri}", "metrics.tracker_timeout_s=5")
    said = []
    trackers = Trackers(cfg, enabled=True, log=said.append)
    records = RecordWriter(cfg, rank=0, log=RunLog(cfg.run_uri, 10, 0, enabled=True), trackers=trackers)
    rd = RunDir(cfg.run_uri)
    try:
        slowest = 0.0
        for step in range(1, 11):
            if step == 4:  # the run is open and steps 1-3 were sent: the server goes
                deadline = time.time() + 120  # liveness guard: normally a few s (a send every 3 s); 120 s: a hang
                while (rd.read_json(TRACKERS) or {}).get("mlflow", {}).get("logged_through", -1) < 3:
                    assert time.time() < deadline, rd.read_json(TRACKERS)
                    time.sleep(0.2)
                os.killpg(proc.pid, signal.SIGKILL)
            t = time.time()
            records.write({"step": step, "loss": 1.0 / step}, "step")
            slowest = max(slowest, time.time() - t)
        t = time.time()
        where = records.close()["trackers"]
        closed_s = time.time() - t
        # The outcome: the writes returned while the tracker still held steps 4-10 unsent, and close() gave up on
        # it at its deadline while it was still stuck in MLflow's backoff against the dead server, saying why.
        (tracker,) = trackers.trackers
        assert tracker.through == 3 and tracker.thread.is_alive(), tracker.through
        assert "within metrics.tracker_timeout_s=5" in where["mlflow"]["error"], where
        # Liveness guards only: a write is a queue put (about a millisecond) and close() ends at the 5 s timeout;
        # a write or close() that waited on the tracker would wait out MLflow's retries (minutes). 30 s and 60 s
        # only catch that.
        assert slowest < 30 and closed_s < 60, (slowest, closed_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert where["mlflow"]["error"] and len(said) == 1 and "the mlflow tracker stopped" in said[0], (where, said)
    assert [s for s, _ in _steps(tmp_path / "runs" / "killed", "loss")] == list(range(1, 11))


@pytest.mark.slow
def test_an_attempt_killed_before_it_noted_the_mlflow_run_id_leaves_no_second_run(mlflow_server, tmp_path):
    """No Ray: the key is noted before MLflow creates the run, so a kill between create_run and noting the run id
    (a slow tracking server at start) costs no second MLflow run: the next attempt finds the run by its key."""
    from mlflow.tracking import MlflowClient

    from raytrain.worker.trackers import MlflowBackend, Trackers

    cfg = tiny_cfg("data", tmp_path, "torn", f"metrics.mlflow.tracking_uri={mlflow_server}",
                   "metrics.mlflow.experiment=torn")
    first = MlflowBackend(cfg)
    claimed = first.claim(None)
    RunDir(cfg.run_uri).write_json(TRACKERS, {"mlflow": claimed})  # what the killed attempt had noted
    first.open(None, config=cfg.to_dict(), restarts=0)  # it created the run, then died before noting its id
    trackers = Trackers(cfg, enabled=True, restarts=1, log=lambda *_: None)
    trackers.write({"step": 1, "loss": 2.0, "time": time.time()})
    where = trackers.close()["mlflow"]
    client = MlflowClient(tracking_uri=mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("torn").experiment_id])
    assert where["error"] is None and [r.info.run_id for r in runs] == [first.run_id] == [where["run_id"]]
    assert [m.value for m in client.get_metric_history(first.run_id, "loss")] == [2.0]


@pytest.mark.parametrize("policy", ["warn", "stop"])
def test_an_unreachable_tracker_warns_once_or_stops_the_run(tmp_path, monkeypatch, policy):
    """No Ray: rank 0's Trackers against MLflow at 127.0.0.1:1. warn: one warning line and writes go on; stop: the
    next write raises the one-line error the run stops with."""
    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install 'raytrain[mlflow]'")
    from raytrain.errors import UserError
    from raytrain.worker.trackers import Trackers

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # refused at once, not after minutes of backoff
    cfg = tiny_cfg("data", tmp_path, "unreachable", "metrics.mlflow.tracking_uri=http://127.0.0.1:1",
                   f"metrics.on_tracker_failure={policy}")
    said = []
    trackers = Trackers(cfg, enabled=True, log=said.append)
    deadline = time.time() + 60
    with pytest.raises(UserError, match="on_tracker_failure=stop") if policy == "stop" else contextlib.nullcontext():
        while time.time() < deadline and not (policy == "warn" and said):
            trackers.write({"step": 1, "loss": 1.0, "time": time.time()})
            time.sleep(0.1)
    assert len(said) == 1 and "the mlflow tracker stopped" in said[0]
    assert trackers.close()["mlflow"]["error"]


def _cli(tiny_data, tmp_path, *overrides, prelude=""):
    code = f"{prelude}import sys; from raytrain.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "train", "--config", "tiny", f"data.train={tiny_data}/train",
                           f"data.val={tiny_data}/val", "model.seq_len=32", f"checkpoint.storage={tmp_path}", *overrides],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("uri", ["htp:/nowhere", "http://", "http://127.0.0.1:99999", "http://me:secret@127.0.0.1:5000"])
def test_malformed_tracking_uri_is_one_line_exit_2(tiny_data, tmp_path, uri):
    r = _cli(tiny_data, tmp_path, f"metrics.mlflow.tracking_uri={uri}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "metrics.mlflow.tracking_uri" in r.stderr
    assert not list(tmp_path.rglob("config.yaml"))


@pytest.mark.parametrize("extra,key", [("mlflow", "metrics.mlflow.tracking_uri=http://127.0.0.1:1"),
                                       ("wandb", "metrics.wandb.project=p")])
def test_tracker_library_missing_is_one_line_exit_2(tiny_data, tmp_path, extra, key):
    r = _cli(tiny_data, tmp_path, key, prelude=f"import sys; sys.modules[{extra!r}] = None; ")
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and f"pip install 'raytrain[{extra}]'" in r.stderr


@pytest.mark.slow
def test_downstream_evaluation_equals_the_harness_cli_on_the_same_export(mlflow_run, lm_eval_tasks, tmp_path, capsys):
    """The numbers training logged for checkpoint 12, and `raytrain eval --model` on its export, equal the harness's
    own `lm_eval --model hf pretrained=<export>` on the same tasks and limit."""
    import json

    from raytrain.ckpt.layout import dir_name
    from raytrain.cli import main
    from raytrain.export import export

    run_dir, _ = mlflow_run
    out = tmp_path / "export"
    export(str(run_dir / dir_name(12)), str(out), log=lambda *_: None)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={out}",
                        "--tasks", "raytrain_tiny_mc", "--include_path", str(lm_eval_tasks), "--limit", "8",
                        "--device", "cpu", "--output_path", str(tmp_path / "harness")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cli = json.loads(next((tmp_path / "harness").rglob("results_*.json")).read_text())["results"]["raytrain_tiny_mc"]
    during = json.loads((run_dir / "eval" / "12" / "raytrain_tiny_mc.json").read_text())["metrics"]
    capsys.readouterr()
    assert main(["eval", "--model", str(out), "--tasks", "raytrain_tiny_mc", "--include-path", str(lm_eval_tasks),
                 "--limit", "8", "--json"]) == 0
    printed = capsys.readouterr().out
    command = json.loads(printed[printed.index("\n{") + 1:])["metrics"]["raytrain_tiny_mc"]
    for metric in ("acc", "acc_norm", "acc_stderr"):
        assert during[metric] == command[metric] == cli[f"{metric},none"], metric
    assert "raytrain_tiny_mc             acc" in printed  # the table
    # Scored on a clean subset too (raytrain data contamination --clean-out): its 8 first documents are the
    # --limit 8 ones, so the clean figures equal the whole's; a subset of 3 is scored on 3.
    clean = tmp_path / "clean.json"
    for ids, want in ((list(range(8)), command), ([1, 4, 6], None)):
        clean.write_text(json.dumps({"raytrain_tiny_mc": ids, "another_task": [0]}))
        assert main(["eval", "--model", str(out), "--tasks", "raytrain_tiny_mc", "--include-path", str(lm_eval_tasks),
                     "--limit", "8", "--clean", str(clean), "--json"]) == 0
        printed = capsys.readouterr().out
        got = json.loads(printed[printed.index("\n{") + 1:])
        assert got["n_samples"]["raytrain_tiny_mc/clean"]["effective"] == len(ids), got["n_samples"]
        if want is not None:
            assert got["metrics"]["raytrain_tiny_mc/clean"]["acc"] == want["acc"]
    clean.write_text("not json")
    assert main(["eval", "--model", str(out), "--tasks", "raytrain_tiny_mc", "--include-path", str(lm_eval_tasks),
                 "--clean", str(clean)]) == 2
    assert "eval.clean_subset=" in capsys.readouterr().err


@pytest.mark.parametrize("override,expect", [
    ("eval.tasks=[raytrain_tiny_mcq]", "did you mean raytrain_tiny_mc"),
    ("eval.include_path=/nonexistent/tasks", "is not a directory of task YAMLs"),
])
def test_bad_evaluation_input_is_one_line_exit_2(tiny_data, tmp_path, lm_eval_tasks, override, expect):
    r = _cli(tiny_data, tmp_path, f"eval.include_path={lm_eval_tasks}", "eval.tasks=[raytrain_tiny_mc]", override)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and expect in r.stderr, r.stderr
    assert not list(tmp_path.rglob("config.yaml"))


def test_harness_missing_is_one_line_exit_2(tiny_data, tmp_path):
    r = _cli(tiny_data, tmp_path, "eval.tasks=[hellaswag]", prelude="import sys; sys.modules['lm_eval'] = None; ")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "pip install 'raytrain[eval]'" in r.stderr
