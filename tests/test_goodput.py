"""The goodput ledger (raytrain/goodput.py) on synthetic run directories: every kind injected with known seconds.

The records have the shapes their writers give them: attempts.jsonl as worker/runlog.py's Attempt writes it (its
heartbeat as previous_progress, the controller's phases from restart_phases.py), metrics.jsonl as worker/loop.py logs
(a log record's figures are its window's means; the window closes before the step's evaluation, which falls in the
next window; a checkpoint's record comes after its save), elastic.jsonl as elastic/events.py and sizing.py publish.
No Ray, no training: a few JSON lines in tmp_path.
"""

from __future__ import annotations

import pytest

from raytrain.goodput import format_ledger, ledger
from raytrain.rundir import ATTEMPTS, ELASTIC, METRICS, REPORT_GOODPUT, RunDir

T0 = 1_700_000_000.0  # unix seconds, like the writers' time.time()

# The seconds each kind was given in _run (the comments there say which interval makes each figure).
EXPECTED = {
    "start/driver": 10 + 5, "start/workers": 3 + 3, "start/restore": 1.5 + 2, "start/setup": 4 + 3,
    "start/first_step": 1.5 + 2,
    "restart/detect": 4, "restart/notice": 3, "restart/teardown": 2 + 2, "restart/schedule": 3 + 2,
    "restart/workers": 3 + 2, "restart/restore": 3 + 1.5, "restart/setup": 4 + 3, "restart/first_step": 2 + 1.5,
    "resize/teardown": 1, "resize/schedule": 1, "resize/workers": 2, "resize/restore": 2, "resize/setup": 3,
    "resize/first_step": 1,
    "waiting": 10,
    "productive": 27.2 + 7.5 + 7 + 16 + 29, "data_wait": 1.8 + 4.5 + 2, "checkpoint_stall": 4 + 8 + 2 + 4 + 3,
    "evaluation": 3 + 2, "redone": 5,
    "finish": 10 + 13, "not_running": 120,
}
WALL = 360.0


def _log(rd: RunDir, step: int, t: float, *, step_s: float = 1.0, wait_s: float = 0.0, stall_s: float = 0.0,
         eval_s: float = 0.0) -> None:
    """A log step's record (worker/loop.py _log_record, telemetry.log_step): per-step means of its window."""
    rec = {"step": step, "loss": 3.0, "lr": 1e-4, "tokens_per_s": 1e4, "step_time_s": step_s,
           "phase_data_wait_s": wait_s, "phase_forward_backward_s": 0.5, "phase_optimizer_s": 0.1,
           "phase_checkpoint_stall_s": stall_s, "restarts": 0, "checkpoints": 0}
    if eval_s:
        rec.update({"val_loss": 3.1, "val_ppl": 22.2, "eval_s": eval_s})  # evaluate.record, after the window closed
    rd.append_jsonl(METRICS, {**rec, "time": round(T0 + t, 3)})


def _ckpt(rd: RunDir, step: int, t: float, stall_s: float, *, notice: bool = False, grow: bool = False) -> None:
    """A checkpoint's record, written after its save (worker/loop.py _checkpoint); `notice`: a preemption's (or a
    grow's, `grow`) checkpoint."""
    rd.append_jsonl(METRICS, {"step": step, "checkpoint": f"ckpt-{step}", "ckpt_stall_s": stall_s, "ckpt_mode": "async",
                              "preemption_checkpoint": notice or grow, **({"grow_checkpoint": True} if grow else {}),
                              "time": round(T0 + t, 3)})


def _attempt(rd: RunDir, n: int, *, t: float, first: float, resumed: int, world: int, boot: dict, ctl: dict,
             beat: tuple | None = None) -> None:
    """attempts.jsonl's line (worker/runlog.py Attempt.stepped): `boot` and `ctl` in seconds after T0 + t and T0;
    `beat`: the previous attempt's heartbeat (its attempt, step, step time, write time)."""
    rec = {"attempt": n, "resumed_step": resumed, "time": round(T0 + t, 3), "world_size": world,
           "first_step_time": round(T0 + first, 3), "startup_s": boot,
           "controller": {k: round(T0 + v, 3) for k, v in {**ctl, "group_up": t, "train_fn_started": t}.items()}}
    if beat:
        rec["previous_progress"] = {"attempt": beat[0], "step": beat[1], "step_time": round(T0 + beat[2], 3),
                                    "time": round(T0 + beat[3], 3), "stalled": False, "stall_s": 3.0, "every_s": 10.0,
                                    "refresh_s": 60.0}
    rd.append_jsonl(ATTEMPTS, rec)


