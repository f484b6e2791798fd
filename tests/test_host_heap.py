"""A training worker's heap (raytrain/worker/host_heap.py): what start-up frees goes back to the OS, in a fresh
process each, as glibc behaves in a new worker."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A freed 8 MiB block raises glibc's mmap threshold past 4 MiB; then 100 blocks of 4 MiB (a model's full-size
# tensors), each followed by a small one that stays (a partition), are freed. RSS above the start, in MiB: after
# the frees, then after host_heap.steady().
PROBE = r"""
import json, sys
import psutil, torch
from raytrain.worker import host_heap
rss = lambda: psutil.Process().memory_info().rss / 2**20
started = host_heap.start() if sys.argv[1] == "start" else None
base = rss()
x = torch.ones(2 * 2**20)  # an 8 MiB block, freed
del x
blocks, kept = [], []
for _ in range(100):
    blocks.append(torch.ones(2**20))  # 4 MiB
    kept.append(torch.ones(64))
del blocks
freed = rss() - base
host_heap.steady()
print(json.dumps({"started": started, "after_free": freed, "after_steady": rss() - base}))
"""


def _probe(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**env, "PYTHONPATH": ROOT}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_start_up_blocks_go_back_to_the_os_and_steady_returns_the_rest():
    plain, held = _probe("plain"), _probe("start")
    # glibc alone keeps the 400 MiB freed in its heap; steady() trims it.
    assert plain["after_free"] > 300 and plain["after_steady"] < 50, plain
    # From start(), each full-size block had its own mapping: freed, it is gone at once.
    assert held["started"] is True and held["after_free"] < 50 and held["after_steady"] < 50, held


def test_a_users_malloc_setting_wins(monkeypatch):
    from raytrain.worker import host_heap

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert host_heap.start() is False
