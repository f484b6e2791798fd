"""Rank 0's record of a run: metrics.jsonl, the console progress line and summary.json, kept in the run dir.

Lines are appended to a local file and copied to the run directory in storage (every log step for
local storage, at evaluations / checkpoints / the end for object storage), so a crashed run keeps its
history up to its last checkpoint. On resume, lines past the resumed step are dropped: they belong to
work that is about to be redone, and keeping them would show the same step twice.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Optional

from raytrain import storage
from raytrain.console import say
from raytrain.rundir import ATTEMPTS, METRICS, PROGRESS, SUMMARY, RunDir
# The least time between two writes, and so how many steps a killed attempt may have done unrecorded:
# on object storage one small PUT every 2 s at most (about $0.2 a day at S3 prices); a local file can
# follow the loop closely. While the loop does not move, the time alone is refreshed every REFRESH_S.
HEARTBEAT_S = {"remote": 2.0, "local": 0.02}
REFRESH_S = 1.0
# The loop has stopped when it has made no step for STALL_STEPS times the median of its last STALL_WINDOW
# step gaps (at least STALL_MIN_S): the heartbeat then says so at once, outside the write interval.
STALL_STEPS, STALL_WINDOW, STALL_MIN_S = 3, 8, 0.05


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    return v


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def progress_every(every: Optional[int], log_every: int, max_steps: int) -> int:
    """Console lines at a multiple of the metrics interval (a progress line needs that step's metrics);
    by default about ten per run, so a long run's output stays readable."""
    want = every or max(1, max_steps // 10)
    return max(1, -(-want // log_every)) * log_every


def progress_line(rec: dict, max_steps: int, start_step: int, elapsed: float, tty: bool = False,
                  checkpoint: Optional[str] = None) -> str:
    step = rec["step"]
    done = step - start_step
    eta = elapsed / done * (max_steps - step) if done > 0 else float("nan")
    parts = [f"step {step}/{max_steps}"]
    if tty:
        # A plain-text bar (tqdm style) only on a terminal; log files get the bare line.
        filled = int(20 * step / max(1, max_steps))
        parts[0] = f"[{'#' * filled}{'.' * (20 - filled)}] {parts[0]}"
    if isinstance(rec.get("loss"), (int, float)):
        parts.append(f"loss {rec['loss']:.4f}")
    if "val_loss" in rec:
        parts.append(f"val_loss {rec['val_loss']:.4f} val_ppl {rec['val_ppl']:.2f}")
    if "tokens_per_s" in rec:
        parts.append(f"{rec['tokens_per_s']:.0f} tok/s")
    if isinstance(rec.get("mfu"), (int, float)):
        parts.append(f"MFU {rec['mfu']:.1%}")
    if math.isfinite(eta):
        parts.append(f"ETA {_duration(eta)}")
    if checkpoint:
        parts.append(f"ckpt {checkpoint}")
    return " | ".join(parts)


class RunLog:
    def __init__(self, run_uri: str, max_steps: int, resumed_step: int, enabled: bool, progress_every: int = 1,
                 *, tail: tuple = ()):
        self.run_uri, self.max_steps, self.enabled = run_uri, max_steps, enabled
        self.progress_every = progress_every
        self.checkpoint: Optional[str] = None  # the newest checkpoint saved, named on the progress line
        self.remote = storage.is_remote(run_uri)
        self.t_start = time.time()
        self.start_step = resumed_step
        self._tail = list(tail)
        self._history: Optional[list[dict]] = None if enabled else []  # read from storage on first use (open)
        self._synced = 0  # records of history already in storage

    def open(self) -> None:
        """Read what earlier attempts logged (once; every other method calls it): after the first step, so that no
        storage request stands between a fault and the first resumed step."""
        if self._history is not None:
            return
        local_dir = tempfile.mkdtemp(prefix="raytrain-log-")
        # Removed when this log goes or the process exits: every attempt opens one, a copy of the run's whole history.
        weakref.finalize(self, shutil.rmtree, local_dir, True)
        self._local = os.path.join(local_dir, METRICS)
        # What the resumed step's checkpoint already covers; from step 0 that is nothing (the validation at step 0
        # runs again, and must not be in the file twice).
        # `tail`: the records a memory snapshot carried that had not reached storage when its attempt died (remote
        # storage is written at evaluations and checkpoints only); without them a restore from memory leaves a gap.
        stored = RunDir(self.run_uri).read_jsonl(METRICS)
        seen = {json.dumps(r, sort_keys=True) for r in stored}
        step = self.start_step
        self._history = [r for r in (*stored, *(r for r in self._tail if json.dumps(r, sort_keys=True) not in seen))
                         if r.get("step", 0) < step or 0 < r.get("step", 0) == step]
        with open(self._local, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in self._history)
        self.sync()

    @property
    def history(self) -> list[dict]:
        """Every record of the run up to now (this attempt's and what earlier attempts left)."""
        self.open()
        return self._history

    def write(self, rec: dict, sync: Optional[bool] = None) -> Optional[dict]:
        """Appends the record (worker/records.py's RecordWriter hands it over); returns it as written, or None
        where disabled (ranks other than 0)."""
        if not self.enabled:
            return None
        # Wall-clock time on every line: recovery time after a failure is read off these.
        rec = {**{k: _fmt(v) for k, v in rec.items()}, "time": round(time.time(), 3)}
        self.history.append(rec)  # (opens the log first)
        with open(self._local, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if sync or (sync is None and not self.remote):
            self.sync(durable=bool(sync))
        return rec

    def sync(self, *, durable: bool = True) -> None:
        """The history to storage: on a local run directory the lines since the last sync are appended (a log step
        costs the same at step 10 and at step 100,000); on object storage the file is copied whole."""
        if not self.enabled:
            return
        self.open()
        uri = storage.join(self.run_uri, METRICS)
        if self.remote or self._synced == 0:  # (0: opened, or rewound: the file is replaced whole)
            storage.upload_file(self._local, uri)
        elif self._synced < len(self.history):
            storage.append_text(uri, "".join(json.dumps(r) + "\n" for r in self.history[self._synced:]),
                                durable=durable)
        self._synced = len(self.history)

    def unsynced(self) -> list[dict]:
        """The records written since the last upload to storage (what a memory snapshot carries)."""
        if not self.enabled:
            return []
        return self._tail if self._history is None else self._history[self._synced:]

    def rewind(self, step: int) -> None:
        """After a rollback to `step`: the records past it describe work that is about to be redone."""
        if not self.enabled:
            return
        self._history = [r for r in self.history if r.get("step", 0) <= step]
        with open(self._local, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.history)
        self._synced = 0  # the file in storage is replaced whole
        self.sync()

    def console(self, rec: dict) -> None:
        """One compact line every `progress_every` steps, at validations and at the end (step/total, loss,
        tokens/s, MFU, ETA, newest checkpoint); on a terminal a progress bar leads it. The ETA is from this
        session's own pace. Every log step's full record is in metrics.jsonl."""
        step = rec["step"]
        if not self.enabled or not (step % self.progress_every == 0 or "val_loss" in rec or step == self.max_steps):
            return
        say(progress_line(rec, self.max_steps, self.start_step, time.time() - self.t_start, sys.stdout.isatty(),
                          self.checkpoint))

    def last(self, key: str) -> Optional[float]:
        for rec in reversed(self.history):
            if key in rec:
                return rec[key]
        return None

    def first(self, key: str) -> Optional[float]:
        for rec in self.history:
            if key in rec:
                return rec[key]
        return None

    def write_summary(self, cfg, state, *, checkpoint: Optional[str], params: int, extra: dict) -> None:
        """summary.json at the end of the run (rank 0); the driver prints it (format_summary)."""
        tps = [r["tokens_per_s"] for r in self.history if "tokens_per_s" in r]
        steady = tps[1:] or tps  # the first window includes warm-up (allocation, first data read)
        summary = {
            "run": cfg.run.name, "run_uri": cfg.run_uri, "steps": state.step, "tokens_seen": state.tokens_seen,
            "final_loss": self.last("loss"), "val_loss": self.last("val_loss"), "val_ppl": self.last("val_ppl"),
            "initial_val_ppl": self.first("val_ppl"),
            "tokens_per_s": sum(steady) / len(steady) if steady else None,
            "params": params, "wall_s": round(time.time() - self.t_start, 2), "restarts": state.restarts,
            "preemptions": state.preemptions,
            "checkpoint": storage.join(cfg.run_uri, checkpoint) if checkpoint else None,
            "mfu": self.last("mfu"),
            **extra,  # health: rollbacks, violations per rule; data counters; the trackers' runs
        }
        self.sync()
        RunDir(cfg.run_uri).write_json(SUMMARY, summary)


class Heartbeat:
    """Rank 0 keeps `{step, step_time, time, stalled, ...}` in the run's progress.json.

    After a crash the next attempt reads it (`previous`) to say how far the failed attempt got: its
    metrics.jsonl lines past the resumed checkpoint are dropped, and on object storage they lag anyway
    (copied at checkpoints). A thread, not the loop, writes it: after each new step (at most once per
    `every_s`); as soon as the loop stops (no step for STALL_STEPS of its recent step times) with
    `stalled: true`; and while it stays stopped, every `refresh_s` with a fresh `time`. A beat that
    says moving means the loop may have done up to `every_s` of steps unrecorded before it failed; one
    that says stalled means it did none.
    """

    def __init__(self, run_uri: str, enabled: bool, interval_s: Optional[float] = None,
                 refresh_s: float = REFRESH_S):
        self.enabled = enabled
        self.interval_s = interval_s or HEARTBEAT_S["remote" if storage.is_remote(run_uri) else "local"]
        self.refresh_s = max(refresh_s, self.interval_s)
        self._changed = threading.Condition()
        self.uri = storage.join(run_uri, PROGRESS)
        self._step: Optional[int] = None
        self._step_time = 0.0
        self._step_gaps: list[float] = []  # seconds between the loop's recent consecutive steps
        self._written: Optional[tuple[int, bool]] = None  # (step, stalled) of the last write
        self._written_at = 0.0
        self._attempt = 0
        self._warned = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def read_previous(self) -> Optional[dict]:
        """The beat an earlier attempt left (how far it got); None if none, or torn by the crash (the run then falls
        back to time-based estimates)."""
        if not (self.enabled and storage.exists(self.uri)):
            return None
        try:
            return json.loads(storage.read_text(self.uri))
        except (ValueError, OSError):
            return None

    def start(self, attempt: int, step: int) -> "Heartbeat":
        """Beats at once with the resumed step, so a quick crash is never read as an older attempt's progress."""
        self._attempt = attempt
        self.beat(step)
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="raytrain-heartbeat", daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """Called by the loop after each step; the thread does the writing."""
        with self._changed:
            now = time.time()
            if self._step is not None and step == self._step + 1:
                self._step_gaps = (self._step_gaps + [now - self._step_time])[-STALL_WINDOW:]
            self._step, self._step_time = step, now
            self._changed.notify()

    def close(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._write()

    def stall_s(self) -> float:
        """No new step for this long: the loop has stopped (a hang, a wait on a peer, a save). The median of
        recent step gaps, so that one slow step (a checkpoint, a validation) does not move it; before the
        loop has a pace, `every_s`."""
        if not self._step_gaps:
            return self.interval_s
        return max(STALL_STEPS * sorted(self._step_gaps)[len(self._step_gaps) // 2], STALL_MIN_S)

    def _due(self, now: float) -> float:
        """Seconds until the next write (<= 0: now). Call with the lock held."""
        if self._written is None:
            return 0.0
        step, stalled = self._written
        stopped_at = self._step_time + self.stall_s()
        if self._step != step:
            # The newest step, rate-limited; but a stop at that step is said when it happens, not a
            # write interval later.
            return min(self._written_at + self.interval_s, stopped_at) - now
        if not stalled:
            # Said at once: a failure in the next `every_s` would otherwise read as `every_s` of lost steps.
            return stopped_at - now
        return self._written_at + self.refresh_s - now

    def _write(self) -> None:
        with self._changed:
            step, step_time, now = self._step, self._step_time, time.time()
            stall_s = self.stall_s()
        if step is None:
            return
        stalled = now - step_time >= 0.999 * stall_s
        try:
            storage.write_text(self.uri, json.dumps({"attempt": self._attempt, "step": step,
                                                     "step_time": round(step_time, 3), "time": round(now, 3),
                                                     "stalled": stalled, "stall_s": round(stall_s, 3),
                                                     "every_s": self.interval_s, "refresh_s": self.refresh_s}))
        except Exception as e:  # storage trouble: the checkpoint path reports it; this is only bookkeeping
            if not self._warned:
                self._warned = True
                say(f"warning: could not write {self.uri} (lost-step accounting only; said once): {e}")
        with self._changed:
            self._written, self._written_at = (step, stalled), now

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._changed:
                due = self._due(time.time())
                if due > 0:
                    # A new step or close() wakes it early to work out the next write again.
                    self._changed.wait(timeout=due)
                    continue
            self._write()


def read_summary(run_uri: str) -> Optional[dict]:
    return RunDir(run_uri).read_json(SUMMARY)


def record_attempt(run_uri: str, rec: dict) -> None:
    """Append one line to the run's attempts.jsonl (rank 0, once per attempt)."""
    RunDir(run_uri).append_jsonl(ATTEMPTS, rec)


def _placement_group() -> dict:
    """{"placement_group": id} of the worker group this rank runs in (Ray's public API), {} outside one: what a sweep's
    stopped trial removes when it cannot ask the Train controller to (raytrain/sweep/trial.py)."""
    try:
        from ray.util.placement_group import get_current_placement_group

        pg = get_current_placement_group()
    except Exception:  # noqa: BLE001 - not in a Ray worker (tests of the loop's parts)
        return {}
    return {"placement_group": pg.id.hex()} if pg is not None else {}


class Attempt:
    """Where this attempt started and when its first step was done (rank 0 records it in attempts.jsonl):
    recovery time, steps lost, cost. Owns the heartbeat that tells a later attempt how far this one got.
    Nothing here touches storage before the first step: the record and the heartbeat start after it."""

    def __init__(self, run_uri: str, *, rank: int, world: int, state, t_start: float, boot: dict):
        self.run_uri, self.t_start, self.boot, self.state = run_uri, t_start, boot, state
        self.beat = Heartbeat(run_uri, enabled=rank == 0)
        self.rec = {"attempt": state.restarts, "resumed_step": state.step, "time": round(t_start, 3),
                    "world_size": world, **_placement_group()} if rank == 0 else None
        self.first = True
        boot["setup"] = time.time()

    def got_batch(self) -> None:
        if self.first:
            self.boot["first_batch"] = time.time()

    def reached(self, step: int) -> None:
        """Right after the optimizer step: the heartbeat (a fault at this step finds it recorded)."""
        if not self.first:
            self.beat.beat(step)

    def stepped(self, done: float, *, memory: Optional[dict] = None) -> None:
        """After the attempt's first step, done at `done`, and the storage work start-up deferred past it: the
        attempt's record (with the first step's memory, measured and planned), its heartbeat."""
        if not self.first:
            return
        self.first = False
        now = time.time()
        if self.rec is not None:
            from raytrain import restart_phases

            previous = self.beat.read_previous()  # before this attempt's own first beat replaces it
            rec = {**self.rec, **({"previous_progress": previous} if previous else {}),
                   "first_step_time": round(done, 3), "records_opened_time": round(now, 3),
                   "startup_s": {k: round(v - self.t_start, 3) for k, v in self.boot.items()},
                   **({"first_step_memory": memory} if memory else {})}
            ctl = restart_phases.read(self.run_uri)  # the controller's side: fault seen, group torn down, group up
            if ctl and self.t_start - 120 <= ctl.get("train_fn_started", 0) <= self.t_start + 5:  # this group's
                rec["controller"] = ctl
            record_attempt(self.run_uri, rec)
        self.beat.start(self.state.restarts, self.state.step)

    def close(self) -> None:
        self.beat.close()
