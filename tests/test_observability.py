"""The repo's alerting rules pass promtool, the Grafana dashboard only queries metrics raytrain exports,
and `raytrain report` draws a readable PNG and a Markdown summary."""

import json
import math
import re
import subprocess
from pathlib import Path

import pytest

from raytrain.cli import main
from raytrain.serving.app import SERVING_METRICS
from raytrain.worker.metrics import CATALOGUE
from tests.helpers import ensure_prometheus

OBS = Path(__file__).resolve().parent.parent / "observability"


def _metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b(?:raytrain|model)_[a-zA-Z0-9_]*", expr))
    # A histogram is queried through its _bucket series.
    return {n[:-len("_bucket")] if n[:-len("_bucket")] in SERVING_METRICS else n for n in names}


def test_alert_rules_pass_promtool_and_name_exported_metrics():
    _, promtool = ensure_prometheus()
    out = subprocess.run([promtool, "check", "rules", str(OBS / "alerts.yml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 12 rules found" in out.stdout
    import yaml

    from raytrain.goodput_gauges import GAUGES

    exported = set(CATALOGUE) | set(GAUGES)  # the workers' series and the driver's goodput ledger
    rules = yaml.safe_load((OBS / "alerts.yml").read_text())["groups"][0]["rules"]
    for r in rules:
        names = _metric_names(r["expr"])
        assert names and names <= exported, (r["alert"], names - exported)
    # The PRODUCT.md thresholds are what the GPU rules say.
    exprs = {r["alert"]: r["expr"] for r in rules}
    assert "< 0.8e12" in exprs["RaytrainLowThroughput"] and "> 1" in exprs["RaytrainGradNormHigh"]
    assert "< 1e-5" in exprs["RaytrainGradNormLow"] and ">= 0.95" in exprs["RaytrainMemoryHigh"]


def test_serving_alert_rules_pass_promtool_with_the_launch_thresholds():
    _, promtool = ensure_prometheus()
    out = subprocess.run([promtool, "check", "rules", str(OBS / "serving-alerts.yml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 3 rules found" in out.stdout
    import yaml

    rules = {r["alert"]: r for r in yaml.safe_load((OBS / "serving-alerts.yml").read_text())["groups"][0]["rules"]}
    for r in rules.values():
        names = _metric_names(r["expr"])
        assert names and names <= SERVING_METRICS, (r["alert"], names - SERVING_METRICS)
    # QPS drop of half against an hour earlier; errors above 1 % for 10 min; P99 above 500 ms for 10 min.
    assert "<= 0.5 *" in rules["ModelQpsDrop"]["expr"] and "offset 1h" in rules["ModelQpsDrop"]["expr"]
    assert "> 0.01" in rules["ModelErrorRateHigh"]["expr"] and rules["ModelErrorRateHigh"]["for"] == "10m"
    assert "histogram_quantile(0.99" in rules["ModelLatencyP99High"]["expr"]
    assert "> 500" in rules["ModelLatencyP99High"]["expr"] and rules["ModelLatencyP99High"]["for"] == "10m"


def test_scrape_config_is_valid_and_strips_rays_prefix(tmp_path):
    _, promtool = ensure_prometheus()
    # promtool resolves rule_files relative to the config, and file_sd files need not exist.
    out = subprocess.run([promtool, "check", "config", str(OBS / "prometheus.yml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    text = (OBS / "prometheus.yml").read_text()
    assert 'regex: "ray_(raytrain_.*)"' in text and 'regex: "ray_(model_.*)"' in text


def test_dashboard_panels_query_exported_metrics():
    dash = json.loads((OBS / "grafana-dashboard.json").read_text())
    titles = [p["title"] for p in dash["panels"]]
    for want in ("Loss", "Perplexity", "Tokens/s", "MFU", "Gradient norm", "Memory", "Restarts"):
        assert any(t.startswith(want) for t in titles), want
    assert "Serving (raytrain serve)" in [p["title"] for p in dash["panels"] if p["type"] == "row"]
    used = set()
    exported = set(CATALOGUE) | SERVING_METRICS
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        for t in p["targets"]:
            names = _metric_names(t["expr"])
            assert names, (p["title"], t["expr"])
            assert names <= exported, (p["title"], names - exported)
            used |= names
    # Every exported series is on the dashboard somewhere.
    assert used == exported, exported - used


def _fake_run(run: Path) -> None:
    run.mkdir(parents=True)
    recs = [{"step": 0, "val_loss": 5.6, "val_ppl": 270.4}]
    for s in range(1, 61):
        loss = 5.6 * math.exp(-s / 20) + 0.4
        r = {"step": s, "loss": loss, "ppl": math.exp(loss), "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 5000 + 10 * s,
             "tflops_per_worker": 0.002, "mfu": 0.02, "tokens_seen": s * 256, "host_rss_gb": 1.2,
             "phase_data_wait_s": 0.001, "phase_forward_backward_s": 0.02, "phase_optimizer_s": 0.01,
             "phase_checkpoint_stall_s": 0.0}
        if s % 20 == 0:
            r.update(val_loss=loss + 0.1, val_ppl=math.exp(loss + 0.1))
        recs.append(r)
    recs.append({"step": 30, "event": "rollback", "bad_step": 33, "resumed_from": 30, "rule": "loss_not_finite",
                 "bad_batch": [256, 264], "skipped": [240, 264]})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "summary.json").write_text(json.dumps({"run": "fake", "steps": 60, "tokens_seen": 15360, "wall_s": 12.5,
                                                  "restarts": 0, "rollbacks": 1, "checkpoint": None,
                                                  "health_violations": {"loss_not_finite": 1},
                                                  "health_first": {"loss_not_finite": "loss is nan at step 33"}}))


def test_report_writes_png_and_markdown(tmp_path, capsys):
    run = tmp_path / "fake"
    _fake_run(run)
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 0
    png, md = tmp_path / "out" / "report.png", tmp_path / "out" / "report.md"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    from PIL import Image

    assert Image.open(png).size == (990, 1100)  # 9 x 10 inches at 110 dpi: readable, not a thumbnail
    text = md.read_text()
    assert "| steps | 60 |" in text and "![loss, perplexity and throughput](report.png)" in text
    assert "| val loss / ppl (first -> last) | 5.6000 / 270.40 ->" in text
    assert "rollback at step 33 (loss_not_finite): back to step 30, samples 240..263 skipped" in text
    assert "`loss_not_finite`: 1x" in text
    assert "wrote" in capsys.readouterr().out


def test_report_errors_are_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl in" in capsys.readouterr().err


def test_gpu_phase_timer_syncs_only_on_sampled_steps(monkeypatch):
    """On GPU each timed phase ends in a device sync; only the sampled (log) steps pay for it, and device
    phases average over those, while host-timed phases average over every step of the window."""
    import types

    import torch

    from raytrain.worker import telemetry
    from raytrain.worker.telemetry import PhaseTimer

    # A clock the test moves: the figures are exact, whatever the machine's load.
    now = [0.0]
    monkeypatch.setattr(telemetry, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(1))
    timer = PhaseTimer(cuda=True)
    for step in range(1, 5):
        timer.step(sample=step == 4)
        timer.add("data_wait", 0.1)
        with timer("forward_backward"):
            now[0] += 0.05 if step == 4 else 0.3  # unsampled steps are not timed at all
        with timer("optimizer"):
            pass
    assert len(syncs) == 2  # the sampled step's two phases, not eight
    out = timer.take(4)
    assert out["phase_data_wait_s"] == pytest.approx(0.1)
    # The one sampled step, not diluted by four (0.0125) nor with the unsampled ones (0.2375 or 0.95).
    assert out["phase_forward_backward_s"] == pytest.approx(0.05)
    cpu = PhaseTimer(cuda=False)
    cpu.step(sample=False)  # on CPU timing costs nothing: every step counts
    with cpu("optimizer"):
        now[0] += 0.02
    assert cpu.take(1)["phase_optimizer_s"] == pytest.approx(0.02)
