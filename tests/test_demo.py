"""The README's first command as a new user meets it: `./scripts/demo.sh` from an empty home directory, with no
Ray token anywhere, completes; what it prints after set-up is short and free of library noise. Then the
fine-tuning recipe (`./scripts/finetune.sh`) on the demo's model."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
STEPS = 50


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """./scripts/demo.sh run once from an empty home: (its folder, its environment, the finished process)."""
    tmp_path = tmp_path_factory.mktemp("demo")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "PYTEST_")) and k not in ("VIRTUAL_ENV",)}
    env.update(HOME=str(home), RAYTRAIN_DEMO_DATA=str(tmp_path / "data"), RAYTRAIN_DEMO_RUNS=str(tmp_path / "runs"),
               # Ports of its own: the session cluster of other tests may be running.
               RAYTRAIN_DEMO_PORT="6395", RAYTRAIN_DEMO_DASHBOARD_PORT="8295")
    # A sixth of the demo's 300 steps (overrides, as the README shows): the same commands and output, ~30 s less of
    # the suite's budget than 100 steps; validation perplexity halves well within 50 (2,088 -> 536 on 2026-12-05).
    out = subprocess.run([str(ROOT / "scripts" / "demo.sh"), f"run.max_steps={STEPS}", "run.log_every=10"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    (tmp_path / "demo.log").write_text(out.stdout + out.stderr)  # what a person saw, kept for a failure's reader
    return tmp_path, env, out


def test_demo_from_an_empty_home_creates_a_token_and_prints_a_short_clean_log(demo):
    tmp_path, _, out = demo
    home = tmp_path / "home"
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]

    # The token was created where Ray looks for it, private to the user, and the script said where.
    token = home / ".ray" / "auth_token"
    assert token.is_file() and len(token.read_text().strip()) == 64
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert f"token in {token}" in text

    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["val_ppl"] < 0.5 * summary["initial_val_ppl"]
    # The data plane keeps up: training hardly ever waits for data. (Read amplification is not bounded here:
    # the demo's few large shards and its end mid-way through an epoch read whole units it trains part of.)
    assert summary["data_wait_frac_mean"] <= 0.01, summary

    # What a person reads: from the first prepare line to the end of the summary.
    lines = out.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "prepar" in line and not line.startswith("[setup]"))
    end = max(i for i, line in enumerate(lines) if line.startswith("=" * 20))
    shown = lines[start:end + 1]
    assert len(shown) <= 40, "\n".join(shown)
    # Ray's core worker says nothing but one known line: its stock preemption watcher's error-level notice on every
    # run (ray-project/ray#53727). raytrain once rebuilt Ray's watcher to hide it; a log line is no reason to reach
    # into Ray's private code (issue 43), so the line stays until Ray fixes it.
    ray_lines = [line for line in out.stdout.splitlines() if "core_worker" in line]
    assert all("'PreemptionWatcher'" in line and "53727" in line for line in ray_lines), "\n".join(shown)
    # The MFU on the progress lines rests on the CPU's measured peak (the probe's cache), not an assumed figure.
    assert any("MFU" in line for line in shown) and (home / ".cache" / "raytrain" / "cpu_peak.json").is_file()
    for bad in ("warning", "TrainingReport", "Traceback"):
        assert not [line for line in shown if bad.lower() in line.lower()], (bad, "\n".join(shown))
    progress = [line for line in shown if re.match(rf"\[raytrain\] step \d+/{STEPS} \| loss", line)]
    assert len(progress) == STEPS // 10, "\n".join(shown)  # every 10 steps (the override)
    assert any(f"ckpt checkpoint_{STEPS:08d}" in line for line in progress), "\n".join(progress)
    assert not out.stderr.strip(), out.stderr[-2000:]


def test_the_finetune_recipe_lowers_held_out_loss_and_leaves_a_merged_model(demo):
    # The fine-tuning recipe of docs/LIFECYCLE.md, after the demo as a user runs it: the demo's export as the base, the instruction set
    # from the standard library, a LoRA fine-tune as a `ray job submit` job, the merged export. Fewer steps than
    # the recipe's 60 (an override, as the docs show).
    tmp_path, env, demo_out = demo
    assert demo_out.returncode == 0, "the demo failed; see test_demo_from_an_empty_home..."
    env = {**env, "RAYTRAIN_FT_DATA": str(tmp_path / "data"), "RAYTRAIN_FT_MODELS": str(tmp_path / "models")}
    out = subprocess.run([str(ROOT / "scripts" / "finetune.sh"), "run.max_steps=20", "run.eval_every=10",
                          "checkpoint.every_n_steps=10"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    text = out.stdout + out.stderr
    (tmp_path / "finetune.log").write_text(text)
    assert out.returncode == 0, text[-4000:]
    assert "[setup] installing" not in text  # the test install holds the lora extra
    m = re.search(r"held-out instruction loss .*: ([0-9.]+) -> ([0-9.]+)", out.stdout)
    assert m and float(m.group(2)) < float(m.group(1)) - 0.1, text[-3000:]
    assert "trainable parameters (the adapter's)" in out.stdout
    merged = [d for d in (tmp_path / "models").iterdir() if d.name.startswith("sft-")]
    assert len(merged) == 1 and (merged[0] / "config.json").is_file()
    assert not (merged[0] / "adapter_config.json").exists()  # the adapter merged in: a plain model directory
    # No library progress bars or tracebacks between our lines.
    assert not re.search(r"it/s\]|Traceback", text), text[-3000:]
