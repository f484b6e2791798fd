"""Experiment trackers (W&B, MLflow): rank 0's metrics.jsonl records, sent off the training thread into one tracker run per training run.

`RunLog.write` hands every record to `Trackers.write`, which only queues it; one thread per tracker opens
(or reopens) the tracker run and sends. The tracker run's id is kept in <run>/trackers.json, so every
worker restart, resize, health rollback and resubmission of the run logs into the same tracker run.
A replayed step (after a resume or a rollback) is sent only for the keys the tracker has not had at that
step yet: nothing is logged twice, and W&B, which steps by its own counter here (the training step is the
`step` metric every other metric is plotted against), never refuses a step. A tracker that fails costs one
warning line; training and metrics.jsonl go on without it (or, with metrics.on_tracker_failure=stop, the
run stops).
"""

from __future__ import annotations

import importlib.util
import math
import queue
import threading
import time
import uuid
from typing import Callable, Optional

from raytrain.errors import UserError
from raytrain.rundir import TRACKERS, RunDir

QUEUE_MAX = 100_000  # records held while a tracker is slow; past this it counts as failed (memory stays bounded)
BATCH_MAX = 200  # records per send: a tracker that fell behind catches up in a few requests
SEND_EVERY_S = 3.0  # records are sent in batches at most this often: a request per record made the tiny model's
# log-every-step run 1.15x slower on 2 cores; batched, the same runs measure 0.93-0.98x (bench part `trackers`)
NOTE_S = 2.0  # how often the step sent through is noted in trackers.json (a small write, off the training thread)
STOP = object()
# Fields of a record that are not figures to plot: the step itself, the wall clock (the metric's
# timestamp), and the batch fingerprint (an id; a float would round it).
NOT_METRICS = {"step", "time", "batch_crc32", "content_checksum", "data_position"}
TEXT_FIELDS = ("checkpoint", "event", "rule", "resumed_from")  # sent as text (W&B) / tags (MLflow)


def wanted(cfg) -> dict[str, str]:
    """{tracker: the Python module it needs} for the trackers this config turns on."""
    m = cfg.metrics
    return {**({"wandb": "wandb"} if m.wandb.project else {}), **({"mlflow": "mlflow"} if m.mlflow.tracking_uri else {})}


def check_installed(cfg) -> None:
    """Driver side, before any worker starts: each tracker the config turns on has its library."""
    for name, module in wanted(cfg).items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            key = "metrics.wandb.project" if name == "wandb" else "metrics.mlflow.tracking_uri"
            raise UserError(f"{key} is set but the {module} library is not installed: pip install 'raytrain[{name}]' "
                            f"(on every node), or unset {key}")


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"optim": {"lr": 3e-4}} -> {"optim.lr": 3e-4}: the resolved config as tracker parameters."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def split_record(rec: dict) -> tuple[dict, dict]:
    """(figures, texts) of a record: finite numbers (booleans as 0/1) and the event / checkpoint names."""
    figures = {k: float(v) for k, v in rec.items() if k not in NOT_METRICS and isinstance(v, (int, float))
               and math.isfinite(v)}
    texts = {k: str(rec[k]) for k in TEXT_FIELDS if rec.get(k) is not None}
    return figures, texts


