"""The host-memory snapshot interval: fixed, or `auto` - measured over an attempt's first steps, agreed by all ranks
(raytrain/ckpt/snapshot_interval.py). A run that widens it and a kill redoing at most the interval + 1 steps are in
tests/test_train.py."""

from __future__ import annotations

import pytest

from raytrain.ckpt import snapshot_interval as si


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _measure(monkeypatch, *, step_s: float, stall_s: float, drag_s: float = 0.0, ckpt_every=1000,
             target=0.02, mtbf_s=None, restarts=0) -> si.SnapshotInterval:
    """An attempt from step 0 up to its deciding step: steps of `step_s`; each snapshot stalls `stall_s` and its copy
    slows the next step by `drag_s` (a GPU's side-stream copy)."""
    clock = Clock()
    monkeypatch.setattr(si.time, "monotonic", clock)
    iv = si.SnapshotInterval("auto", target=target, ckpt_every=ckpt_every, mtbf_s=mtbf_s)
    iv.begin(0, restarts=restarts)
    took = None
    taken = []
    for step in range(1, si.MEASURE_STEPS + 1):
        assert not iv.deciding(step)
        clock.t += step_s + (drag_s if took is not None else 0.0)  # the step
        iv.tick(took)  # its snapshot decision: the previous snapshot's whole stall
        took = None
        if iv.due(step):
            taken.append(step)
            clock.t += stall_s
            took = stall_s
    assert taken == list(range(1, si.MEASURE_STEPS + 1, 2))  # every other step while measuring
    return iv


@pytest.mark.parametrize("stall_ms, drag_ms, want", [(0.5, 0, 1), (2.0, 0, 1), (10.0, 0, 5), (60.0, 0, 30),
                                                     (5.0, 35.0, 20)])
def test_auto_picks_the_smallest_interval_within_the_cost_target(monkeypatch, stall_ms, drag_ms, want):
    """A 100 ms step: a snapshot costing 2 ms is 2 % (every step); 10 ms needs every 5th; a slow copy widens it;
    a copy stalling only 5 ms but slowing the next step by 35 ms is priced at 40 ms (the H200's case)."""
    iv = _measure(monkeypatch, step_s=0.1, stall_s=stall_ms / 1000, drag_s=drag_ms / 1000)
    assert iv.cost_s == pytest.approx((stall_ms + drag_ms) / 1000) and iv.step_s == pytest.approx(0.1)
    step = si.MEASURE_STEPS + 1
    assert iv.deciding(step) and iv.proposal() == want
    iv.agreed(step, iv.proposal())
    assert iv.every == want and not iv.deciding(step) and iv.decided_at == step
    assert iv.due(step * want) and (want == 1 or not iv.due(step * want + 1))
    assert f"every {want} step(s) (auto, from step {step}" in iv.describe()


@pytest.mark.parametrize("stall_ms, mtbf_s, restarts, want", [
    (2.0, 7200, 0, 54),  # sqrt(2 x 0.002 s x 7200 s) = 5.4 s of 100 ms steps
    (2.0, 7200, 3, 27),  # four attempts so far: MTBF 1800 s
    (60.0, 100, 0, 35),  # 3.46 s: wider than the cost target's 30
    (60.0, 1, 0, 30),  # Young-Daly would snapshot every 3rd step: the cost target (2 %) keeps it at 30
])
def test_auto_takes_young_daly_from_the_failure_rate_within_the_cost_target(monkeypatch, stall_ms, mtbf_s, restarts,
                                                                              want):
    """The interval with the least expected loss (snapshot cost against the steps a fault redoes), from
    checkpoint.mtbf_s over the run's attempts, but never one whose snapshots cost more than the target."""
    iv = _measure(monkeypatch, step_s=0.1, stall_s=stall_ms / 1000, mtbf_s=mtbf_s, restarts=restarts)
    assert iv.proposal() == want
    iv.agreed(si.MEASURE_STEPS + 1, iv.proposal())
    assert f"Young-Daly with MTBF {mtbf_s / (1 + restarts):,.0f} s" in iv.describe()


def test_ranks_take_the_mean_of_their_proposals_rounded_up_and_the_cap(monkeypatch):
    iv = _measure(monkeypatch, step_s=0.1, stall_s=0.5, ckpt_every=20)
    assert iv.proposal() == 20  # 250 wanted, but a storage checkpoint every 20 steps snapshots anyway
    iv.agreed(9, (3 + 4) / 2)
    assert iv.every == 4
    iv.begin(40)  # a new attempt measures again
    assert iv.decided_at is None and iv.due(41) and not iv.due(42) and iv.deciding(41 + si.MEASURE_STEPS)


def test_a_rank_that_measured_nothing_proposes_zero_and_fixed_intervals_never_decide():
    iv = si.SnapshotInterval("auto", target=0.02, ckpt_every="auto")
    iv.begin(0)
    assert iv.proposal() == 0.0 and iv.max_every == si.MAX_EVERY
    fixed = si.SnapshotInterval(3, target=0.02, ckpt_every=10)
    fixed.begin(0)
    assert not any(fixed.deciding(s) for s in range(20)) and [s for s in range(1, 10) if fixed.due(s)] == [3, 6, 9]


def test_bad_interval_names_the_key():
    from raytrain.config import load_config
    from raytrain.errors import UserError

    for bad in ("0", "sometimes", "1.5"):
        with pytest.raises(UserError, match="checkpoint.memory_every_n_steps"):
            load_config("tiny", [f"checkpoint.memory_every_n_steps={bad}"])
    assert load_config("tiny", []).checkpoint.memory_every_n_steps == "auto"
