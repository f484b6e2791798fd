"""One path for every metric record of a run: `RecordWriter.write` hands each record to every sink that wants it.

The sinks, and what each gets (`SINKS`):
- with history, every record (rank 0): metrics.jsonl (worker/runlog.py: resume and rollback drop the lines past
  the step trained from), the W&B / MLflow trackers (worker/trackers.py: they skip what they already hold),
  TensorBoard event files;
- latest values, every record (every rank: each worker's own gauges): Prometheus (worker/metrics.py);
- Ray Train's report, and through it Tune (sweep/trial.py): the validation and checkpoint records only. A report
  is a collective over the workers, and waits until Ray Train's controller has taken the previous one (it polls
  every 0.5 s): about 5 ms when that was long enough ago, up to 0.5 s when not, so never per step; a step's
  records go in one report at the end of the step, and every rank reports at the same steps.
Kinds of record: a log step, a validation (its log step's figures too; step 0 on a fresh start), a checkpoint,
a rollback, a downstream (lm-eval) evaluation.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from typing import Callable, Optional

from raytrain.rundir import TENSORBOARD, RunDir
from raytrain.worker.trackers import NOT_METRICS

# kind -> the sinks that take it ("history": metrics.jsonl, trackers, TensorBoard)
SINKS = {
    "step": ("history", "prometheus"),
    "validation": ("history", "prometheus", "report"),
    "checkpoint": ("history", "prometheus", "report"),
    "rollback": ("history", "prometheus"),
    # Rank 0's alone, at any step: a report (a collective) would wait for ranks that have nothing to report.
    "downstream": ("history", "prometheus"),
}


class TensorBoard:
    """Rank 0's event files in <run>/tensorboard/ (written locally, copied to object storage at syncs).

    Written on the training thread, one event per record (its numbers as scalars at its step), each on disk as it
    is written: SummaryWriter's queue and thread would leave a killed attempt's last records unwritten, and nothing
    sends them again. It costs the training thread what SummaryWriter's add_scalar calls did (1.5-1.8 ms against
    1.6-2.3 ms for a 33-figure record on a 2-core machine)."""

    def __init__(self, run_uri: str):
        from tensorboardX.event_file_writer import EventsWriter

        from raytrain import storage

        self.run_uri, self.remote = run_uri, storage.is_remote(run_uri)
        self.dir = tempfile.mkdtemp(prefix="raytrain-tb-") if self.remote else \
            storage.resolve(RunDir(run_uri).uri(TENSORBOARD))[1]
        os.makedirs(self.dir, exist_ok=True)
        # The file is named by the second it was made: the process id keeps two attempts' files apart.
        self.writer = EventsWriter(os.path.join(self.dir, "events"), filename_suffix=f".{os.getpid()}")

    def write(self, rec: dict) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=re.sub(r"[^-/\w.]", "_", k), simple_value=float(v)) for k, v in rec.items()
                  if k not in NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)
                  and math.isfinite(v)]
        if values:
            self.writer.write_event(Event(wall_time=rec.get("time", time.time()), step=rec["step"],
                                          summary=Summary(value=values)))
            self.writer.flush()

    def sync(self) -> None:
        from raytrain import storage

        if self.remote:
            for name in os.listdir(self.dir):
                storage.upload_file(os.path.join(self.dir, name), RunDir(self.run_uri).uri(TENSORBOARD, name))

    def close(self) -> None:
        self.sync()
        self.writer.close()


class RecordWriter:
    """Every rank has one; the history sinks are rank 0's (`log` and `trackers` are disabled on the others).

    `prometheus`: the worker's RayMetrics; `report`: `ray.train.report` (None outside a Ray Train worker)."""

    def __init__(self, cfg, *, rank: int, log, trackers, prometheus=None,
                 report: Optional[Callable[[dict], None]] = None):
        self.log, self.trackers, self.prometheus, self._report = log, trackers, prometheus, report
        self.tb = TensorBoard(cfg.run_uri) if (cfg.metrics.tensorboard and rank == 0) else None
        self.opened = not log.enabled
        self.due: dict = {}  # this step's records for the next report, merged

    def open(self) -> None:
        """Rank 0's history, once (metrics.jsonl read from storage; `write` calls it first): what earlier attempts
        logged, sent to the trackers again (they skip what they hold: this is what a killed attempt wrote but had
        not sent yet)."""
        if self.opened:
            return
        self.opened = True
        self.log.open()
        for r in self.log.history:
            self.trackers.write(r)

    def write(self, rec: dict, kind: str, *, sync: Optional[bool] = None) -> None:
        """One record to its sinks (SINKS[kind]). `sync`: copy the history to storage now (True), not now (False),
        or the run log's default (None: every record for local storage, at syncs only for object storage)."""
        sinks = SINKS[kind]
        if "history" in sinks:
            self.open()
            written = self.log.write(rec, sync=sync)  # with its `time`; None on ranks other than 0
            if written is not None:
                self.trackers.write(written)
                if self.tb is not None:
                    self.tb.write(written)
                    if sync:
                        self.tb.sync()
        if "prometheus" in sinks and self.prometheus is not None:
            self.prometheus.record(rec)
        if "report" in sinks and self._report is not None:
            self.due.update(rec)

    def report(self) -> None:
        """The step's validation / checkpoint records as one report (collective: every rank calls it alike)."""
        if self.due:
            due, self.due = self.due, {}
            self._report(due)

    def close(self) -> dict:
        """End of the attempt: TensorBoard's last copy; the trackers' last records sent (at most
        metrics.tracker_timeout_s). Returns summary.json's `trackers` entry (rank 0 with trackers on) or {}."""
        if self.tb is not None:
            self.tb.close()
        if not self.trackers.trackers:
            return {}
        return {"trackers": self.trackers.close(finished=True)}
