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
# the frees, then after host_heap.steady(); then a ZeRO-3 step's pattern after it: 100 gathered blocks of 2 MiB, each
# followed by a small one that stays, freed.
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
host_heap.steady(zero_stage=3, dp_size=2 if sys.argv[2] == "partitioned" else 1)
after_steady = rss() - base
blocks = []
for _ in range(100):
    blocks.append(torch.ones(2**19))  # 2 MiB
    kept.append(torch.ones(64))
blocks.clear()
print(json.dumps({"started": started, "after_free": freed, "after_steady": after_steady, "after_step": rss() - base}))
"""


def _probe(mode: str, steady: str = "steady") -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode, steady], env={**env, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_start_up_blocks_go_back_to_the_os_and_steady_returns_the_rest():
    plain, held = _probe("plain"), _probe("start")
    # glibc alone keeps the 400 MiB freed in its heap; steady() trims it.
    assert plain["after_free"] > 300 and plain["after_steady"] < 50, plain
    # From start(), each full-size block had its own mapping: freed, it is gone at once.
    assert held["started"] is True and held["after_free"] < 50 and held["after_steady"] < 50, held
    # After it, a heap keeps a step's gathered blocks (freed between partitions that stay) ...
    assert plain["after_step"] > 150, plain


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_zero3_over_several_ranks_gives_each_steps_gathered_blocks_back():
    # ... unless ZeRO-3 partitions the model: then each block had its own mapping, gone once freed.
    partitioned = _probe("start", "partitioned")
    assert partitioned["after_steady"] < 50 and partitioned["after_step"] < 50, partitioned


def test_only_zero3_over_several_ranks_maps_its_blocks():
    from raytrain.worker.host_heap import PARTITIONED_MMAP, STEADY_MMAP, steady_mmap_threshold

    assert steady_mmap_threshold(zero_stage=3, dp_size=2) == PARTITIONED_MMAP == 2**20
    # One rank gathers nothing it would not keep; ZeRO-1/2 keep whole weights: glibc's own threshold, full speed.
    assert steady_mmap_threshold(zero_stage=3, dp_size=1) == STEADY_MMAP
    assert steady_mmap_threshold(zero_stage=2, dp_size=4) == STEADY_MMAP


def test_a_users_malloc_setting_wins(monkeypatch):
    from raytrain.worker import host_heap

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert host_heap.start() is False
