"""GPU-only checks (CUDA, NCCL, bf16): the paths the CPU suite (gloo, fp32) never runs.

Skipped, with the reason "needs CUDA", where torch sees no CUDA device. With one GPU they take a few
minutes: batches reach the device through pinned memory; a 1-worker bf16 run whose loss falls and that
logs MFU and accelerator memory; a crash + resume that reproduces an uninterrupted run; an export that
loads and scores on the GPU. With two GPUs, a 2-worker NCCL run also checks every collective raytrain
issues itself (per-step agreement all-reduce, evaluation all-reduce, broadcast_object_list, barrier).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from raytrain import storage
from raytrain.trainer import train
from tests.helpers import tiny_cfg

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _quiet(*_):
    pass


def _metrics(run_uri: str) -> list[dict]:
    return [json.loads(line) for line in storage.read_text(storage.join(run_uri, "metrics.jsonl")).splitlines()]


def _losses(run_uri: str) -> dict[int, float]:
    recs = [r for r in _metrics(run_uri) if "loss" in r]
    steps = [r["step"] for r in recs]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in recs}


def _crcs(run_uri: str) -> dict[int, int]:
    return {r["step"]: r["batch_crc32"] for r in _metrics(run_uri) if "loss" in r}


def _half_dtype() -> torch.dtype:
    # precision.dtype=auto promises bf16 where the GPU has it natively and fp16 on older GPUs; bf16 emulated
    # on fp32 units (what torch.cuda.is_bf16_supported() also counts by default) is not "having it".
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


def gpu_cfg(data, runs, name: str, *overrides: str):
    """tiny_cfg on one GPU worker; micro-batch 8 keeps the CPU tests' global batch of 8 sequences."""
    return tiny_cfg(data, runs, name, "scaling.use_gpu=true", "scaling.num_workers=1", "batch.micro_batch_size=8",
                    *overrides)


@pytest.fixture(scope="module")
def gpu_ray():
    """A Ray cluster that has this machine's GPUs. Ray detects GPUs by itself, so the session cluster of
    tests/conftest.py normally has them; if it was started without, it is replaced for this module and
    started again as conftest does afterwards."""
    import ray

    restore = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) < 1
    if restore:
        ray.shutdown()
    own = not ray.is_initialized()
    if own:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
        ray.init(address="local", num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False,
                 log_to_driver=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    assert gpus >= 1, f"Ray sees {gpus} GPUs although torch sees {torch.cuda.device_count()}"
    yield gpus
    if own:
        ray.shutdown()
    if restore:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)


@pytest.fixture(scope="module")
def falls(gpu_ray, tiny_data, tmp_path_factory):
    """A 40-step 1-GPU run at precision.dtype=auto, evaluated at steps 0, 20 and 40, checkpointed at 20 and 40."""
    runs = tmp_path_factory.mktemp("gpu-runs")
    cfg = gpu_cfg(tiny_data, runs, "gpu-falls", "run.max_steps=40", "run.eval_every=20",
                  "checkpoint.every_n_steps=20")
    summary = train(cfg, log=_quiet)
    return cfg, summary


def test_batches_reach_the_device_through_pinned_memory():
    from raytrain.worker.loop import _to_device

    rows = np.arange(4 * 33, dtype=np.int64).reshape(4, 33)
    dev = torch.device("cuda", torch.cuda.current_device())
    for pin in (True, False):
        x = _to_device(rows, dev, pin)
        torch.cuda.synchronize()  # a non-blocking copy must have landed before it is compared
        assert x.device == dev and x.dtype == torch.int64
        assert torch.equal(x.cpu(), torch.from_numpy(rows))