def _event(rd: RunDir, event: str, t: float, **kw) -> None:
    rd.append_jsonl(ELASTIC, {"event": event, "time": round(T0 + t, 3), **kw})


def _boot(resume_point: float, engine: float, restore: float) -> dict:
    """startup_s: when each start-up phase ended, seconds after the worker's start (worker/loop.py self.boot)."""
    return {"resume_point": resume_point, "model": engine - 1, "engine": engine, "restore": restore,
            "setup": restore + 0.05, "first_batch": restore + 0.1}


def _run(path, late: float = 0.0, running: bool = False) -> str:
    """Two submissions, every kind of the ledger given known seconds (EXPECTED); `late`: seconds nothing explains,
    before the last attempt's log record of step 90 (the loop stood still, no figure says so); `running`: the second
    submission has not ended yet."""
    rd = RunDir(str(path))
    # Submission 1. Start: driver 0-10, workers 10-13, restore 13-14 and 18-18.5, setup 14-18, first step 18.5-20.
    _event(rd, "submitted", 0)
    _event(rd, "started", 13, workers=2)
    # Attempt 0 (2 workers, steps 1-35): 9 steps of 1 s (0.2 s data wait each), a checkpoint at step 10 (2 s stall,
    # in the next window), 10 steps and a 3 s evaluation at step 20 (in the window of step 30), a checkpoint at 30.
    _log(rd, 10, 29, wait_s=0.2)
    _ckpt(rd, 10, 31, 2)
    _log(rd, 20, 44, step_s=1.2, stall_s=0.2, eval_s=3)
    _log(rd, 30, 54, step_s=1.3)
    _ckpt(rd, 30, 56, 2)
    # Steps 31-35 (56-61) are redone: a node is lost; the controller sees it at 65, tears the group down by 67,
    # waits below MIN 68-78 and starts a group at 80 (schedule 67-80 less the wait); workers 80-83, restore 83-85 and
    # 89-90, setup 85-89, first step 90-92.
    _event(rd, "lost_node", 62, nodes=["node-c"])
    _event(rd, "waiting", 68, room=1, min=2)
    _event(rd, "capacity_back", 78, waited_s=10.0, workers=2)
    _event(rd, "started", 83, workers=2)
    _attempt(rd, 0, t=13, first=20, resumed=0, world=2, boot=_boot(1, 5, 5.5), ctl={"group_starting": 10})
    _attempt(rd, 1, t=83, first=92, resumed=30, world=2, boot=_boot(2, 6, 7),
             ctl={"fault_detected": 65, "group_torn_down": 67, "group_starting": 80}, beat=(0, 35, 61, 61.5))
    # Attempt 1 (steps 31-43): 9 steps of 1 s (0.5 s data wait each), steps 41-43 unlogged (101-104, kept: the next
    # attempt resumes at 43) then a preemption notice's checkpoint at 43 (8 s stall, 104-112), the ranks hold until the node goes
    # (no lost_node: Ray counts a drained node's failure as a preemption itself):
    # notice 112-115, teardown 115-117, schedule 117-119, workers 119-121, restore 121-122 and 125-125.5, setup 122-125,
    # first step 125.5-127.
    _log(rd, 40, 101, wait_s=0.5)
    rd.append_jsonl(METRICS, {"step": 43, "time": round(T0 + 104, 3)})  # a checkpoint-only step's record: no figures
    _ckpt(rd, 43, 112, 8, notice=True)
    _event(rd, "started", 121, workers=2)
    _attempt(rd, 2, t=121, first=127, resumed=43, world=2, boot=_boot(1, 4, 4.5),
             ctl={"fault_detected": 115, "group_torn_down": 117, "group_starting": 119}, beat=(1, 43, 104, 104.2))
    # Attempt 2 (steps 44-51): 6 steps of 1 s (127-133), nodes join: a grow, its checkpoint at the next step (51,
    # 133-134, unlogged, kept) with a 2 s stall (134-136); teardown 136-137, schedule 137-138, workers 138-140, restore 140-141.5 and 144.5-145, setup
    # 141.5-144.5, first step 145-146. (The controller keeps the earlier restart's fault_detected: no restart state.)
    _log(rd, 50, 133)
    _event(rd, "grow", 133.5, **{"from": 2, "to": 4})
    _ckpt(rd, 51, 136, 2, grow=True)  # a grow's request is a notice to the ranks (worker/preemption.py)
    _event(rd, "grow_checkpoint", 136, step=51, waited_s=2.5)
    _event(rd, "started", 140, workers=4)
    _attempt(rd, 3, t=140, first=146, resumed=51, world=4, boot=_boot(1.5, 4.5, 5),
             ctl={"fault_detected": 115, "group_torn_down": 137, "group_starting": 138}, beat=(2, 51, 134, 134.5))
    # Attempt 3 (steps 52-70): 8 steps of 1 s (0.25 s data wait), 10 steps and a 2 s evaluation at 70, a 4 s
    # checkpoint; the run is stopped: shutdown 170-180 (finish).
    _log(rd, 60, 154, wait_s=0.25)
    _log(rd, 70, 166, eval_s=2)
    _ckpt(rd, 70, 170, 4)
    _event(rd, "ended", 180, ok=False)
    # Submission 2 at 300 (not running 180-300). Start: driver 300-305, workers 305-308, restore 308-309 and 312-313,
    # setup 309-312, first step 313-315. Attempt 4 (steps 71-100): 29 steps of 1 s, a final 3 s checkpoint, shutdown
    # 347-360 (finish).
    _event(rd, "submitted", 300)
    _event(rd, "started", 308, workers=4)
    _attempt(rd, 4, t=308, first=315, resumed=70, world=4, boot=_boot(1, 4, 5), ctl={"group_starting": 305},
             beat=(3, 70, 164, 172))
    _log(rd, 80, 324)
    _log(rd, 90, 334 + late)
    _log(rd, 100, 344 + late)
    _ckpt(rd, 100, 347 + late, 3)
    if not running:
        _event(rd, "ended", 360 + late, ok=True)
    return str(path)


