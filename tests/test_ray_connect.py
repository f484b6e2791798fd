"""How commands reach Ray (raytrain.ray_connect): a Jobs API address is refused with the same one line by every
command that connects, before anything is loaded or started."""

import sys

import pytest

from raytrain.cli import main

JOBS_API = "http://127.0.0.1:8265"


@pytest.fixture
def jobs_api_address(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", JOBS_API)
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        # This process may hold the session's Ray (a connected process keeps its connection); the commands
        # must answer as they do in a fresh process, where `raytrain ...` runs.
        monkeypatch.setattr(ray, "is_initialized", lambda: False)


@pytest.mark.parametrize("argv", [
    ["train", "--config", "tiny", "data.train=/nonexistent/train"],
    ["eval", "--checkpoint", "/nonexistent/run/checkpoint_000001"],
    ["serve", "/nonexistent/model"],
])
def test_jobs_api_address_is_one_line_for_every_command(jobs_api_address, capsys, monkeypatch, argv):
    from raytrain import ray_connect

    # Refused before any model, data or cluster is touched: no connection is even attempted (and the paths
    # given do not exist, so a command that looked at its data or model first would fail with another line).
    tried = []
    monkeypatch.setattr(ray_connect, "connect", lambda *a, **k: tried.append(("connect", a)))
    if "ray" in sys.modules:
        monkeypatch.setattr(sys.modules["ray"], "init", lambda *a, **k: tried.append(("ray.init", a)))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"raytrain: error: RAY_ADDRESS={JOBS_API} is the Ray Jobs API address, which a driver cannot "
                   f"join: submit with `ray job submit -- raytrain {argv[0]} ...`, or on a cluster node set "
                   f"{'scaling.address' if argv[0] == 'train' else 'RAY_ADDRESS'}=auto"]
    assert tried == []


def test_scaling_address_is_named_when_it_is_the_jobs_api(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["train", "--config", "tiny", f"scaling.address={JOBS_API}"]) == 2
    assert capsys.readouterr().err.startswith(f"raytrain: error: scaling.address={JOBS_API} is the Ray Jobs API")


def test_workers_get_the_s3_endpoint_and_the_cluster_address(monkeypatch):
    from raytrain.ray_connect import forwarded_env

    for k in ("RAY_JOB_CONFIG_JSON_ENV_VAR", "RAY_SUBMISSION_ID", "AWS_REGION", "AWS_DEFAULT_REGION",
              "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "never-forwarded")
    assert forwarded_env(None) == {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}
    assert forwarded_env("auto") == {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}
    assert forwarded_env("ray://head:10001") == {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}
    assert forwarded_env("127.0.0.1:6379") == {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "RAY_ADDRESS": "127.0.0.1:6379"}
    # Inside `ray job submit` the job's env already carries the S3 settings; the cluster's address still goes to
    # the workers (Ray Train's placement-group cleaner warned every second without it, a demo regression).
    monkeypatch.setenv("RAY_SUBMISSION_ID", "raysubmit_1")
    assert forwarded_env("127.0.0.1:6379") == {"RAY_ADDRESS": "127.0.0.1:6379"}


def test_an_address_nothing_answers_at_is_one_line_at_once(capsys, monkeypatch):
    """Ray's own connect retries for minutes; a closed port is refused in one line before that."""
    import time

    import ray

    from raytrain import ray_connect
    from raytrain.errors import UserError

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    t = time.monotonic()
    with pytest.raises(UserError) as err:
        ray_connect.connect("train", "127.0.0.1:1")
    assert time.monotonic() - t < 10
    assert str(err.value).startswith("scaling.address=127.0.0.1:1: no Ray cluster answers there (")
