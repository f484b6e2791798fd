"""The run directory's one owner: torn JSONL lines never break a reader, appends after a torn line stay lines."""

import gc
import os

from raytrain.ckpt.catalog import describe
from raytrain.export import reported_val
from raytrain.rundir import ATTEMPTS, METRICS, SUMMARY, RunDir
from raytrain.worker.interval import run_history


def test_a_torn_last_line_is_skipped_by_every_reader(tmp_path):
    run = RunDir(str(tmp_path))
    (tmp_path / METRICS).write_text('{"step": 4, "val_loss": 2.0, "val_ppl": 7.4}\n{"step": 5, "loss": 1.9}\n{"step": 6, "lo')
    assert [r["step"] for r in run.read_jsonl(METRICS)] == [4, 5]
    assert reported_val(str(tmp_path), 4) == {"val_loss": 2.0, "val_ppl": 7.4}
    assert describe(str(tmp_path)) == []  # no checkpoints, and the torn metrics line did not raise
    (tmp_path / ATTEMPTS).write_text('{"attempt": 0, "time": 10.0}\n{"attem')
    run.append_jsonl(ATTEMPTS, {"attempt": 1, "time": 20.0})  # a new attempt after a killed writer
    assert [r["attempt"] for r in run.read_jsonl(ATTEMPTS)] == [0, 1]
    assert run_history(str(tmp_path)) == (10.0, 2)


def test_missing_or_torn_json_reads_as_none(tmp_path):
    run = RunDir(str(tmp_path))
    assert run.read_json(SUMMARY) is None
    (tmp_path / SUMMARY).write_text('{"steps": 3')
    assert run.read_json(SUMMARY) is None
    run.write_json(SUMMARY, {"steps": 3})
    assert run.read_json(SUMMARY) == {"steps": 3}


def test_a_local_run_log_appends_each_record_and_rewrites_the_file_only_when_it_must(tmp_path, monkeypatch):
    """metrics.jsonl in a local run directory: a log step appends its line (its cost does not grow with the run's
    length); the file is written whole only when opened and after a rollback's rewind."""
    from raytrain import storage
    from raytrain.rundir import METRICS, RunDir
    from raytrain.worker.runlog import RunLog

    whole, real = [], storage.upload_file
    monkeypatch.setattr(storage, "upload_file", lambda src, uri: whole.append(uri) or real(src, uri))
    log = RunLog(str(tmp_path), 300, 0, enabled=True)
    for step in range(1, 301):
        log.write({"step": step, "loss": 1.0 / step})
    steps = [r["step"] for r in RunDir(str(tmp_path)).read_jsonl(METRICS)]
    assert steps == list(range(1, 301)) and len(whole) <= 2, len(whole)  # the open, and the first record's sync
    log.rewind(120)
    log.write({"step": 121, "loss": 0.5}, sync=True)
    assert [r["step"] for r in RunDir(str(tmp_path)).read_jsonl(METRICS)] == list(range(1, 122))
    assert len(whole) <= 3 and log.unsynced() == []
    # Each attempt's local copy of the history goes with its log (else /tmp gains a copy of it per attempt).
    local = os.path.dirname(log._local)
    assert os.path.isdir(local)
    del log
    gc.collect()
    assert not os.path.exists(local)