def _check_sums(g: dict) -> None:
    """Every second once: the kinds add up to the wall time (the acceptance's 1 %; here to the rounding)."""
    total = sum(g["seconds"].values())
    assert abs(total - g["wall_s"]) <= 0.01 * g["wall_s"], (total, g["wall_s"])
    assert total == pytest.approx(g["wall_s"], abs=1e-2), g["seconds"]


def test_every_kind_gets_the_seconds_injected_and_they_sum_to_the_wall_time(tmp_path):
    g = ledger(_run(tmp_path))
    assert g["wall_s"] == pytest.approx(WALL, abs=1e-6)
    got = {k: v for k, v in g["seconds"].items() if v != 0}
    assert got.pop("other", 0.0) == pytest.approx(0.0, abs=1e-3), g["seconds"]
    assert got == pytest.approx(EXPECTED, abs=1e-6), {k: (got.get(k), EXPECTED.get(k)) for k in {*got, *EXPECTED}
                                                      if got.get(k) != pytest.approx(EXPECTED.get(k), abs=1e-6)}
    assert sum(EXPECTED.values()) == pytest.approx(WALL)  # the injection itself is whole
    _check_sums(g)
    assert g["goodput"] == pytest.approx(EXPECTED["productive"] / WALL, abs=1e-4)
    assert [a["kind"] for a in g["attempts"]] == ["start", "restart", "restart", "resize", "start"]
    assert [a["world_size"] for a in g["attempts"]] == [2, 2, 2, 4, 4]
    assert [(round(t - T0, 3), n) for t, n in g["sizes"]] == [(20, 2), (92, 2), (127, 2), (146, 4), (315, 4)]
    assert [round(a["end"] - T0, 3) for a in g["attempts"]] == [61, 112, 136, 170, 347]
    assert [a["gap_s"] for a in g["attempts"]] == [20, 31, 15, 10, 15]


def test_an_unexplained_gap_is_other(tmp_path):
    """5 s in which the loop stood still and no record says why: `other`, every other kind unchanged."""
    g = ledger(_run(tmp_path, late=5))
    assert g["wall_s"] == pytest.approx(WALL + 5, abs=1e-6)
    assert g["seconds"]["other"] == pytest.approx(5, abs=1e-6)
    assert {k: v for k, v in g["seconds"].items() if v and k != "other"} == pytest.approx(EXPECTED, abs=1e-6)
    _check_sums(g)


def test_a_resubmission_still_running_ends_at_its_newest_record(tmp_path):
    """`raytrain report` while the second submission runs: the wall time is up to its newest record (347), not the
    first submission's end, and the first submission's kinds are unchanged."""
    g = ledger(_run(tmp_path, running=True))
    assert g["wall_s"] == pytest.approx(347, abs=1e-6)
    assert {k: v for k, v in g["seconds"].items() if v} == pytest.approx({**EXPECTED, "finish": 10}, abs=1e-6)
    _check_sums(g)


