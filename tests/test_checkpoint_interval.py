"""checkpoint.every_n_steps=auto: the Young-Daly interval from measured cost and failure rate, agreed by all ranks."""

import json

import pytest

from raytrain import storage
from raytrain.errors import UserError
from raytrain.config import load_config
from raytrain.trainer import train
from raytrain.worker.interval import FixedCadence, YoungDalyCadence, run_history, young_daly_s
from tests.helpers import tiny_cfg


def test_young_daly_and_the_failure_rate_estimate(monkeypatch):
    assert young_daly_s(2.0, 3600.0) == pytest.approx(120.0)
    clock = {"wall": 1000.0, "mono": 50.0}
    monkeypatch.setattr("raytrain.worker.interval.time.time", lambda: clock["wall"])
    monkeypatch.setattr("raytrain.worker.interval.time.monotonic", lambda: clock["mono"])
    iv = YoungDalyCadence(mtbf_s=3600.0, initial_cost_s=2.0, run_started=1000.0, restarts=0)
    # Nothing measured, nothing seen: the prior alone.
    assert iv.mtbf_s == 3600.0 and iv.interval_s == pytest.approx(120.0)
    assert not iv.due(1)
    clock["mono"] += 119.0
    assert not iv.due(2)
    clock["mono"] += 2.0
    assert iv.due(3)
    # A measured cost replaces the assumed one; the clock restarts at the save.
    iv.saved(0.5)
    assert iv.cost_s == 0.5 and not iv.due(4)
    # An hour of wall time without interruptions raises the estimate; a restart lowers it.
    clock["wall"] += 3600.0
    assert iv.mtbf_s == pytest.approx(7200.0)
    after_restart = YoungDalyCadence(mtbf_s=3600.0, initial_cost_s=2.0, run_started=1000.0, restarts=3)
    assert after_restart.mtbf_s == pytest.approx(7200.0 / 4)
    no_restart = YoungDalyCadence(mtbf_s=3600.0, initial_cost_s=2.0, run_started=1000.0, restarts=0)
    assert after_restart.interval_s == pytest.approx(no_restart.interval_s / 2)
    fixed = FixedCadence(5)
    assert [s for s in range(1, 16) if fixed.due(s)] == [5, 10, 15] and "every 5 steps" in fixed.describe()


def test_agreement_flags_are_reduced_where_the_backend_can(monkeypatch):
    """NCCL reduces device tensors only: the per-step flags go to the training device (a CPU tensor
    raised "No backend type associated with device type cpu" on every multi-GPU step)."""
    import torch
    import torch.distributed as dist

    from raytrain.worker.preemption import PreemptionNotice
    from raytrain.worker.verdict import StepAgreement

    seen = []

    def all_reduce(t, op=None, async_op=False):
        seen.append(t.device)
        t[4] = 1  # another rank asked for a checkpoint (the flags ride on the loss all-reduce)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    cadence = YoungDalyCadence(mtbf_s=1e9, initial_cost_s=1.0)  # rank 0's own clock says "not yet"
    agreement = StepAgreement(notice=PreemptionNotice(0, enabled=False), cadence=cadence, rank=0, world=2,
                              device=torch.device("meta"))
    with pytest.raises(NotImplementedError):  # a meta tensor has no values to read back; its device is the point
        agreement.agree(torch.zeros((), device="meta"), 1)
    assert seen == [torch.device("meta")]
    seen.clear()
    agreement = StepAgreement(notice=PreemptionNotice(0, enabled=False), cadence=cadence, rank=0, world=2)
    verdict = agreement.agree(torch.tensor(3.0), 1)
    assert verdict.loss == 1.5  # the loss's mean over the 2 ranks
    assert verdict.checkpoint_now and verdict.preempted is None and seen == [torch.device("cpu")]


def test_a_step_that_checkpoints_on_a_vote_read_late_judges_its_own_loss_first(monkeypatch):
    """The agreed cadence's vote (step 3's all-reduce) is read a step late, at step 4, which checkpoints: step 4's own
    loss is read before the save, so no checkpoint holds weights whose loss was never judged."""
    import torch
    import torch.distributed as dist

    from raytrain.worker.preemption import PreemptionNotice
    from raytrain.worker.verdict import StepAgreement

    class Cadence:
        agreed = True

        @staticmethod
        def due(step):
            return step == 3

    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, async_op=False: None)  # one rank's values: the sum
    agreement = StepAgreement(notice=PreemptionNotice(0, enabled=False), cadence=Cadence(), rank=0, world=2)
    verdicts = {s: agreement.agree(torch.tensor(float(s)), s, now=False) for s in range(1, 6)}
    assert [v.losses for v in verdicts.values()] == [(), ((1, 0.5),), ((2, 1.0),), ((3, 1.5), (4, 2.0)), ()]
    assert [s for s, v in verdicts.items() if v.checkpoint_now] == [4]


