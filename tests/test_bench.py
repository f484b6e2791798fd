"""The benchmark suite (scripts/bench.py, scripts/benchkit) at tiny sizes, so it cannot rot.

What is checked is that each part measures what it says beside its baseline and reports consistent
figures - never speed itself (speed is judged by the benchmark's own ratios, not by timed tests).
"""

import hashlib
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from raytrain import storage
from raytrain.ckpt import catalog
from raytrain.data.manifest import load_split
from raytrain.data.sample_plan import SamplePlan
from raytrain.data.reader import read_rows

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # the benchmark harness (scripts/benchkit) is not part of the package

from benchkit import parts as P  # noqa: E402


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
    save, restore, plain_save, stall = figs
    for f in figs:
        _complete(f)
    assert [f["name"] for f in figs] == ["save MB/s via raytrain.storage", "restore MB/s via raytrain.storage",
                                         "save MB/s, both clients with AWS_REQUEST_CHECKSUM_CALCULATION=when_required",
                                         "training stall of an async-upload save"]
    assert save["bytes"] == restore["bytes"] == plain_save["bytes"] >= 6 << 20
    assert save["value"] == max(save["runs"]) and restore["baseline_value"] == max(restore["baseline_runs"])
    assert "AWS_REQUEST_CHECKSUM_CALCULATION" not in os.environ  # the decomposition leaves the setting as it was
    # The async save returns once the local copy is written; the sync one after the upload and commit too.
    assert stall["value"] < stall["baseline_value"]
    # Nothing left behind in the bucket: each measurement cleans up after itself.
    assert storage.list_dir("s3://raytrain-test/bench-test") == []
    assert catalog.latest_complete("s3://raytrain-test/bench-test/stall-async") is None


@pytest.mark.slow
def test_ingest_part_reads_the_same_samples_as_raw(tiny_data):
    # Part 1's training records, as metrics.jsonl holds them: the first (warm-up) window is left out.
    runs = {2: [{"tokens_per_s": 10.0, "data_wait_frac": 0.5}, {"tokens_per_s": 100.0, "data_wait_frac": 0.002},
                {"tokens_per_s": 110.0, "data_wait_frac": 0.004}, {"tokens_per_s": 90.0, "data_wait_frac": 0.02}]}
    figs = P.ingest(str(tiny_data), epochs=2, train_runs=runs, log=lambda *_: None)
    reader_fig, wait = figs
    _complete(reader_fig)
    split = load_split(f"{tiny_data}/train")
    plan = SamplePlan.for_split(split, seed=0, global_batch=64)
    steps = 2 * plan.steps_per_epoch
    assert reader_fig["samples"] == steps * 64
    # What it timed is the plan's order: the same rows as a raw read indexed by the plan's sample ids.
    rows = read_rows(split, 0, split.num_samples).astype(np.int32)  # the reader hands out int32 token ids
    want = hashlib.sha256()
    for t in range(1, steps):
        want.update(rows[plan.step(t).ids].tobytes())
    assert reader_fig["sha256"] == want.hexdigest()
    assert wait["value"] == pytest.approx(0.004) and wait["max_window"] == 0.02 and wait["met"] is True


def test_steady_state_is_the_fastest_window_after_warm_up():
    assert P.steady([20.0, 10.0, 12.0, 11.0]) == 12.0
    assert P.steady([5.0]) == 5.0


def test_snapshot_ab_windows_alternate_and_start_with_snapshots_on():
    from raytrain.faults import Faults

    ab = Faults({"snapshot_ab_window": 3}, rank=1, global_batch=8)
    assert [s for s in range(1, 15) if ab.snapshots_paused(s)] == [4, 5, 6, 10, 11, 12]
    assert not any(Faults(None, rank=0, global_batch=8).snapshots_paused(s) for s in range(1, 15))


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


# ------------------------------------------------ a "baseline" is only ever a figure measured in the same run

# What used to stand in baseline cells without being measured: targets, settings, N, 1.0.
_CONSTANT_BASELINE = re.compile(r"^(target|checkpoint interval|before the plan|one split|step time$)", re.I)
_NUMBER = re.compile(r"^\d[\d,]*(\.\d+)?(\s|%|$)")


def _tables(text: str):
    """(first line number, header cells, rows of cells) of every Markdown table in `text`."""
    lines, i = text.splitlines(), 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        j = i
        while j < len(lines) and lines[j].startswith("|"):
            j += 1
        cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[i:j]]
        yield i + 1, cells[0], [r for r in cells[2:] if len(r) == len(cells[0])]
        i = j