def test_a_run_none_of_whose_groups_trained_is_waiting_and_start_unfinished(tmp_path):
    """Submitted, 10 s below MIN, a group that never reached its first step, the run ended: no attempt line."""
    rd = RunDir(str(tmp_path))
    _event(rd, "submitted", 0)
    _event(rd, "waiting", 5, room=1, min=2)
    _event(rd, "capacity_back", 15, waited_s=10.0, workers=2)
    _event(rd, "started", 18, workers=2)
    _event(rd, "ended", 30, ok=False)
    g = ledger(str(tmp_path))
    assert g["wall_s"] == pytest.approx(30) and g["attempts"] == [] and g["goodput"] == 0
    assert {k: v for k, v in g["seconds"].items() if v} == pytest.approx({"waiting": 10, "start/unfinished": 20})
    _check_sums(g)
    assert "none trained" in format_ledger(g)


def test_resubmissions_a_timed_out_wait_and_a_resume_from_a_memory_snapshot(tmp_path):
    """Submission 1 trains, loses a node and waits below MIN until it gives up (CapacityTimeout); submission 2 never
    reaches a first step; submission 3 resumes from a memory snapshot newer than the last log line, logging every step.
    The wait ends with its submission, each submission's tail is its own, the steps after the last log line are kept
    up to the snapshot, and the first step's own log line is not counted twice."""
    rd = RunDir(str(tmp_path))
    _event(rd, "submitted", 0)  # start: driver 0-5, workers 5-6, restore 6-7 and 8-8.5, setup 7-8, first step 8.5-10
    _attempt(rd, 0, t=6, first=10, resumed=0, world=2, boot=_boot(1, 2, 2.5), ctl={"group_starting": 5})
    _log(rd, 20, 29)  # steps 2-20
    _ckpt(rd, 20, 30, 1)
    # Steps 21-25 (30-35): the snapshot of step 23 is restored, so 21-23 are kept (3 s), 24-25 redone (2 s).
    _event(rd, "lost_node", 36, nodes=["node-b"])
    _event(rd, "waiting", 40, room=1, min=2)  # 35-40: this submission's finish; 40-60 waiting
    _event(rd, "ended", 60, ok=False)
    _event(rd, "submitted", 100)  # 60-100 not running; 100-110 a start that never got there; 110-200 not running
    _event(rd, "ended", 110, ok=False)
    _event(rd, "submitted", 200)  # start: driver 200-203, workers 203-205, restore 205-206 and 207-208, setup 206-207,
    _attempt(rd, 1, t=205, first=209.99, resumed=23, world=2, boot=_boot(1, 2, 3), ctl={"group_starting": 203},
             beat=(0, 25, 35, 38))  # first step 208-210: up to its own log line (the attempt's record written first)
    _log(rd, 24, 210, step_s=1.5)  # the first step's own line (log every step): the start's first_step already
    for step in range(25, 29):
        _log(rd, step, 211 + step - 25)  # steps 25-28: 4 s
    _ckpt(rd, 28, 216, 2)
    _event(rd, "ended", 220, ok=True)  # 216-220 finish
    g = ledger(str(tmp_path))
    want = {"start/driver": 5 + 3, "start/workers": 1 + 2, "start/restore": 1.5 + 2, "start/setup": 1 + 1,
            "start/first_step": 1.5 + 2, "productive": 19 + 3 + 4, "checkpoint_stall": 1 + 2, "redone": 2,
            "finish": 5 + 4, "waiting": 20, "not_running": 40 + 90, "start/unfinished": 10}
    assert sum(want.values()) == pytest.approx(220)
    assert g["wall_s"] == pytest.approx(220)
    assert {k: v for k, v in g["seconds"].items() if v} == pytest.approx(want, abs=1e-6)
    _check_sums(g)
    assert [(a["kind"], a["steps"]) for a in g["attempts"]] == [("start", 22), ("start", 4)]


def test_a_run_without_a_submission_event_has_no_ledger(tmp_path):
    """Trained before the ledger existed: None, not a made-up one."""
    _log(RunDir(str(tmp_path)), 10, 10)
    assert ledger(str(tmp_path)) is None


