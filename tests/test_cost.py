"""`raytrain cost` on a run directory with known node times, restarts and checkpoint costs: exact numbers out."""

from __future__ import annotations

import calendar
import json
import math
import os
import time

import pytest

from raytrain.ckpt.layout import dir_name, timestamp
from raytrain.cli import main
from raytrain.config import load_config
from raytrain.cost import young_daly_s

T0 = 1_800_000_000.0  # a fixed epoch second (January 2027); the run's times are offsets from it


@pytest.fixture
def run_dir(tmp_path):
    return _write_run(tmp_path / "r", T0)


def _write_run(run, t0: float):
    """A 2-hour run from t0: head 2 h, two spot workers (one reclaimed at 1 h and replaced 60 s later)."""
    run.mkdir()
    cfg = load_config("tiny", ["run.name=r", "cost.spot_per_hour=0.5", "cost.on_demand_per_hour=2.0",
                               "cost.head_per_hour=0.25"])
    (run / "config.yaml").write_text(cfg.to_yaml())
    h = 3600.0
    nodes = [
        {"node_id": "h", "type": "head", "market": "on-demand", "first_seen": t0, "last_seen": t0 + 2 * h, "lost": False},
        {"node_id": "a", "type": "spot", "market": "spot", "first_seen": t0, "last_seen": t0 + 2 * h, "lost": False},
        {"node_id": "b", "type": "spot", "market": "spot", "first_seen": t0, "last_seen": t0 + h, "lost": True,
         "lost_at": t0 + h + 5},
        {"node_id": "c", "type": "spot", "market": "spot", "first_seen": t0 + h + 60, "last_seen": t0 + 2 * h,
         "lost": False},
    ]
    (run / "nodes.json").write_text(json.dumps({"nodes": nodes}))
    # Attempt 0 trains from t0+10 at 1 step/s; the node dies at t0+h+5; attempt 1 resumes from the
    # checkpoint at step 3000 (committed at t0+10+3000) and trains again from t0+h+100.
    (run / "attempts.jsonl").write_text(
        json.dumps({"attempt": 0, "resumed_step": 0, "time": t0, "first_step_time": t0 + 10}) + "\n"
        + json.dumps({"attempt": 1, "resumed_step": 3000, "time": t0 + h + 70, "first_step_time": t0 + h + 100}) + "\n")
    ck = run / "checkpoint_00003000"
    ck.mkdir()
    (ck / "manifest.json").write_text(json.dumps({"step": 3000, "files": {}, "committed": timestamp(t0 + 10 + 3000)}))
    metrics = [{"step": s, "loss": 1.0, "tokens_per_s": 1024.0, "samples_per_s": 8.0} for s in range(100, 6001, 100)]
    metrics += [{"step": s, "checkpoint": dir_name(s), "ckpt_stall_s": 2.0} for s in range(1000, 6001, 1000)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run / "summary.json").write_text(json.dumps({"run": "r", "steps": 6000, "tokens_seen": 6000 * 1024,
                                                  "wall_s": 7200, "restarts": 1}))
    return run


