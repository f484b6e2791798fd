"""Bad input to `raytrain train` fails fast with one line naming the problem, before any worker starts,
and leaves no checkpoint behind."""

import json
import shutil
import subprocess
import sys

import pytest

from raytrain.errors import UserError
from raytrain.trainer import train
from tests.helpers import tiny_cfg


def _copy(data, tmp_path):
    """A private copy of the prepared dataset to damage."""
    broken = tmp_path / "broken"
    shutil.copytree(data, broken)
    return broken


def _no_checkpoints(root):
    return not list(root.rglob("checkpoint_*"))


def test_missing_data_path(tmp_path):
    with pytest.raises(UserError, match="dataset not found at .*nowhere"):
        train(tiny_cfg(tmp_path / "nowhere", tmp_path / "runs", "x"))
    assert _no_checkpoints(tmp_path)


def test_unfinished_dataset_without_manifest(tmp_path, tiny_data):
    broken = _copy(tiny_data, tmp_path)
    (broken / "train" / "manifest.json").unlink()
    with pytest.raises(UserError, match="has no manifest.json"):
        train(tiny_cfg(broken, tmp_path / "runs", "x"))


def test_missing_shard(tmp_path, tiny_data):
    broken = _copy(tiny_data, tmp_path)
    (broken / "train" / "shard-00000.parquet").unlink()
    with pytest.raises(UserError, match="shard-00000.parquet listed in the manifest is missing"):
        train(tiny_cfg(broken, tmp_path / "runs", "x"))


def test_empty_dataset(tmp_path, tiny_data):
    empty = tmp_path / "empty"
    shutil.copytree(tiny_data, empty)
    m = json.loads((empty / "train" / "manifest.json").read_text())
    m["shards"], m["num_samples"] = [], 0
    (empty / "train" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="is empty"):
        train(tiny_cfg(empty, tmp_path / "runs", "x"))
    assert _no_checkpoints(tmp_path)


def test_micro_batch_larger_than_data(tmp_path, tiny_data):
    with pytest.raises(UserError, match="batch.micro_batch_size=100000 is larger than data.train"):
        train(tiny_cfg(tiny_data, tmp_path / "runs", "x", "batch.micro_batch_size=100000"))
    assert _no_checkpoints(tmp_path)


def test_seq_len_mismatch(tmp_path, tiny_data):
    with pytest.raises(UserError, match="packed for seq_len=32 but model.seq_len=64"):
        train(tiny_cfg(tiny_data, tmp_path / "runs", "x", "model.seq_len=64"))


def test_unreachable_storage(tmp_path, tiny_data, monkeypatch):
    # Nothing listens on port 9 of loopback: the storage probe must fail quickly and clearly.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    with pytest.raises(UserError, match="cannot write s3://nobucket/runs"):
        train(tiny_cfg(tiny_data, "s3://nobucket/runs", "x"))


def test_missing_bucket(s3_server, tmp_path, tiny_data):
    with pytest.raises(UserError, match="s3://no-such-bucket"):
        train(tiny_cfg(tiny_data, "s3://no-such-bucket/runs", "x"))


def test_cli_reports_one_line_and_nonzero_exit(tmp_path):
    r = subprocess.run([sys.executable, "-m", "raytrain", "train", "--config", "tiny",
                        f"data.train={tmp_path}/missing", f"checkpoint.storage={tmp_path}/runs"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"raytrain: error: data.train: dataset not found at {tmp_path}/missing "
                                             "(run `raytrain prepare` first, or fix the path)"]


def test_jobs_api_address_is_explained(tmp_path, tiny_data, monkeypatch):
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray session is already connected in this process")
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    with pytest.raises(UserError, match="Ray Jobs API address"):
        train(tiny_cfg(tiny_data, tmp_path / "runs", "x"))


def test_negative_seed_is_a_config_error():
    from raytrain.config import load_config

    with pytest.raises(UserError, match="run.seed"):
        load_config("tiny", ["run.seed=-1"])


def test_corrupt_shard_caught_by_checksum(tmp_path, tiny_data):
    broken = _copy(tiny_data, tmp_path)
    shard = broken / "train" / "shard-00000.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes: only the checksum can tell
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match="shard-00000.parquet is corrupt"):
        train(tiny_cfg(broken, tmp_path / "runs", "x", "data.verify=checksum"))
    assert _no_checkpoints(tmp_path)


def test_gpu_run_with_cpu_offload_on_one_thread_is_warned(ray_cluster, tiny_data, tmp_path, capsys):
    from raytrain.trainer import check_cluster

    cfg = tiny_cfg(tiny_data, tmp_path / "runs", "x", "scaling.use_gpu=true", "deepspeed.zero_stage=2",
                   "deepspeed.offload_optimizer=cpu")
    check_cluster(cfg, local=False)  # a real cluster: missing GPUs are a warning (its autoscaler may add them)
    out = capsys.readouterr().out
    assert "deepspeed.offload_optimizer=cpu runs the optimizer step on 1 CPU thread(s) per worker" in out
    assert "the run needs 2 GPU" in out
    check_cluster(tiny_cfg(tiny_data, tmp_path / "runs", "x", "scaling.cpus_per_worker=1"), local=False)
    assert "offload" not in capsys.readouterr().out