def test_format_ledger_prints_every_kind_that_has_seconds(tmp_path):
    g = ledger(_run(tmp_path, late=5))
    text = format_ledger(g)
    lines = text.splitlines()
    head = f"goodput {g['goodput']:.1%} of 365.0 s wall time (5 attempt(s), sizes 2 -> 2 -> 2 -> 4 -> 4)"
    assert lines[0] == head, lines[0]
    printed = {line.split()[0]: float(line.split()[1]) for line in lines[1:]}
    assert printed == pytest.approx({k: v for k, v in g["seconds"].items() if v > 0}, abs=0.05)
    assert set(printed) == set(EXPECTED) | {"other"}


def test_report_draws_the_ledger(tmp_path):
    """`raytrain report` on the synthetic run: goodput.png written, and the ledger's table in report.md."""
    pytest.importorskip("matplotlib")
    from raytrain.run_report import report

    run = _run(tmp_path / "run")
    _, md = report(run)
    png = tmp_path / "run" / REPORT_GOODPUT
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = open(md).read()
    assert "## Goodput" in text and "| restart/notice | 3.0 |" in text and "| not_running | 120.0 |" in text


def test_the_live_reader_reads_only_what_a_file_gained_and_gives_the_same_ledger(tmp_path, monkeypatch):
    """The Prometheus gauges' reader (raytrain/goodput_gauges.py TailReader): the ledger it gives equals the ledger
    read whole; once read, a file that grew is read from its old end (ranged), one rewritten (a resume drops lines)
    or shrunk whole again, and a line still being written is not kept."""
    from raytrain import storage
    from raytrain.goodput_gauges import TailReader

    uri = _run(tmp_path / "run")
    reader = TailReader(uri)
    assert ledger(uri, reader=reader) == ledger(uri)
    full, ranged = [], []
    monkeypatch.setattr(storage, "read_bytes", lambda u, f=storage.read_bytes: full.append(u) or f(u))
    monkeypatch.setattr(storage, "read_range", lambda u, a, b, f=storage.read_range: ranged.append((u, a, b)) or f(u, a, b))
    rd = RunDir(uri)
    for step in (99, 100):  # appended (RunDir rewrites the file with one more line)
        size = storage.size(rd.uri(METRICS))
        _log(rd, step, T0 + 900 + step)
        full.clear(), ranged.clear()
        live = ledger(uri, reader=reader)
        assert not full, full  # no file read whole
        (got,) = [(a, b) for u, a, b in ranged if u.endswith(METRICS)]
        assert got == (size - TailReader.PROBE, storage.size(rd.uri(METRICS))), (got, size)
        assert live == ledger(uri)
    text = storage.read_text(rd.uri(METRICS))
    lines = text.splitlines(keepends=True)
    storage.write_text(rd.uri(METRICS), "".join(lines[:-3]))  # a resume dropped the lines past its step
    assert reader.read_jsonl(METRICS) == rd.read_jsonl(METRICS)
    storage.write_text(rd.uri(METRICS), "".join(lines[:-3]) + lines[-1][:10])  # a line being written
    assert reader.read_jsonl(METRICS) == rd.read_jsonl(METRICS)
    storage.write_text(rd.uri(METRICS), "".join(lines[:-3]) + lines[-1])  # ... and finished
    assert reader.read_jsonl(METRICS) == rd.read_jsonl(METRICS) and reader.read_jsonl(METRICS)[-1]["step"] == 100


def test_the_gauges_take_a_ledger_with_nothing_known_yet(tmp_path, monkeypatch):
    """A run's first seconds: the ledger has no goodput yet (None); the gauges skip it instead of failing their
    thread (found by bench part 1: a traceback in the run's output)."""
    import ray.util.metrics

    from raytrain.goodput_gauges import GoodputGauges

    set_ = []

    class G:
        def __init__(self, name, **kw):
            self.name = name

        def set(self, value, tags):
            set_.append((self.name, value, tags.get("kind")))

    monkeypatch.setattr(ray.util.metrics, "Gauge", G)
    g = GoodputGauges(str(tmp_path), "r", every_s=3600)
    try:
        g.update({"goodput": None, "wall_s": 0.0, "seconds": {"start/driver": 0.0}, "sizes": []})
        g.update({"goodput": 0.5, "wall_s": 4.0, "seconds": {"productive": 2.0, "waiting": 2.0}, "sizes": [[1.0, 3]]})
    finally:
        g.close()
    assert ("raytrain_goodput_ratio", 0.5, None) in set_ and not [s for s in set_ if s[1] is None]
    assert ("raytrain_badput_seconds", 2.0, "waiting") in set_ and ("raytrain_world_size", 3.0, None) in set_