def test_run_history_counts_earlier_attempts_and_ignores_a_torn_line(tmp_path):
    assert run_history(str(tmp_path)) == (None, 0)
    (tmp_path / "attempts.jsonl").write_text('{"attempt": 0, "time": 100.5}\n{"attempt": 1, "time": 160.0}\n{"attem')
    assert run_history(str(tmp_path)) == (100.5, 2)


@pytest.mark.parametrize("value", ["0", "sometimes", "1.5", "true"])
def test_bad_interval_names_the_key_and_what_is_allowed(value):
    with pytest.raises(UserError, match=r"checkpoint.every_n_steps': must be a whole number of steps >= 1 or 'auto'"):
        load_config("tiny", [f"checkpoint.every_n_steps={value}"])


@pytest.mark.slow
def test_auto_interval_checkpoints_on_time_and_resumes_after_a_crash(ray_cluster, tiny_data, tmp_path):
    # Tiny prior and assumed cost: the first checkpoint comes after the first step (sqrt(2 x 0.01 x 0.01) s);
    # then the measured pause and the run's wall time set an interval of about a second, so a slightly
    # bigger model (tens of ms a step) usually takes more, at steps no fixed interval would choose.
    mtbf, cost0 = 0.01, 0.01
    cfg = tiny_cfg(tiny_data, tmp_path, "auto", "checkpoint.every_n_steps=auto", f"checkpoint.mtbf_s={mtbf}",
                   f"checkpoint.auto_initial_cost_s={cost0}", "run.max_steps=24", "run.max_failures=1",
                   "checkpoint.keep_last=20", "model.n_layer=2", "model.hidden_size=64",
                   "checkpoint.memory=false")  # the restart restores from storage, the interval's subject
    summary = train(cfg, log=lambda *_: None, inject={"crash_at_step": 15, "marker": str(tmp_path / "crashed")})
    assert summary["steps"] == 24 and summary["restarts"] == 1
    recs = [json.loads(x) for x in storage.read_text(f"{tmp_path}/auto/metrics.jsonl").splitlines()]
    saves = [r for r in recs if "checkpoint" in r]
    auto_saves = [r for r in saves if "auto_interval_s" in r and r["step"] != 24]
    # The first comes at step 1 by construction; how many follow depends on this machine's step time.
    assert auto_saves and auto_saves[0]["step"] == 1, saves
    stalls = [r["ckpt_stall_s"] for r in saves]
    attempts = [json.loads(x) for x in storage.read_text(f"{tmp_path}/auto/attempts.jsonl").splitlines()]
    for r in auto_saves:
        # sqrt(2 C M): C between the cheapest stall and the assumed cost; M between the prior halved (one
        # restart) and the prior plus the run's wall time so far (from its first attempt's start).
        lo = young_daly_s(min(stalls + [cost0]), mtbf / 2) * 0.99
        hi = young_daly_s(max(stalls + [cost0]), mtbf + r["time"] - attempts[0]["time"]) * 1.01
        assert lo <= r["auto_interval_s"] <= hi, (r, lo, hi)
    # Every save was committed by all ranks together (a disagreement would have hung or left no manifest).
    for r in saves:
        assert storage.exists(f"{tmp_path}/auto/{r['checkpoint']}/manifest.json") or r["step"] < 15
    committed_before_crash = [r["step"] for r in auto_saves if r["step"] < 15]
    assert attempts[-1]["resumed_step"] in committed_before_crash, (attempts, committed_before_crash)


def test_a_lone_rank_on_the_host_reads_its_loss_a_step_late_with_no_tensor_made():
    """One CPU rank has nothing to reduce: the step's loss tensor is kept as it is and read (mean over the
    accumulation's micro-batches) at the next step, or at once on a step that acts on it: two tensor calls a step
    (detach, item), where building a vector for an all-reduce took twelve."""
    import torch
    from torch.overrides import TorchFunctionMode

    from raytrain.worker.preemption import PreemptionNotice
    from raytrain.worker.verdict import StepAgreement

    class Cadence:
        agreed = False

        @staticmethod
        def due(step):
            return False

    class Count(TorchFunctionMode):
        calls: list = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    agreement = StepAgreement(notice=PreemptionNotice(0, enabled=False), cadence=Cadence(), rank=0, world=1,
                              accumulation=2)
    losses = torch.tensor(4.0), torch.tensor(6.0)
    with Count():
        first = agreement.agree(losses[0], 1, now=False, content=7)
        second = agreement.agree(losses[1], 2, now=True, content=9)
    assert first.losses == () and second.losses == ((1, 2.0), (2, 3.0)) and second.content == 9
    assert sorted(Count.calls) == ["detach", "detach", "item", "item"], Count.calls