def test_a_snapshot_copied_from_the_gpu_commits_only_when_finished_and_loads_back_exactly():
    """The GPU path of the memory tier: pinned shared memory, a side stream, checksums computed on the GPU that
    the CPU's reader recomputes alike; the generation reads as invalid until the copy is committed. The file is in
    /dev/shm, as the node actor's are: CUDA may refuse to page-lock a mapping of a disk file (it did on the H200
    machine for pytest's tmp_path), and the copy is then correct but staged."""
    from raytrain.ckpt import snapshot

    dev = torch.device("cuda", torch.cuda.current_device())
    state = {"m": torch.randn(1_000_003, device=dev), "odd": torch.randn(8, device=dev, dtype=torch.bfloat16)[1:],
             "ids": torch.arange(5), "rng": torch.cuda.get_rng_state(), "step": 3, "empty": torch.empty(0, device=dev)}
    skeleton, tensors = snapshot.dump_skeleton(state)
    path = Path(tempfile.mkdtemp(dir="/dev/shm")) / "gen"
    with open(path, "ab") as f:
        f.truncate(snapshot.size_needed(skeleton, tensors))
    mapping = snapshot.Mapping(str(path))
    if not mapping.pinned:
        warnings.warn("cudaHostRegister refused a /dev/shm mapping: GPU snapshots are staged, not direct")
    pending = snapshot.write_from_gpu(mapping, {"step": 3, "world": 1, "rank": 0}, skeleton, tensors,
                                      torch.cuda.Stream(device=dev))
    assert snapshot.read_header(str(path)) is None  # not committed until finish
    header = pending.finish()
    assert snapshot.read_header(str(path)) == header and snapshot.verify(str(path), header)
    snap = snapshot.load(str(path), header)
    assert snap.state["step"] == 3 and snap.state["empty"].numel() == 0
    for key in ("m", "odd", "ids", "rng"):
        assert torch.equal(snap.state[key], state[key].cpu()), key
    mapping.close()
    shutil.rmtree(path.parent)


