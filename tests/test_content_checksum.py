"""The content checksum of a global batch (raytrain/data/content_checksum.py): the same from any split of the batch
over ranks, counted once across a tensor-parallel group, sensitive to a changed byte and to row order."""

from __future__ import annotations

import time

import numpy as np

from raytrain.data import content_checksum as cc


def _batch(gb: int = 16, width: int = 33, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50257, (gb, width)).astype(np.int32)


def test_any_split_over_ranks_gives_the_batch_checksum():
    rows = _batch()
    whole = cc.of_batch(rows)
    for world in (1, 2, 4, 8):
        share = len(rows) // world
        total = sum(cc.share(rows[r * share:(r + 1) * share], r * share) for r in range(world))
        assert cc.combine(total) == whole
    # A tensor-parallel group of 2 per data-parallel rank: every share is added twice.
    total = sum(2 * cc.share(rows[r * 8:(r + 1) * 8], r * 8) for r in range(2))
    assert cc.combine(total, copies=2) == whole


def test_a_changed_token_or_swapped_rows_change_it():
    rows = _batch()
    whole = cc.of_batch(rows)
    bad = rows.copy()
    bad[3, 7] += 1
    assert cc.of_batch(bad) != whole
    assert cc.of_batch(rows[[1, 0, *range(2, len(rows))]]) != whole
    assert cc.of_batch(rows.astype(np.int64)) == whole  # the reader's dtype is not part of the content


def test_its_cost_is_small_beside_a_gpt2_step():
    """A GPT-2 124M rank's rows of a step, 16 x 1025 ids: about 20 us here (docs/BENCHMARKS.md), 0.06 % of the
    ~31 ms an H100 spends on that step at 40 % MFU. Asserted loosely (a shared machine): under 1 ms."""
    rows = _batch(16, 1025)
    t = time.perf_counter()
    for _ in range(20):
        cc.share(rows, 0)
    assert (time.perf_counter() - t) / 20 < 1e-3