def _baseline_cells_are_measured(text: str) -> list[str]:
    """Every table's "baseline" columns: a value column holds a number or "-", a label column names a measured
    figure (no target or constant) and has a value exactly where it has a label. Returns the offences."""
    bad = []
    for line, head, rows in _tables(text):
        cols = [k for k, h in enumerate(head) if "baseline" in h.lower()]
        values = [k for k in cols if "value" in head[k].lower()]
        labels = [k for k in cols if k not in values]
        for r in rows:
            for k in values:
                if r[k] != "-" and not _NUMBER.match(r[k]):
                    bad.append(f"table at line {line}: baseline value {r[k]!r} is not a number or '-'")
            for k in labels:
                if _CONSTANT_BASELINE.match(r[k]):
                    bad.append(f"table at line {line}: baseline {r[k]!r} is a target or constant, not measured")
                if values and (r[k] == "-") != (r[values[0]] == "-"):
                    bad.append(f"table at line {line}: baseline {r[k]!r} / value {r[values[0]]!r}: one without the other")
                if not values and r[k] != "-" and not re.search(r"\d", r[k]):
                    bad.append(f"table at line {line}: baseline {r[k]!r} holds no measured figure")
    return bad


def test_figure_takes_only_a_measured_baseline_and_keeps_targets_and_constants_apart():
    with pytest.raises(TypeError, match="not marked measured"):
        P.figure("x", "steps lost", 3, "steps", "checkpoint interval", 10)  # a setting is not a baseline
    with pytest.raises(TypeError, match="not marked measured"):
        P.figure("x", "data wait", 0.001, "fraction", "target", 0.01)
    with pytest.raises(ValueError, match="ratio"):
        P.figure("x", "data wait", 0.001, "fraction", target="<= 0.01", ratio=0.1)  # no ratio against a target
    amp = P.figure("dataplane", "read amplification, N=8", 1.002, "x", target="<= 1.1",
                   reference="before the plan: 8 (every worker read the global stream)", met=True)
    assert amp["baseline_value"] is None and amp["ratio"] is None and amp["reference"].startswith("before the plan: 8")
    stall = P.figure("3 checkpoint", "training stall", 0.05, "s", "sync-upload save", P.measured(1.0), target="<= 0.10")
    assert isinstance(stall["baseline_value"], P.Measured) and stall["ratio"] == pytest.approx(0.05)
    assert json.loads(json.dumps(stall))["baseline_value"] == 1.0  # JSON as a plain number


def test_bench_table_puts_only_measured_figures_in_baseline_cells():
    bench = _script()
    figs = [P.figure("2 ingest", "data wait, fraction of step time (1 worker)", 0.0004, "fraction", target="<= 0.01",
                     met=True),
            P.figure("4 recovery", "steps lost (redone after the kill)", 4, "steps", target="< checkpoint interval (10)",
                     met=True),
            P.figure("dataplane", "read amplification, N=64, gb=512", 1.0005, "x", target="<= 1.1",
                     reference="before the plan: 64 (every worker read the global stream)", met=True),
            P.figure("1 overhead", "raytrain loop's own work per step", 0.31, "ms", "step time, same windows (median)",
                     P.measured(70.5), target="(decomposition)"),
            P.figure("3 checkpoint", "training stall of an async-upload save", 0.05, "s", "sync-upload save",
                     P.measured(1.01), target="<= 0.10", met=True),
            P.figure("5 gpu", "MFU (skipped: no CUDA device)", None, "", "plain PyTorch + DeepSpeed", None)]
    results = {"versions": {"python": "3"}, "date": "today", "machine": "m", "load_before": "0", "load_after": "0",
               "wall_s": 1.0, "figures": figs}
    text = bench.markdown(results, "scripts/bench.py")
    assert _baseline_cells_are_measured(text) == []
    (_, head, rows), = list(_tables(text))
    col = {h.split(" (")[0]: k for k, h in enumerate(head)}
    by_name = {r[col["figure"]]: r for r in rows}
    for name in ("data wait, fraction of step time (1 worker)", "steps lost (redone after the kill)",
                 "read amplification, N=64, gb=512", "MFU (skipped: no CUDA device)"):
        r = by_name[name]
        assert (r[col["baseline"]], r[col["baseline value"]], r[col["ratio"]]) == ("-", "-", "-"), r
    assert by_name["read amplification, N=64, gb=512"][col["target / reference"]] == \
        "<= 1.1; before the plan: 64 (every worker read the global stream)"
    assert by_name["steps lost (redone after the kill)"][col["target / reference"]] == "< checkpoint interval (10)"
    own = by_name["raytrain loop's own work per step"]
    assert (own[col["baseline value"]], own[col["ratio"]]) == ("70.5", "0.004")


def test_every_figure_call_passes_a_measured_baseline_or_none():
    """Statically, so the parts no fast test runs (GPU, memory, serve) are covered too: a figure's baseline value
    is absent, None, or measured(<an expression of this run>), never a literal or a cast of a setting (float(n))."""
    import ast

    files = [ROOT / "scripts" / "bench.py", *sorted((ROOT / "scripts" / "benchkit").glob("*.py"))]
    calls = 0
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "figure"):
                continue
            calls += 1
            arg = node.args[5] if len(node.args) > 5 else next(
                (k.value for k in node.keywords if k.arg == "baseline_value"), None)
            where = f"{path.name}:{node.lineno}"
            if arg is None or (isinstance(arg, ast.Constant) and arg.value is None):
                continue
            assert isinstance(arg, ast.Call) and getattr(arg.func, "id", None) == "measured", \
                f"{where}: baseline value {ast.unparse(arg)} is not measured(...)"
            (inner,) = arg.args
            assert not isinstance(inner, ast.Constant), f"{where}: measured({ast.unparse(inner)}) is a constant"
            assert not (isinstance(inner, ast.Call) and getattr(inner.func, "id", None) in ("float", "int")), \
                f"{where}: measured({ast.unparse(inner)}) is a cast of a setting, not a measurement"
    assert calls >= 20, calls  # the scan found the parts' figures


