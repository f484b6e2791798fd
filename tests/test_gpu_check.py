"""The prepared GPU check (scripts/gpu_check.sh, scripts/gpu_check.py; docs/BENCHMARKS.md "GPU check (issue 44)"):
without CUDA it stops in one line within seconds; its parts run in priority order within the 5-minute budget."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the check would run for real")
@pytest.mark.parametrize("python", [sys.executable, "/nonexistent/python3"], ids=["torch-cpu", "no-torch"])
def test_without_cuda_it_exits_nonzero_in_one_line_within_seconds(python, tmp_path):
    out = tmp_path / "out"
    t = time.monotonic()
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": python, "OUT": str(out)})
    took = time.monotonic() - t
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gpu_check: no CUDA device (") and "docs/BENCHMARKS.md" in lines[0], lines[0]
    if python == sys.executable:
        assert f"torch {torch.__version__} sees none" in lines[0]
    assert proc.stdout == "" and not out.exists()
    assert took < 20, f"{took:.1f} s"


def test_parts_run_in_priority_order_within_the_budget():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--plan"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert [p["name"] for p in plan["parts"]] == ["gpt2_124m", "snapshots_124m", "test_gpu", "llama_1b"]
    caps = sum(p["cap_s"] for p in plan["parts"])
    assert caps == plan["caps_sum_s"] and all(p["cap_s"] > 0 for p in plan["parts"])
    assert caps <= plan["total_s"] <= 290
    # The shell's own bound on the Python run: with the wheels' install before it, the check ends within 5 minutes.
    shell_timeout = int(re.search(r"GPU_CHECK_TIMEOUT:-(\d+)", SCRIPT.read_text()).group(1))
    assert plan["total_s"] <= shell_timeout <= 290


def test_documented():
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    section = text[text.index("## GPU check (issue 44)"):]
    for needle in ("scripts/gpu_wheels.sh", "./scripts/gpu_check.sh", "`.whl`", "tests/test_gpu.py"):
        assert needle in section, needle
