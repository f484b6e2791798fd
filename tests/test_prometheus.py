"""A real Prometheus server scrapes a short training run through Ray's metrics endpoint and finds raytrain_*
series with sensible values; the repo's scrape config (Ray's `ray_` prefix stripped) and alert rules load.

The run has its own Ray instance in a subprocess (ray.init is per process, and the session's shared
cluster has no metrics export port), with Ray's metrics report interval at 1 s so a short run is seen.
"""

import json
import math
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from raytrain.rundir import METRICS, RunDir
from raytrain.worker.metrics import ACCELERATOR_ONLY, CATALOGUE, PHASES
from tests.helpers import ensure_prometheus, free_port

OBS = Path(__file__).resolve().parent.parent / "observability"
ROOT = Path(__file__).resolve().parent.parent


CHILD = textwrap.dedent("""
    import json, os, sys, time
    os.environ["RAY_metrics_report_interval_ms"] = "1000"
    import ray
    from raytrain.config import load_config
    from raytrain.trainer import train
    port, overrides = int(sys.argv[1]), json.loads(sys.argv[2])
    ray.init(address="local", num_cpus=4, include_dashboard=False, _metrics_export_port=port)
    summary = train(load_config("tiny", overrides), log=lambda *_: None)
    print("SUMMARY " + json.dumps(summary), flush=True)
    time.sleep(4)  # the last values reach the agent and one more scrape before the cluster goes
    ray.shutdown()
""")


def _get(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:  # Prometheus explains a rejected query in the body
        raise AssertionError(f"{params}: HTTP {e.code}: {e.read().decode()[:500]}") from None
    assert body["status"] == "success", body
    return body["data"]


def _query(base: str, q: str) -> list[dict]:
    return _get(base, "/api/v1/query", query=q)["result"]


def _values(base: str, q: str) -> dict[tuple, float]:
    return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in _query(base, q)}


