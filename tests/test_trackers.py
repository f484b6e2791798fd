"""Experiment trackers against real components: an MLflow tracking server on 127.0.0.1 (one per module),
W&B in offline mode, an unreachable tracker, and bad tracker input (one line, exit 2)."""

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from raytrain.rundir import METRICS, TRACKERS, RunDir
from raytrain.trainer import train
from tests.helpers import free_port, mlflow_server_exe, tiny_cfg


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on a free 127.0.0.1 port (sqlite backend); its whole process group is stopped after."""
    pytest.importorskip("mlflow", reason="the MLflow client is not installed: pip install 'raytrain[mlflow]'")
    exe = mlflow_server_exe()
    d, port = tmp_path_factory.mktemp("mlflow"), free_port()
    proc = subprocess.Popen([exe, "server", "--backend-store-uri", f"sqlite:///{d}/mlflow.db",
                             "--default-artifact-root", str(d / "art"), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90  # ~12 s on these machines (pitfalls #16)
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2).read()
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail("mlflow server did not answer /health in 90 s")
            time.sleep(0.5)
    yield uri
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _steps(run_dir, key):
    return [(r["step"], r[key]) for r in RunDir(str(run_dir)).read_jsonl(METRICS) if isinstance(r.get(key), float)]


def test_mlflow_one_run_through_a_crash_and_a_resubmission(ray_cluster, tiny_data, tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    cfg = tiny_cfg(tiny_data, tmp_path / "runs", "mlf", "run.max_failures=1", "run.eval_every=5",
                   f"metrics.mlflow.tracking_uri={mlflow_server}", "metrics.mlflow.experiment=crash")
    summary = train(cfg, log=lambda *_: None, inject={"crash_at_step": 7, "marker": str(tmp_path / "crashed")})
    assert summary["restarts"] == 1 and summary["trackers"]["mlflow"]["error"] is None
    # The same run submitted again, for more steps: it resumes, and logs into the same MLflow run.
    more = tiny_cfg(tiny_data, tmp_path / "runs", "mlf", "run.max_steps=12", "run.eval_every=5",
                    f"metrics.mlflow.tracking_uri={mlflow_server}", "metrics.mlflow.experiment=crash")
    summary = train(more, log=lambda *_: None)
    run_dir = tmp_path / "runs" / "mlf"
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


def test_wandb_offline_keeps_one_run_id_and_an_unreachable_mlflow_costs_one_warning(ray_cluster, tiny_data, tmp_path):
    """One run, two trackers: W&B offline through a crash (one run id), MLflow unreachable (one warning, training
    and metrics.jsonl unharmed). One training run for both keeps the suite short."""
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'raytrain[wandb]'")
    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install 'raytrain[mlflow]'")
    wdir = tmp_path / "wandb"
    cfg = tiny_cfg(tiny_data, tmp_path / "runs", "wb", "run.max_failures=1", "metrics.wandb.project=raytrain-test",
                   "metrics.wandb.mode=offline", f"metrics.wandb.dir={wdir}",
                   "metrics.mlflow.tracking_uri=http://127.0.0.1:1", "metrics.tracker_timeout_s=3")
    t = time.time()
    summary = train(cfg, log=lambda *_: None, inject={"crash_at_step": 7, "marker": str(tmp_path / "crashed")})
    run_id = summary["trackers"]["wandb"]["run_id"]
    assert summary["restarts"] == 1 and summary["trackers"]["wandb"]["error"] is None
    runs = sorted(p.name for p in (wdir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.endswith(f"-{run_id}") for r in runs)  # two attempts, one W&B run
    assert RunDir(str(tmp_path / "runs" / "wb")).read_json(TRACKERS)["wandb"]["run_id"] == run_id
    # The unreachable tracker: the run finished in time, said so once (this attempt), and lost no metrics line.
    assert summary["steps"] == 10 and time.time() - t < 180
    assert summary["trackers"]["mlflow"]["error"] and len(summary["trackers"]["warnings"]) == 1
    assert [s for s, _ in _steps(tmp_path / "runs" / "wb", "loss")] == list(range(1, 11))


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
