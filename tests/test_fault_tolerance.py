"""Fault tolerance of the checkpoint path: storage outages during upload, async vs sync upload.

The upload and commit run for real against a private S3-protocol server (moto) on 127.0.0.1 that
the test can freeze with SIGSTOP, as if the store stopped answering mid-upload. The DeepSpeed
engine is replaced by a stand-in that writes files of a chosen size: what is under test is what
happens to them afterwards.
"""

import os
import signal

import pytest

from raytrain import storage
from raytrain.ckpt import catalog
from raytrain.config import Config
from raytrain.errors import UserError
from raytrain.ckpt.state import TrainState
from raytrain.ckpt.writer import CheckpointWriter
from tests.helpers import start_moto


class _Engine:
    """Stands in for DeepSpeed's engine.save_checkpoint: one file of `size` random bytes."""

    def __init__(self, size: int):
        self.size = size

    def save_checkpoint(self, d, tag):
        os.makedirs(os.path.join(d, tag), exist_ok=True)
        with open(os.path.join(d, tag, "model_states.pt"), "wb") as f:
            f.write(os.urandom(self.size))


@pytest.fixture
def frozen_s3(monkeypatch):
    """A private moto server; the test freezes it with SIGSTOP. Short client timeouts keep the test quick."""
    proc, endpoint = start_moto()
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                 "RAYTRAIN_S3_CONNECT_TIMEOUT": "1", "RAYTRAIN_S3_REQUEST_TIMEOUT": "2",
                 "RAYTRAIN_S3_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(k, v)
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="outage")
    yield proc
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    proc.wait(timeout=10)


def _writer(mode: str, on_failure: str = "warn", run_uri: str = "s3://outage/run") -> CheckpointWriter:
    c = Config().checkpoint.model_copy(update={"upload": mode, "on_upload_failure": on_failure, "upload_retries": 0,
                                               "commit_timeout_s": 5.0, "keep_last": 5})
    return CheckpointWriter(c, run_uri=run_uri, rank=0, world=1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_store_stopped_during_upload_leaves_no_registered_checkpoint(frozen_s3, mode):
    w = _writer(mode)
    w.save(_Engine(1000), TrainState(step=5, world_size=1), "x: 1\n")
    w.wait()
    assert catalog.latest_complete("s3://outage/run").step == 5

    if mode == "async":
        w.save(_Engine(64 << 20), TrainState(step=10, world_size=1), "x: 1\n")
        os.kill(frozen_s3.pid, signal.SIGSTOP)  # the upload of step 10 is under way in the background
    else:
        os.kill(frozen_s3.pid, signal.SIGSTOP)
        w.save(_Engine(64 << 20), TrainState(step=10, world_size=1), "x: 1\n")
    w.wait()  # warn mode: no exception, training would go on
    assert w.failed == ["checkpoint_00000010"] and w.committed == "checkpoint_00000005"
    os.kill(frozen_s3.pid, signal.SIGCONT)

    assert catalog.latest_complete("s3://outage/run").step == 5
    info = catalog.verify("s3://outage/run/checkpoint_00000010")
    assert not info.complete and "no manifest" in info.reason
    # The store is back: the next checkpoint commits normally.
    w.save(_Engine(1000), TrainState(step=15, world_size=1), "x: 1\n")
    w.wait()
    assert catalog.latest_complete("s3://outage/run").step == 15


@pytest.mark.slow
def test_upload_failure_stops_the_run_when_configured(frozen_s3):
    w = _writer("sync", on_failure="stop")
    os.kill(frozen_s3.pid, signal.SIGSTOP)
    with pytest.raises(UserError, match="could not upload checkpoint checkpoint_00000003.*on_upload_failure=stop"):
        w.save(_Engine(1000), TrainState(step=3, world_size=1), "x: 1\n")
    os.kill(frozen_s3.pid, signal.SIGCONT)
    assert catalog.latest_complete("s3://outage/run") is None


@pytest.mark.slow
def test_async_upload_stalls_training_only_for_the_local_write(frozen_s3):
    """The async save returns while the store is frozen (only the local write is in front of training) and
    commits once the store answers again; the sync save returns only after the commit."""
    w = _writer("sync", run_uri="s3://outage/sync")
    w.save(_Engine(1 << 20), TrainState(step=1, world_size=1), "x: 1\n")
    assert w.committed == "checkpoint_00000001"  # no wait(): the save itself uploaded and committed

    w = _writer("async", run_uri="s3://outage/async")
    os.kill(frozen_s3.pid, signal.SIGSTOP)
    try:
        w.save(_Engine(1 << 20), TrainState(step=1, world_size=1), "x: 1\n")
        assert w.committed is None  # returned with the upload still in front of the frozen store
    finally:
        os.kill(frozen_s3.pid, signal.SIGCONT)
    w.wait()
    assert w.committed == "checkpoint_00000001" and not w.failed
    assert catalog.latest_complete("s3://outage/async").step == 1


def test_stale_markers_of_an_earlier_attempt_never_commit(tmp_path):
    """A crashed attempt left its upload markers; a new save of the same step must not count them."""
    run = str(tmp_path / "run")
    stale = storage.join(run, "checkpoint_00000004", "_uploaded", "rank_00001.json")
    storage.write_text(stale, '{"token": "old", "files": {}}')
    c = Config().checkpoint.model_copy(update={"upload": "sync", "commit_timeout_s": 1.0})
    w = CheckpointWriter(c, run_uri=run, rank=0, world=2)  # rank 1 of this attempt never uploads
    w.save(_Engine(10), TrainState(step=4, world_size=2), "x: 1\n")
    assert w.committed is None and w.failed == ["checkpoint_00000004"]
    assert catalog.latest_complete(run) is None


def test_each_rank_reads_its_partitions_and_killed_staging_is_removed(tmp_path):
    """Restore reads: a rank's own partitions and the shared files, everything for a resize. Staging left by
    a killed process (its pid is gone) is removed at the next start; a live process's is kept."""
    import subprocess
    import sys

    from raytrain.ckpt.node_cache import remove_stale
    from raytrain.ckpt.restore import files_for_rank

    files = {f: {} for f in ["engine/mp_rank_00_model_states.pt", "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                             "engine/zero_pp_rank_1_mp_rank_00_optim_states.pt",
                             "engine/zero_pp_rank_1_mp_rank_00_model_states.pt", "engine/zero_pp_rank_11_mp_rank_00_"
                             "optim_states.pt", "rng/rank_00001.pt", "rng/rank_00011.pt", "raytrain_state.json",
                             "config.yaml", "universal/engine_universal/zero/rank_1.pt"]}
    assert files_for_rank(files, 1, 12, 12) == sorted([
        "engine/mp_rank_00_model_states.pt", "engine/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "engine/zero_pp_rank_1_mp_rank_00_model_states.pt", "rng/rank_00001.pt", "raytrain_state.json", "config.yaml",
        "universal/engine_universal/zero/rank_1.pt"])
    assert files_for_rank(files, 1, 4, 12) == sorted(files)  # resized: the converter reads every partition
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    for d in (tmp_path / "restore" / "n1-abc" / ".users" / str(dead_pid), tmp_path / "staging" / f"{dead_pid}-rank0",
              tmp_path / "restore" / "n1-def" / ".users" / str(os.getpid()), tmp_path / "staging" / f"{os.getpid()}-rank1"):
        d.mkdir(parents=True)
    remove_stale(str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "restore").iterdir()) == ["n1-def"]
    assert sorted(p.name for p in (tmp_path / "staging").iterdir()) == [f"{os.getpid()}-rank1"]