@pytest.mark.slow
def test_prometheus_scrapes_raytrain_series(tiny_data, tmp_path):
    prom, _ = ensure_prometheus()
    metrics_port, prom_port = free_port(), free_port()
    # The repo's scrape config, pointed at this run's metrics port on 127.0.0.1 (the service-discovery
    # file is written by Ray's dashboard, which this small cluster does not run) and scraping every second.
    cfg = yaml.safe_load((OBS / "prometheus.yml").read_text())
    cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    cfg["rule_files"] = [str(OBS / "alerts.yml")]
    job = cfg["scrape_configs"][0]
    del job["file_sd_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    server = subprocess.Popen([prom, f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))
    base = f"http://127.0.0.1:{prom_port}"
    try:
        overrides = [f"data.train={tiny_data}/train", f"data.val={tiny_data}/val", f"checkpoint.storage={tmp_path}",
                     "run.name=prom", "model.n_layer=1", "model.hidden_size=32", "model.n_head=2", "model.seq_len=32",
                     "batch.micro_batch_size=4", "optim.lr=3e-3", "optim.warmup_steps=2", "run.log_every=1",
                     "run.eval_every=10", "data.eval_samples=16", "checkpoint.every_n_steps=5", "run.max_steps=20",
                     "run.max_failures=0", "scaling.data_cpus=2", "metrics.peak_tflops=0.1",
                     # a threshold every step crosses: the rule fires and its counter reaches Prometheus
                     "health.grad_norm_max=1e-9", "health.grace_steps=0",
                     "metrics.goodput_every_s=2"]  # the driver's live ledger, polled often for a short run
        env = {**os.environ, "RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_USAGE_STATS_ENABLED": "0",
               "PYTHONPATH": str(ROOT)}
        child = subprocess.run([sys.executable, "-c", CHILD, str(metrics_port), json.dumps(overrides)], env=env,
                               capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
        assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
        summary = json.loads(next(x for x in child.stdout.splitlines() if x.startswith("SUMMARY "))[8:])
        assert summary["steps"] == 20
        time.sleep(2)  # the last scrape is ingested

        gb_tokens = 8 * 32  # global batch 8 sequences (2 workers x micro 4) x 32 tokens
        # Instant queries see only live series; look back over the run instead.
        seen = {m for m in CATALOGUE if _query(base, f"count_over_time({m}[10m])")}
        # raytrain_eval_score comes with downstream evaluations (eval.tasks), which this run does not set.
        want = set(CATALOGUE) - ACCELERATOR_ONLY - {"raytrain_eval_score"}
        assert seen == want, want - seen
        # Names, not an *_over_time over many metrics: that drops __name__ and Prometheus rejects the
        # colliding label sets with HTTP 422.
        names = set(_get(base, "/api/v1/label/__name__/values"))
        assert not {n for n in names if n.startswith("ray_raytrain_")}  # the prefix was stripped
        assert {n for n in names if n.startswith("ray_node_")}  # next to Ray's own series

        steps = _values(base, "max_over_time(raytrain_step[10m])")
        assert {dict(k)["worker"] for k in steps} == {"0", "1"} and {dict(k)["run"] for k in steps} == {"prom"}
        # The last steps' values can be lost with the workers at the end of the run: ask for most of them.
        assert 15 <= max(steps.values()) <= 20
        per_step = _values(base, "max_over_time((raytrain_tokens_seen / raytrain_step)[10m:1s])")
        assert set(per_step.values()) == {gb_tokens}
        # Scrapes sample the loss gauge (a busy machine may see only one value): what they saw is a loss the
        # run logged, below the first step's (about ln(vocab)).
        logged = [r["loss"] for r in RunDir(str(tmp_path / "prom")).read_jsonl(METRICS) if "loss" in r]
        low = min(_values(base, 'min_over_time(raytrain_loss{worker="0"}[10m])').values())
        high = max(_values(base, 'max_over_time(raytrain_loss{worker="0"}[10m])').values())
        assert logged[0] < math.log(300) + 1 and 0 < low <= high and low < logged[0]
        assert any(abs(x - low) < 1e-4 for x in logged), (low, logged)
        ppl = max(_values(base, "max_over_time(raytrain_val_perplexity[10m])").values())
        assert 1 < ppl < 400
        lr = max(_values(base, "max_over_time(raytrain_learning_rate[10m])").values())
        assert 0 < lr <= 3e-3 * 1.0001
        tps = max(_values(base, "max_over_time(raytrain_tokens_per_second[10m])").values())
        assert 100 < tps < 1e7
        mfu = _values(base, "max_over_time(raytrain_mfu_ratio[10m])")
        flops = _values(base, "max_over_time(raytrain_achieved_flops_per_second[10m])")
        for k, v in mfu.items():
            assert 0 < v < 1 and flops[k] == pytest.approx(v * 0.1e12, rel=1e-6)  # peak_tflops 0.1
        phases = _values(base, "max_over_time(raytrain_step_phase_seconds[10m])")
        assert {dict(k)["phase"] for k in phases} == set(PHASES)
        assert all(0 <= v < 60 for v in phases.values())
        rss = _values(base, "max_over_time(raytrain_host_memory_rss_bytes[10m])")
        assert all(50 * 2**20 < v < 20 * 2**30 for v in rss.values())
        assert 3 <= max(_values(base, "max_over_time(raytrain_checkpoints_total[10m])").values()) <= 4
        fired = _values(base, 'max_over_time(raytrain_health_violations_total{rule="grad_norm"}[10m])')
        assert fired and 15 <= max(fired.values()) <= 20  # every log step crossed the threshold, each counted
        assert min(_values(base, "max_over_time(raytrain_restarts[10m])").values()) == 0

        # The driver's goodput gauges (raytrain/goodput_gauges.py): their last values are the run's final ledger
        # (goodput.json), one badput series per kind, the world size; earlier values were read while it ran.
        final = json.loads((tmp_path / "prom" / "goodput.json").read_text())
        ratio = _values(base, "last_over_time(raytrain_goodput_ratio[10m])")
        assert {dict(k)["run"] for k in ratio} == {"prom"}, ratio
        assert max(ratio.values()) == pytest.approx(final["goodput"], abs=1e-9)
        assert _query(base, "count_over_time(raytrain_goodput_ratio[10m]) > 1"), "no value while the run ran"
        bad = {dict(k)["kind"]: v for k, v in _values(base, "last_over_time(raytrain_badput_seconds[10m])").items()}
        assert bad == pytest.approx({k: v for k, v in final["seconds"].items() if k != "productive"}, abs=1e-6)
        wall = max(_values(base, "last_over_time(raytrain_run_wall_seconds[10m])").values())
        assert wall == pytest.approx(final["wall_s"], abs=1e-6)
        assert set(_values(base, "last_over_time(raytrain_world_size[10m])").values()) == {2}

        with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=10) as r:
            groups = json.loads(r.read())["data"]["groups"]
        rules = [x for g in groups for x in g["rules"]]
        assert len(rules) == 12 and all(x["health"] == "ok" for x in rules), [(x["name"], x.get("lastError")) for x in rules]
    finally:
        server.terminate()
        server.wait(timeout=30)
