"""The benchmark suite (scripts/bench.py, raytrain/bench) at tiny sizes, so it cannot rot.

What is checked is that each part measures what it says beside its baseline and reports consistent
figures - never speed itself (speed is judged by the benchmark's own ratios, not by timed tests).
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from raytrain import checkpoints, storage
from raytrain.bench import parts as P
from raytrain.data.manifest import load_split

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("raytrain_bench_script", ROOT / "scripts" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _complete(f: dict) -> None:
    assert f["value"] > 0 and f["baseline_value"] > 0, f
    assert f["ratio"] == pytest.approx(f["value"] / f["baseline_value"]), f


def test_checkpoint_part_against_boto3(s3_server, tmp_path):
    figs = P.checkpoint(str(tmp_path), "raytrain-test", 6 << 20, reps=1, log=lambda *_: None, prefix="bench-test")
    save, restore, stall = figs
    for f in figs:
        _complete(f)
    assert [f["name"] for f in figs] == ["save MB/s via raytrain.storage", "restore MB/s via raytrain.storage",
                                         "training stall of an async-upload save"]
    assert save["bytes"] == restore["bytes"] >= 6 << 20
    # The async save returns once the local copy is written; the sync one after the upload and commit too.
    assert stall["value"] < stall["baseline_value"]
    # Nothing left behind in the bucket: each measurement cleans up after itself.
    assert storage.list_dir("s3://raytrain-test/bench-test") == []
    assert checkpoints.latest_complete("s3://raytrain-test/bench-test/stall-async") is None


@pytest.mark.slow
def test_ingest_part_reads_the_same_samples_as_raw(ray_cluster, tiny_data):
    # Part 1's training records, as metrics.jsonl holds them: the first (warm-up) window is left out.
    runs = {2: [{"tokens_per_s": 10.0, "data_wait_frac": 0.5}, {"tokens_per_s": 100.0, "data_wait_frac": 0.002},
                {"tokens_per_s": 110.0, "data_wait_frac": 0.004}, {"tokens_per_s": 90.0, "data_wait_frac": 0.02}]}
    figs = P.ingest(str(tiny_data), epochs=2, train_runs=runs, log=lambda *_: None)
    ray_fig, plain_fig, wait = figs
    for f in (ray_fig, plain_fig):
        _complete(f)
        assert f["samples"] == 2 * load_split(f"{tiny_data}/train").num_samples
    assert ray_fig["sha256"] == plain_fig["sha256"]  # both readers delivered the same global order
    assert wait["value"] == pytest.approx(0.004) and wait["max_window"] == 0.02 and wait["met"] is True


def test_steady_state_is_the_fastest_window_after_warm_up():
    assert P.steady([20.0, 10.0, 12.0, 11.0]) == 12.0
    assert P.steady([5.0]) == 5.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path is for machines without CUDA")
def test_script_writes_json_and_markdown_and_skips_gpu_cleanly(tmp_path, capsys):
    out = tmp_path / "bench.json"
    results = _script().main(["--parts", "gpu", "--json", str(out), "--markdown"])
    saved = json.loads(out.read_text())
    assert saved["figures"] == results["figures"] and saved["versions"]["torch"] == torch.__version__
    (gpu,) = saved["figures"]
    assert gpu["skipped"] == "no CUDA device" and gpu["value"] is None
    text = capsys.readouterr().out
    assert "skipped: no CUDA device" in text and "| 5 gpu | MFU (skipped: no CUDA device) |" in text


def test_script_rejects_unknown_parts():
    with pytest.raises(SystemExit):
        _script().main(["--parts", "overhead,warp"])


@pytest.mark.slow
def test_plain_baselines_log_one_window_per_interval(tiny_data, tmp_path):
    """Part 1's baselines (plain loop, and the same loop driving raytrain's DeepSpeed config) at tiny size."""
    from raytrain.bench.baselines import plain_loop

    cfg = P.train_cfg(str(tiny_data), str(tmp_path), "baseline", 1, 6, 2, "model.n_layer=1", "model.hidden_size=32",
                      "model.n_head=2", "model.seq_len=32", "batch.micro_batch_size=4")
    split = load_split(f"{tiny_data}/train").to_dict()
    for use_deepspeed in (False, True):
        windows = plain_loop(cfg, split, str(tmp_path / f"ds-{use_deepspeed}.json"), use_deepspeed=use_deepspeed)
        assert len(windows) == 3 and all(w > 0 for w in windows), windows