def test_cost_report_numbers(run_dir, capsys):
    assert main(["cost", str(run_dir), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    spot_h = 2 + 1 + (3600 - 60) / 3600
    assert r["by_market"]["spot"]["node_hours"] == pytest.approx(spot_h)
    assert r["by_market"]["on-demand (head)"]["node_hours"] == pytest.approx(2.0)
    assert r["cost"] == pytest.approx(spot_h * 0.5 + 2 * 0.25)
    assert r["on_demand_cost"] == pytest.approx(spot_h * 2.0 + 2 * 0.25)
    assert r["preemptions"] == 1 and r["nodes_lost"] == 1
    assert r["step_s"] == pytest.approx(1.0)
    # Lost work: from the checkpoint's commit (T0+3010) to the node loss (T0+3605) = 595 s = 595 steps.
    assert r["restarts"] == [{"resumed_step": 3000, "lost_s": 595.0, "lost_steps": 595, "lost_steps_from": "time",
                              "recovery_s": 95.0}]
    assert r["lost_steps"] == 595
    assert r["checkpoints"] == 6 and r["checkpoint_cost_s"] == pytest.approx(2.0)
    # Young-Daly with the observed MTBF: 7200 s of run / 1 interruption.
    assert r["mtbf_s"] == pytest.approx(7200) and r["mtbf_source"] == "observed"
    assert r["young_daly_s"] == pytest.approx(math.sqrt(2 * 2.0 * 7200)) == pytest.approx(169.7, abs=0.1)
    assert r["young_daly_steps"] == 170


@pytest.fixture
def new_york():
    """The local zone is America/New_York (summer time from March to November) for the test."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "America/New_York"
    time.tzset()
    yield
    if old is None:
        os.environ.pop("TZ")
    else:
        os.environ["TZ"] = old
    time.tzset()


def test_commit_times_are_utc_where_the_local_zone_has_summer_time(tmp_path, new_york, capsys):
    # The same run in July: commit times are UTC whatever the local zone; read as local time they would be an
    # hour off in New York's summer, and the work lost since the checkpoint an hour too long.
    july = float(calendar.timegm((2027, 7, 15, 12, 0, 0)))
    assert time.localtime(july).tm_isdst == 1
    assert main(["cost", str(_write_run(tmp_path / "july", july)), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["restarts"][0]["lost_s"] == 595.0 and r["lost_steps"] == 595


def test_cost_text_and_overrides(run_dir, capsys):
    assert main(["cost", str(run_dir), "cost.spot_per_hour=0.25", "--mtbf-hours", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "spot" in out and "preemptions 1" in out and "lost steps 595" in out
    assert f"= {young_daly_s(2.0, 1800):.0f}s" in out and "(given)" in out
    assert "spot 0.25" in out  # the override replaced the run's own price


def _with_heartbeat(run_dir, beat: dict) -> None:
    lines = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    lines[1]["previous_progress"] = beat
    (run_dir / "attempts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_lost_steps_from_the_failed_attempts_heartbeat(run_dir, capsys):
    # Training normally: step 3590 done at T0+h+2, beat at T0+h+3, node gone at T0+h+5 (seen by the
    # recorder). The failure was after the beat and at most one beat (2 s) later: 2 more steps at 1 step/s.
    h = 3600.0
    _with_heartbeat(run_dir, {"attempt": 0, "step": 3590, "step_time": T0 + h + 2, "time": T0 + h + 3})
    assert main(["cost", str(run_dir), "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["restarts"]
    assert r["lost_steps"] == 590 + 2 and r["lost_steps_from"] == "heartbeat" and r["lost_s"] == 595.0

    # Stuck since step 3012 (its last step 500 s before the beat): the time lost is not 500 steps of work.
    _with_heartbeat(run_dir, {"attempt": 0, "step": 3012, "step_time": T0 + h - 498, "time": T0 + h + 2})
    assert main(["cost", str(run_dir), "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["restarts"]
    assert r["lost_steps"] == 12 and r["lost_s"] == 594.0  # failed within a beat (2 s) of its last one

    # Stopped at step 3012 a second before its last beat (the spot drill: hung, then reclaimed): the beat
    # says so, and the 2 s after it were not 2 steps of work. Judged by its age alone it would look moving.
    stop = {"attempt": 0, "step": 3012, "step_time": T0 + h + 0.5, "time": T0 + h + 1.5}
    for stalled, lost in ((True, 12), (False, 12 + 2)):
        _with_heartbeat(run_dir, {**stop, "stalled": stalled})
        assert main(["cost", str(run_dir), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["restarts"][0]["lost_steps"] == lost, stalled

    # A beat older than the failed attempt (it died before its first beat) is not taken for its progress.
    _with_heartbeat(run_dir, {"attempt": 0, "step": 3500, "step_time": T0 - 100, "time": T0 - 99})
    assert main(["cost", str(run_dir)]) == 0
    assert "lost 595.0s of work (595 steps, estimated from the median step rate)" in capsys.readouterr().out


def test_heartbeat_is_read_back_by_the_next_attempt(tmp_path):
    from raytrain.worker.runlog import Heartbeat

    run = str(tmp_path / "run")
    first = Heartbeat(run, enabled=True, interval_s=0.05)
    assert first.read_previous() is None
    first.start(attempt=0, step=10)
    first.beat(11)
    first.beat(12)
    time.sleep(0.3)  # no close(): a killed attempt leaves only what its thread wrote
    previous = Heartbeat(run, enabled=True).read_previous()
    assert previous["step"] == 12 and previous["attempt"] == 0
    assert previous["time"] >= previous["step_time"]
    first.close()
    stuck = Heartbeat(run, enabled=True, interval_s=0.01, refresh_s=0.1).start(attempt=1, step=12)
    stuck.beat(13)
    time.sleep(0.5)  # no new step: the time alone is refreshed, so the wait shows as a wait
    beat = json.loads((tmp_path / "run" / "progress.json").read_text())
    assert beat["step"] == 13 and beat["time"] - beat["step_time"] >= 0.1 and beat["refresh_s"] == 0.1
    stuck.close()
    (tmp_path / "run" / "progress.json").write_text('{"step": 1')  # torn by a crash
    assert Heartbeat(run, enabled=True).read_previous() is None
    assert Heartbeat(run, enabled=False).read_previous() is None


def test_heartbeat_says_a_stop_at_once_not_a_write_interval_later(tmp_path, monkeypatch):
    # The spot drill on object storage (one write per 2 s while moving): fast steps, then the loop hangs
    # and is killed within the write interval. Its last beat must say it had stopped, or `raytrain cost`
    # credits it with 2 s of steps it never did (47 at 0.04 s/step in the drill).
    from raytrain import storage
    from raytrain.worker.runlog import Heartbeat

    writes = []
    write_text = storage.write_text
    monkeypatch.setattr(storage, "write_text", lambda uri, text: (writes.append(text), write_text(uri, text)))
    # A write interval of 60 s (the drill's is 2 s) sets "at once" far apart from "a write interval later".
    beat = Heartbeat(str(tmp_path / "run"), enabled=True, interval_s=60.0).start(attempt=0, step=0)
    for step in range(1, 31):
        time.sleep(0.02)
        beat.beat(step)
    # No close(): a killed attempt leaves only what its thread wrote. Waited for: normal about 0.1 s (three of
    # the loop's step gaps); 30 s only catches a hang, and is half the write interval, so a stop said only at
    # the next interval never arrives in time.
    deadline, last = time.monotonic() + 30, {}
    while not last.get("stalled") and time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            last = json.loads((tmp_path / "run" / "progress.json").read_text())
        except ValueError:  # caught mid-write
            last = {}
    assert last["step"] == 30 and last["stalled"] is True, last
    assert len(writes) == 2, writes  # the start and the stop: moving, no write before the interval
    beat.close()


def test_heartbeat_storage_trouble_is_said_once(tmp_path, monkeypatch):
    from raytrain.worker import runlog

    said = []
    monkeypatch.setattr(runlog, "say", said.append)
    (tmp_path / "file").write_text("not a directory")
    beat = runlog.Heartbeat(str(tmp_path / "file" / "run"), enabled=True, interval_s=0.01).start(attempt=0, step=0)
    for step in range(1, 20):
        beat.beat(step)
        time.sleep(0.01)
    beat.close()
    assert len(said) == 1 and "could not write" in said[0] and "said once" in said[0]


def test_uninterrupted_run_uses_its_configured_mtbf(run_dir, capsys):
    (run_dir / "nodes.json").write_text(json.dumps({"nodes": [
        {"node_id": "a", "type": "spot", "market": "spot", "first_seen": T0, "last_seen": T0 + 3600, "lost": False}]}))
    first = (run_dir / "attempts.jsonl").read_text().splitlines()[0]
    (run_dir / "attempts.jsonl").write_text(first + "\n")
    assert main(["cost", str(run_dir), "checkpoint.mtbf_s=1800", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["preemptions"] == 0 and r["restarts"] == [] and r["lost_steps"] == 0
    assert r["mtbf_s"] == 1800 and r["mtbf_source"] == "checkpoint.mtbf_s"
    assert r["young_daly_s"] == pytest.approx(young_daly_s(2.0, 1800))
    assert main(["cost", str(run_dir)]) == 0  # the saved config's 7200 s
    out = capsys.readouterr().out
    assert f"= {young_daly_s(2.0, 7200):.0f}s" in out and "no interruption observed" in out


def test_young_daly_formula():
    assert young_daly_s(30.0, 3600.0) == pytest.approx(math.sqrt(2 * 30 * 3600)) == pytest.approx(464.76, abs=0.01)


def test_cost_of_a_missing_run_is_one_line_error(tmp_path, capsys):
    assert main(["cost", str(tmp_path / "nope")]) == 2
    assert "run directory not found" in capsys.readouterr().err


def test_run_report_lists_restarts_with_the_step_resumed_at(run_dir, tmp_path):
    """`raytrain report` marks each restart: step resumed at, steps redone and wall seconds lost, counted as
    `raytrain cost` counts them."""
    assert main(["report", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert "## Restarts" in text
    # Resumed at 3000 (committed T0+3010); the node died at T0+h+5: 595 s of work thrown away at 1 step/s
    # (595 steps redone), then 95 s until the next attempt's first step.
    row = next(line for line in text.splitlines() if line.startswith("| 1 | 3000 |"))
    # The last column, where the restart restored from, is "-" here: this run has no restores.jsonl.
    assert [c.strip() for c in row.strip("|").split("|")] == ["1", "3000", "595", "690.0", "95.0", "-"], row
