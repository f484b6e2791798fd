"""The run directory: every file of a run is named here and read or written through `RunDir`.

A run directory is `<checkpoint.storage>/<run.name>` (a local path or s3://). Its checkpoints' insides are
named by `raytrain.ckpt.layout`. JSONL files are appended by one writer and read tolerantly: a line torn by
a killed writer (or any line that does not parse) is skipped, never an error.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from raytrain import storage

# name: (what it holds, who writes it). The table in docs/RUN_DIRECTORY.md is generated from this.
FILES: dict[str, tuple[str, str]] = {}
DIRS: set[str] = set()


def _file(name: str, what: str, writer: str, directory: bool = False) -> str:
    FILES[name] = (what, writer)
    if directory:
        DIRS.add(name)
    return name


CONFIG = _file("config.yaml", "the resolved config of the run (also inside each checkpoint)", "driver, at submit")
METRICS = _file("metrics.jsonl", "one record per log, evaluation, checkpoint and rollback step; lines past a "
                "resumed step are dropped on resume", "rank 0")
SUMMARY = _file("summary.json", "the finished run's figures (losses, throughput, restarts, preemptions, "
                "health, data counters, final checkpoint)", "rank 0, at the end")
ATTEMPTS = _file("attempts.jsonl", "one line per (re)start: resumed step, world size, start-up phases, the "
                 "controller's restart phases, the previous attempt's progress, the first step's memory (measured, "
                 "planned)", "rank 0, after its first step")
PROGRESS = _file("progress.json", "the heartbeat: step reached, when, stalled or moving", "rank 0's heartbeat thread")
RESTORES = _file("restores.jsonl", "one line per restore: source (memory:local, memory:peer, memory:resize or storage), step, "
                 "checkpoint, verdict, bytes read per node", "rank 0")
CONVERSIONS = _file("conversions.jsonl", "universal-form conversions for resized resumes: from / to world "
                    "size, seconds", "rank 0")
MIXTURE = _file("mixture.jsonl", "a data mixture's sources and weight schedule as first submitted, and each "
                "change on resume (the step it applies from)", "driver, at submit")
HEALTH = _file("health.json", "the health report of a run the rules stopped", "rank 0")
COMM_FAILURE = _file("comm_failure.txt", "the newest communication-failure diagnosis (rank, collective, "
                     "settings)", "the rank that waited")
ELASTIC = _file("elastic.jsonl", "the run's events: each submission and its end, and the Train controller's: each "
                "worker group's size, waits for capacity, growth, nodes lost (charged to run.max_preemptions)",
                "driver, relaying the controller")
GOODPUT = _file("goodput.json", "the goodput ledger (raytrain/goodput.py): every second of the run's wall time by "
                "kind, per attempt, with the world size over time", "driver, at the end of each submission")
NODES = _file("nodes.json", "node time by market and lost nodes, for `raytrain cost`", "driver")
RESUME_MARKER = _file("resume_from.json", "`raytrain ckpt rollback`: the step the next resume starts from",
                      "`raytrain ckpt rollback`")
TRACKERS = _file("trackers.json", "the experiment-tracker runs (W&B, MLflow) every attempt and resubmission logs "
                  "into: run ids and where, never credentials", "rank 0's tracker threads")
EVAL = _file("eval", "downstream evaluations (lm-evaluation-harness): eval/<step>/<task>.json, the metrics of one "
             "task on the checkpoint of that step", "the evaluation's Ray task", directory=True)
EVAL_QUEUE = _file("eval_queue.jsonl", "one line per checkpoint handed to a downstream evaluation (step, tasks): an "
                   "evaluation lost to a preemption is run again by the next attempt, never twice", "rank 0")
TAGS = _file("tags", "one <tag>.json per tagged checkpoint (its step and config)", "`raytrain ckpt tag`", directory=True)
AUDIT = _file("audit", "append-only audit records (`raytrain/audit.py`): <writer>/<seq>.jsonl segments, each written "
              "once (a conditional write), whole, by one process, each naming the sha256 of the one before, a "
              "writer's first and last anchored in _anchors/: submissions (resolved config, its sha256, the "
              "overrides), resumes, resizes, rollbacks, exports. On S3 not in the run directory: at the same key "
              "under the bucket's audit/ prefix (s3://B/audit/<run key>/audit/), which the roles that write them "
              "cannot delete or overwrite; `raytrain audit verify RUN` checks them", "whoever records the event (the "
              "driver at submit, rank 0, `raytrain export`), each process under a writer id of its own",
              directory=True)
TENSORBOARD = _file("tensorboard", "TensorBoard event files", "rank 0", directory=True)
REPORT_PNG = _file("report.png", "loss, perplexity and throughput plots", "`raytrain report`")
REPORT_GOODPUT = _file("goodput.png", "the world size and goodput over time, badput by kind", "`raytrain report`")
REPORT_MD = _file("report.md", "the run's report in Markdown", "`raytrain report`")
CHECKPOINTS = _file("checkpoint_NNNNNNNN", "a checkpoint; complete once its manifest.json exists "
                    "(docs/LIFECYCLE.md)", "every rank; rank 0 commits", directory=True)


class RunDir:
    """One run's directory: `uri(name)` for any file above, JSON and tolerant JSONL reads and writes."""

    def __init__(self, run_uri: str):
        self.run_uri = run_uri

    def uri(self, name: str, *more: str) -> str:
        return storage.join(self.run_uri, name, *more)

    def exists(self, name: str) -> bool:
        return storage.exists(self.uri(name))

    def read_json(self, name: str) -> Optional[Any]:
        """The file's JSON, or None when it is missing or torn."""
        uri = self.uri(name)
        try:
            return json.loads(storage.read_text(uri)) if storage.exists(uri) else None
        except ValueError:
            return None

    def write_json(self, name: str, obj: Any, indent: Optional[int] = 1) -> None:
        storage.write_text(self.uri(name), json.dumps(obj, indent=indent))

    def read_jsonl(self, name: str) -> list[dict]:
        """Every record that parses; a torn last line (a killed writer) is skipped."""
        uri = self.uri(name)
        if not storage.exists(uri):
            return []
        return parse_jsonl(storage.read_text(uri))

    def append_jsonl(self, name: str, rec: dict) -> None:
        """One record at the end (small files, rewritten whole: object storage has no append)."""
        uri = self.uri(name)
        old = storage.read_text(uri) if storage.exists(uri) else ""
        if old and not old.endswith("\n"):
            old += "\n"  # a torn last line stays a line of its own, skipped by readers
        storage.write_text(uri, old + json.dumps(rec) + "\n")


def parse_jsonl(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def reference_markdown() -> str:
    """docs/RUN_DIRECTORY.md (checked by a test)."""
    lines = ["# The run directory", "", "Generated from `raytrain/rundir.py` (`python -m raytrain.rundir > "
             "docs/RUN_DIRECTORY.md`); a test checks it.", "", "A run lives in `<checkpoint.storage>/<run.name>` "
             "(local path or `s3://`). JSONL files are read tolerantly: a line torn by a killed writer is skipped.",
             "", "| file | what | written by |", "| --- | --- | --- |"]
    lines += [f"| `{name}{'/' if name in DIRS else ''}` | {what} | {writer} |" for name, (what, writer) in FILES.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