def test_one_gpu_bf16_run_loss_falls_and_logs_mfu_and_memory(falls):
    from raytrain.worker.telemetry import peak_tflops

    cfg, summary = falls
    recs = [r for r in _metrics(cfg.run_uri) if "loss" in r]
    losses = {r["step"]: r["loss"] for r in recs}
    assert sorted(losses) == list(range(1, 41))
    first, last = losses[1], sum(losses[s] for s in range(36, 41)) / 5
    assert last < 0.5 * first, (first, last)
    assert summary["steps"] == 40 and summary["val_ppl"] < 0.25 * summary["initial_val_ppl"]

    # The precision auto resolved to is what the engine trained in: the saved module weights' dtype.
    engine_dir = os.path.join(storage.resolve(summary["checkpoint"])[1], "engine")
    states = torch.load(os.path.join(engine_dir, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=False)
    assert {v.dtype for v in states["module"].values() if v.is_floating_point()} == {_half_dtype()}

    peak = peak_tflops(cfg, torch.cuda.get_device_name())
    for r in recs:
        assert r["mfu"] > 0 and math.isfinite(r["mfu"]), r
        assert r["mfu"] == pytest.approx(r["tflops_per_worker"] / peak, rel=1e-9)
        assert r["gpu_mem_alloc_gb"] > 0, r
        assert r["gpu_mem_reserved_gb"] >= r["gpu_mem_alloc_gb"], r
        assert r["gpu_mem_peak_gb"] >= r["gpu_mem_alloc_gb"], r
        assert 0 < r["memory_used_frac"] < 1, r
        assert isinstance(r["grad_norm"], float) and 0 < r["grad_norm"] < 1e3, r  # bf16: no overflow, no inf
        assert r["phase_forward_backward_s"] > 0 and r["phase_optimizer_s"] > 0, r
    assert summary["mfu"] == recs[-1]["mfu"] > 0
    assert summary["tokens_per_s"] > 0


def test_crash_and_resume_on_gpu_reproduces_the_uninterrupted_run(gpu_ray, tiny_data, tmp_path):
    """Worker killed at step 6, restarted from checkpoint 4: the same samples per step and the same losses and
    final weights as a run that was never interrupted. Eager attention: SDPA's flash backward accumulates
    with atomics, so two uninterrupted runs already differ slightly with it."""
    from raytrain.export import consolidated_state_dict

    common = ("run.max_steps=12", "checkpoint.every_n_steps=4", "model.attn_implementation=eager")
    base = gpu_cfg(tiny_data, tmp_path, "gpu-baseline", *common)
    train(base, log=_quiet)
    cfg = gpu_cfg(tiny_data, tmp_path, "gpu-crash", *common, "run.max_failures=1", "checkpoint.memory=true")
    summary = train(cfg, log=_quiet, inject={"crash_at_step": 6, "marker": str(tmp_path / "crashed"), "rank": 0})
    assert (tmp_path / "crashed").exists(), "the fault was not injected"
    assert summary["restarts"] == 1 and summary["steps"] == 12
    attempts = [json.loads(x) for x in (tmp_path / "gpu-crash" / "attempts.jsonl").read_text().splitlines()]
    # From host memory: the newest snapshot both ranks hold is step 5's (rank 0 died before copying step 6's).
    assert [a["resumed_step"] for a in attempts] == [0, 5]
    (rec,) = [json.loads(x) for x in (tmp_path / "gpu-crash" / "restores.jsonl").read_text().splitlines()]
    assert rec["source"] == "memory:local" and rec["step"] == 5, rec
    want, got = _losses(base.run_uri), _losses(cfg.run_uri)
    assert sorted(got) == list(range(1, 13))
    assert _crcs(cfg.run_uri) == _crcs(base.run_uri)
    for step in range(1, 13):
        assert got[step] == pytest.approx(want[step], abs=2e-3), step
    a = consolidated_state_dict(storage.join(base.run_uri, "checkpoint_00000012"), 2)
    b = consolidated_state_dict(storage.join(cfg.run_uri, "checkpoint_00000012"), 2)
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-3, worst


def test_export_loads_and_scores_on_the_gpu(falls, tiny_data, tmp_path):
    from transformers import AutoModelForCausalLM

    from raytrain.data.manifest import load_split
    from raytrain.evaluation import eval_rows, loss_sums
    from raytrain.export import export
    from raytrain.worker.evaluate import lm_loss

    cfg, summary = falls
    out = tmp_path / "hf"
    meta = export(summary["checkpoint"], str(out), log=_quiet)
    assert meta["step"] == 40 and meta["params"] == summary["params"]
    model = AutoModelForCausalLM.from_pretrained(str(out)).to("cuda").eval()
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    # Training's own validation rows (1 worker x micro-batch 8 blocks), scored on the GPU and on the CPU.
    rows = eval_rows(load_split(f"{tiny_data}/val"), cfg.data.eval_samples, cfg.batch.micro_batch_size, 1)
    x = torch.from_numpy(np.array(rows, dtype=np.int64)).to("cuda")
    with torch.no_grad():
        gpu_loss = lm_loss(model, x, reduction="sum").item() / x[:, 1:].numel()
    total, count = loss_sums(AutoModelForCausalLM.from_pretrained(str(out)).eval(), rows, cfg.batch.micro_batch_size)
    assert gpu_loss == pytest.approx(total / count, rel=1e-3)
    # The fp32 export against the bf16 engine's own evaluation at the same step: same model, 16-bit rounding apart.
    assert gpu_loss == pytest.approx(summary["val_loss"], abs=5e-2)
    assert math.exp(gpu_loss) < 0.25 * summary["initial_val_ppl"]  # a trained model, not its init
    with torch.no_grad():
        gen = model.generate(input_ids=x[:1, :8], max_new_tokens=4, do_sample=False)
    assert gen.device.type == "cuda" and gen.shape[1] > 8 and torch.equal(gen[0, :8], x[0, :8])


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_workers_nccl_sigterm_checkpoint_and_resume(gpu_ray, tiny_data, tmp_path):
    """Every collective raytrain issues itself, on NCCL: the per-step agreement all-reduce (a SIGTERM to rank 1
    at step 7 must make both ranks checkpoint at the same step), the barrier before the signalled rank leaves,
    broadcast_object_list (save token, resume point), the evaluation and loss all-reduces; then the resume."""
    if gpu_ray < 2:
        pytest.skip("needs 2 GPUs in the Ray cluster")
    cfg = tiny_cfg(tiny_data, tmp_path, "gpu-nccl", "scaling.use_gpu=true", "run.max_steps=12", "run.eval_every=6",
                   "checkpoint.every_n_steps=100", "run.max_failures=1")
    summary = train(cfg, log=_quiet, inject={"events": [{"step": 7, "rank": 1, "signal": "SIGTERM"}],
                                             "marker": str(tmp_path / "term")})
    assert (tmp_path / "term.0").exists(), "the signal was not sent"
    recs = _metrics(cfg.run_uri)
    noticed = [r["step"] for r in recs if r.get("preemption_checkpoint")]
    assert noticed and noticed[0] in (7, 8), noticed
    attempts = [json.loads(x) for x in (tmp_path / "gpu-nccl" / "attempts.jsonl").read_text().splitlines()]
    assert [a["resumed_step"] for a in attempts] == [0, noticed[0]]
    assert summary["restarts"] == 1 and summary["steps"] == 12
    losses = _losses(cfg.run_uri)
    assert sorted(losses) == list(range(1, 13)) and all(math.isfinite(v) for v in losses.values())
    vals = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    assert {0, 6, 12} <= set(vals) and vals[12] < vals[0]
