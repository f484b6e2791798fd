"""The sample plan alone: each sample at most once per epoch, batches independent of N, deterministic, resumable."""

import sys
from pathlib import Path

import numpy as np
import pytest

from raytrain.data.sample_plan import SamplePlan, keyed_permute, units_of
from raytrain.errors import UserError

# The benchmark harness (scripts/benchkit) is not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
ROWS = [40] * 30 + [17]  # 31 shards, a short last one


def _plan(seed=1, gb=16, unit_rows=8, shuffle=True, rows=ROWS):
    return SamplePlan(units_of(rows, unit_rows), rows, seed, gb, shuffle)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 255, 256, 1000])
def test_keyed_permutation_is_a_bijection(n):
    assert sorted(keyed_permute(np.arange(n), n, 987).tolist()) == list(range(n))


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_sample_at_most_once_per_epoch_and_all_when_the_batch_divides(shuffle):
    for rows, gb in ((ROWS, 16), ([32] * 24, 16)):
        p = _plan(gb=gb, shuffle=shuffle, rows=rows)
        for epoch in range(2):
            ids = np.concatenate([p.step(epoch * p.steps_per_epoch + s).ids for s in range(p.steps_per_epoch)])
            assert len(ids) == len(set(ids.tolist())) == p.trained_per_epoch > sum(rows) - gb
            assert ids.min() >= 0 and ids.max() < sum(rows)
            if sum(rows) % gb == 0:
                assert sorted(ids.tolist()) == list(range(sum(rows)))


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_batch_membership_does_not_depend_on_the_worker_count(n):
    p = _plan()
    for step in (0, 1, 7, p.steps_per_epoch - 1, p.steps_per_epoch, 3 * p.steps_per_epoch + 5):
        whole = p.step(step)
        parts = [p.step(step, p.lanes_of(r, n)) for r in range(n)]
        np.testing.assert_array_equal(np.concatenate([q.ids for q in parts]), whole.ids)


def test_deterministic_by_seed_epochs_differ_and_any_step_is_computed_directly():
    a, b, c = _plan(seed=3), _plan(seed=3), _plan(seed=4)
    np.testing.assert_array_equal(a.step(11).ids, b.step(11).ids)
    assert not np.array_equal(a.step(11).ids, c.step(11).ids)
    L = a.steps_per_epoch
    assert sorted(a.step(2).ids) != sorted(a.step(L + 2).ids)
    fresh = _plan(seed=3)  # nothing computed before: step 10 * L + 3 straight away
    np.testing.assert_array_equal(fresh.step(10 * L + 3).ids, a.step(10 * L + 3).ids)
    assert fresh.step(5).fingerprint() == a.step(5).fingerprint() != a.step(6).fingerprint()


def test_a_lane_stays_in_one_unit_at_a_time_and_reads_it_sequentially_in_unit_order():
    p = _plan(gb=8, unit_rows=10, rows=[40] * 20)  # 80 units, 100 rows per lane: 10 whole units each
    units = np.stack([p.step(s).units for s in range(p.steps_per_epoch)])  # [step, lane]
    for lane in range(8):
        seq = units[:, lane]
        changes = np.flatnonzero(np.diff(seq)) + 1
        assert len(set(seq.tolist())) == len(changes) + 1  # never returns to a unit it left
        assert all(b - a == 10 for a, b in zip(np.r_[0, changes], np.r_[changes, len(seq)]))
    for lanes, unit_rows in (((0, 8), 10), ((2, 5), 10), ((0, 8), 7), ((3, 6), 7)):  # 7: units cut by lanes
        p = _plan(gb=8, unit_rows=unit_rows, rows=[40] * 20)
        units = np.stack([p.step(s).units for s in range(p.steps_per_epoch)])
        planned = {u: (f, e) for f, e, u in p.lane_units(0, lanes)}
        used = units[:, lanes[0]:lanes[1]]
        assert sorted(planned) == sorted(set(used.ravel().tolist()))
        for u, (f, e) in planned.items():
            steps = np.flatnonzero((used == u).any(axis=1))
            assert (f, e) == (steps.min(), steps.max())
        assert {u for f, e, u in p.lane_units(0, lanes, t0=35)} == {u for f, e, u in p.lane_units(0, lanes) if e >= 35}


def test_too_small_a_split_or_an_uneven_split_of_lanes_is_explained():
    with pytest.raises(UserError, match="fewer than one global batch"):
        _plan(gb=10_000)
    with pytest.raises(UserError, match="multiple of the worker count"):
        _plan(gb=16).lanes_of(0, 3)


def test_simulation_keeps_read_amplification_near_one_and_per_worker_cost_flat_in_n():
    from benchkit.dataplane import dataplane

    figs = {f["workers"]: f for f in dataplane(log=lambda *_: None, workers=(8, 64, 512), batches=(512,),
                                                corpus_bytes=10 ** 11)}
    assert all(f["met"] and f["value"] <= 1.1 for f in figs.values())
    assert figs[512]["cache_units"] <= figs[64]["cache_units"] <= figs[8]["cache_units"] <= 512 // 8
    assert figs[512]["units_per_worker_step"] <= figs[8]["units_per_worker_step"]
    assert figs[512]["ranks_per_unit_max"] <= 2