class MlflowBackend:
    """One MLflow run through MlflowClient (batched log_batch calls)."""

    name = "mlflow"
    KEY_TAG = "raytrain.key"  # our id of the MLflow run, chosen before it is created (MLflow picks the run id)

    def __init__(self, cfg):
        self.uri, self.experiment = cfg.metrics.mlflow.tracking_uri, cfg.metrics.mlflow.experiment
        self.client, self.run_id, self.key = None, None, None

    def claim(self, known: Optional[dict]) -> dict:
        """Our key of the run, kept before create_run: an attempt killed between creating the run and noting its id
        leaves the key, and the next attempt finds that run by it instead of creating a second one."""
        same = bool(known) and known.get("tracking_uri") == self.uri
        self.run_id = known.get("run_id") if same else None
        self.key = (known.get("key") if same else None) or uuid.uuid4().hex
        return {**self.where(), "logged_through": known.get("logged_through", -1) if same else -1}

    def open(self, known: Optional[dict], *, config: dict, restarts: int) -> dict[str, int]:
        """Reopens the known run (same tracking URI) or creates one; returns {key: last step it holds}."""
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.client = c = MlflowClient(tracking_uri=self.uri)
        if self.key is None:
            self.claim(known)
        if self.run_id is None:
            exp = c.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp else c.create_experiment(self.experiment)
            found = c.search_runs([exp_id], filter_string=f"tags.`{self.KEY_TAG}` = '{self.key}'", max_results=1)
            run = found[0] if found else c.create_run(
                exp_id, run_name=config["run"]["name"],
                tags={"raytrain.run": config["run"]["name"], self.KEY_TAG: self.key})
            self.run_id = run.info.run_id
        else:
            run = c.get_run(self.run_id)
        c.update_run(self.run_id, status="RUNNING")
        have = run.data.params  # parameters are immutable in MLflow: the first value of a key stays
        params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items() if k not in have]
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            c.log_batch(self.run_id, params=params[i:i + 100])
        c.log_batch(self.run_id, tags=[RunTag("raytrain.restarts", str(restarts))])
        # The newest step of each metric it holds (the run's latest values carry no step in the public API).
        return {key: max((m.step for m in c.get_metric_history(self.run_id, key)), default=0)
                for key in run.data.metrics}

    def where(self) -> dict:
        return {"run_id": self.run_id, "tracking_uri": self.uri, "key": self.key}

    def send(self, items: list[tuple[int, float, dict, dict]]) -> None:
        from mlflow.entities import Metric, RunTag

        metrics = [Metric(k, v, int(t * 1000), step) for step, t, figures, _ in items for k, v in figures.items()]
        tags = {k: v for _, _, _, texts in items for k, v in texts.items()}  # the newest of each
        for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])
        if tags:
            self.client.log_batch(self.run_id, tags=[RunTag(f"raytrain.{k}", v) for k, v in tags.items()])

    def close(self, finished: bool) -> None:
        if finished:
            self.client.set_terminated(self.run_id, "FINISHED")