def test_benchmarks_doc_tables_hold_only_measured_baselines_and_no_removed_code():
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert _baseline_cells_are_measured(text) == []
    # SampleStream (removed in issue 16) appears only as labelled history: under a "Removed code" heading, or on
    # a line that says it is removed; never in a current-looking table or figure.
    heading = ""
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            heading = line
        if "SampleStream" in line:
            assert "removed" in heading.lower() or "removed" in line.lower(), f"line {n}: {line}"


@pytest.mark.slow
def test_plain_baselines_log_one_window_per_interval(tiny_data, tmp_path):
    """Part 1's baselines (plain loop, the same loop driving 3653663's DeepSpeed config, and DeepSpeed with raytrain's
    own step path: 1 and 2 processes) at tiny size: one window per interval, and the loss falls."""
    from benchkit.baselines import plain_loop

    cfg = P.train_cfg(str(tiny_data), str(tmp_path), "baseline", 1, 6, 2, "model.n_layer=1", "model.hidden_size=32",
                      "model.n_head=2", "model.seq_len=32", "batch.micro_batch_size=4")
    split = load_split(f"{tiny_data}/train").to_dict()
    for use_deepspeed in (False, True):
        windows = plain_loop(cfg, split, str(tmp_path / f"ds-{use_deepspeed}.json"), use_deepspeed=use_deepspeed)
        assert len(windows) == 3 and all(w > 0 for w in windows), windows
    from benchkit.baselines import plain_run

    for workers in (1, 2):
        c = cfg.model_copy(update={"scaling": cfg.scaling.model_copy(update={"num_workers": workers})})
        got = plain_run(c, split, str(tmp_path / f"kernels-{workers}.json"), kernels=True)
        assert len(got["tokens_per_s_windows"]) == 3 and all(w > 0 for w in got["tokens_per_s_windows"]), got
        assert got["losses"][-1] < got["losses"][0], got["losses"]


# ------------------------------------------------------------- the optimisations the figures call for

def test_gpu_only_optimisations_are_selected_only_with_cuda():
    """Fused AdamW everywhere (torch's kernel on CPU, no JIT build); DeepSpeed's Adams and pinned memory only
    where CUDA is; on CPU in-place batches."""
    import numpy as np

    from raytrain.config import load_config
    from raytrain.ds_config import build_ds_config
    from raytrain.worker.loop import _to_device

    def adam(cuda, *overrides):
        cfg = load_config("tiny", ["data.train=/nowhere", *overrides])
        return {k: v for k, v in build_ds_config(cfg, 1, "bf16" if cuda else "fp32", cuda)["optimizer"]["params"].items()
                if k in ("torch_adam", "fused", "foreach")}

    assert adam(False) == adam(False, "optim.fused=deepspeed") == {"torch_adam": True, "fused": True}
    assert adam(False, "optim.fused=none") == {"torch_adam": True, "fused": False}
    assert adam(True) == {"torch_adam": True, "fused": True}  # torch's fused kernel: no JIT build
    assert adam(True, "optim.fused=none") == {"torch_adam": True, "foreach": True}
    assert adam(True, "optim.fused=deepspeed") == {}  # DeepSpeed's FusedAdam
    assert adam(True, "deepspeed.offload_optimizer=cpu") == {}  # DeepSpeed's CPU Adam runs offloaded steps
    # On CPU, offloaded state is stepped by torch's AdamW: no ~70 s JIT build of DeepSpeed's CPU Adam.
    assert adam(False, "deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu") == {"torch_adam": True,
                                                                                        "fused": True}
    cfg = load_config("tiny", ["data.train=/nowhere", "deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"])
    assert build_ds_config(cfg, 1, "fp32", False)["zero_force_ds_cpu_optimizer"] is False
    assert "zero_force_ds_cpu_optimizer" not in build_ds_config(cfg, 1, "bf16", True)
    rows = np.arange(2 * 9, dtype=np.int64).reshape(2, 9)
    for pin in (True, False):
        x = _to_device(rows, torch.device("cpu"), pin)
        assert x.data_ptr() == rows.ctypes.data and not x.is_pinned()  # CPU: the stream's memory, no copy


def test_attention_is_sdpa_by_default():
    from raytrain.config import load_config
    from raytrain.model import build_model

    cfg = load_config("tiny", ["data.train=/nowhere", "model.n_layer=1", "model.hidden_size=32", "model.n_head=2"])
    for family in ("gpt2", "llama"):
        m = build_model(cfg.model.model_copy(update={"family": family}), 64, 0)
        assert m.config._attn_implementation == "sdpa"