class WandbBackend:
    """One W&B run (resumed by id), plotted against the training step logged as the `step` metric."""

    name = "wandb"

    def __init__(self, cfg):
        self.section, self.run, self.run_id = cfg.metrics.wandb, None, None

    def open(self, known: Optional[dict], *, config: dict, restarts: int) -> dict[str, int]:
        import wandb

        w = self.section
        if self.run_id is None:
            self.claim(known)
        self.run = wandb.init(project=w.project, entity=w.entity, mode=w.mode, tags=list(w.tags) or None,
                              group=w.group, dir=w.dir, id=self.run_id, resume="allow", name=config["run"]["name"],
                              settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        self.run.config.update(config, allow_val_change=True)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.run.summary["restarts"] = restarts
        # Online, the resumed run's summary holds the last step sent; offline it holds nothing, and the step
        # our thread last noted in trackers.json stands in (a kill may land between two notes).
        last = [x for x in (self.run.summary.get("step"), (known or {}).get("logged_through"))
                if isinstance(x, (int, float))]
        return {"*": int(max(last))} if last else {}

    def claim(self, known: Optional[dict]) -> dict:
        """The run id, chosen before wandb.init (seconds): an attempt killed meanwhile leaves it for the next."""
        self.run_id = known["run_id"] if known else uuid.uuid4().hex[:8]
        return {**self.where(), "logged_through": (known or {}).get("logged_through", -1)}

    def where(self) -> dict:
        return {"run_id": self.run_id, "project": self.section.project, "mode": self.section.mode}

    def send(self, items: list[tuple[int, float, dict, dict]]) -> None:
        for step, _, figures, texts in items:
            self.run.log({"step": step, **figures, **texts})

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


class Tracker:
    """One tracker's queue and thread: open, then send batches of records until closed; the first error ends it."""

    def __init__(self, backend, *, owner: "Trackers"):
        self.backend, self.owner = backend, owner
        self.q: queue.Queue = queue.Queue(maxsize=QUEUE_MAX)
        self.logged: dict[str, int] = {}  # key -> the last step the tracker holds for it
        self.error: Optional[str] = None
        self.through, self.noted = -1, 0.0
        self.thread = threading.Thread(target=self._run, name=f"raytrain-{backend.name}", daemon=True)
        self.thread.start()

    def put(self, rec: dict) -> None:
        if self.error is None:
            try:
                self.q.put_nowait(rec)
            except queue.Full:
                self.fail(f"{QUEUE_MAX} records are waiting: it answers slower than training logs")

    def fresh(self, rec: dict) -> Optional[tuple[int, float, dict, dict]]:
        """The record's keys that the tracker has not had at its step yet (a replayed step adds nothing)."""
        step = rec["step"]
        floor = self.logged.get("*", -1)
        figures, texts = split_record(rec)
        figures = {k: v for k, v in figures.items() if step > max(floor, self.logged.get(k, -1))}
        texts = texts if figures or step > floor else {}
        if not figures and not texts:
            return None
        self.logged.update(dict.fromkeys(figures, step))
        return step, rec.get("time", time.time()), figures, texts

    def note(self, step: int, force: bool) -> None:
        """The step sent through, in trackers.json every NOTE_S at most: what an offline W&B resume starts after."""
        self.through = max(self.through, step)
        if force or time.time() - self.noted >= NOTE_S:
            self.noted = time.time()
            self.owner.remember(self.backend.name, {**self.backend.where(), "logged_through": self.through})

    def fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
            self.owner.warn(self.backend.name, why)

    def _run(self) -> None:
        finished = False
        try:
            known = self.owner.known.get(self.backend.name)
            self.owner.remember(self.backend.name, self.backend.claim(known))  # before the tracker's run exists
            self.logged = self.backend.open(known, config=self.owner.config, restarts=self.owner.restarts)
            self.through = max(self.logged.values(), default=-1)
            self.owner.remember(self.backend.name, {**self.backend.where(), "logged_through": self.through})
            self.noted = time.time()
            while True:
                recs = [self.q.get()]
                deadline = time.time() + SEND_EVERY_S
                while len(recs) < BATCH_MAX and recs[-1] is not STOP:
                    try:
                        recs.append(self.q.get(timeout=max(0.0, deadline - time.time())))
                    except queue.Empty:
                        break
                stop = recs[-1] is STOP
                items = [i for i in (self.fresh(r) for r in recs if r is not STOP)
                         if i is not None]
                if items:
                    self.backend.send(items)
                    self.note(max(i[0] for i in items), force=stop)
                if stop:
                    finished = self.owner.finished
                    break
            self.backend.close(finished)
        except Exception as e:  # noqa: BLE001 - any tracker trouble is the tracker's, never the training's
            self.fail(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}")

    def close(self, deadline: float) -> None:
        if self.error is None:
            try:
                self.q.put(STOP, timeout=max(0.0, deadline - time.time()))
            except queue.Full:
                pass
        self.thread.join(timeout=max(0.0, deadline - time.time()))
        if self.thread.is_alive():
            self.fail(f"it did not take the run's last records within metrics.tracker_timeout_s="
                      f"{self.owner.timeout_s:g}")


class Trackers:
    """Rank 0's trackers for this attempt: `write(rec)` queues (cheap, on the training thread), `close()` ends them."""

    def __init__(self, cfg, *, enabled: bool, restarts: int = 0, log: Callable[[str], None] = print):
        self.log, self.run_dir, self.restarts = log, RunDir(cfg.run_uri), restarts
        self.on_failure, self.timeout_s = cfg.metrics.on_tracker_failure, cfg.metrics.tracker_timeout_s
        self.config, self.finished = cfg.to_dict(), False
        self.warnings: list[str] = []
        self.lock = threading.Lock()
        backends = [b(cfg) for b, on in ((WandbBackend, cfg.metrics.wandb.project),
                                        (MlflowBackend, cfg.metrics.mlflow.tracking_uri)) if on] if enabled else []
        self.known = (self.run_dir.read_json(TRACKERS) or {}) if backends else {}
        self.trackers = [Tracker(b, owner=self) for b in backends]

    def write(self, rec: dict) -> None:
        """One metrics.jsonl record, as written (with its `time`)."""
        for t in self.trackers:
            t.put(rec)
            if t.error is not None and self.on_failure == "stop":
                raise UserError(f"the {t.backend.name} tracker failed ({t.error}) and metrics.on_tracker_failure=stop: "
                                "fix the tracker and submit the run again (it resumes), or set on_tracker_failure=warn")

    def warn(self, name: str, why: str) -> None:
        line = (f"warning: the {name} tracker stopped ({why}); training goes on without it and metrics.jsonl has "
                f"every record (said once; metrics.on_tracker_failure=stop stops the run instead)")
        with self.lock:
            self.warnings.append(line)
        self.log(line)

    def remember(self, name: str, where: dict) -> None:
        """The tracker run's id in trackers.json (read, merged, written: one writer per tracker, under a lock)."""
        with self.lock:
            now = self.run_dir.read_json(TRACKERS) or {}
            if now.get(name) != where and not (now.get(name, {}).get("logged_through", -1) > where["logged_through"]
                                               and now[name].get("run_id") == where["run_id"]):
                self.run_dir.write_json(TRACKERS, {**now, name: where})

    def close(self, finished: bool = True) -> dict:
        """Wait (at most tracker_timeout_s) for every tracker to send what it holds; {tracker: where, error}."""
        self.finished = finished
        deadline = time.time() + self.timeout_s
        for t in self.trackers:
            t.close(deadline)
        return {t.backend.name: {**t.backend.where(), "error": t.error} for t in self.trackers} | \
            ({"warnings": list(self.warnings)} if self.warnings else {})
