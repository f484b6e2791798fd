"""Downstream evaluations during training (rank 0): a due committed checkpoint goes to a Ray task of its own; results are logged at its step.

Training never waits for an evaluation: the loop hands a checkpoint over by putting it on an in-process queue
(microseconds); a thread of this rank submits the Ray task and writes the queue line, and finished
evaluations are collected with a zero-timeout `ray.wait` once a step while any is pending. The queue in the run directory
(eval_queue.jsonl) and the results (eval/<step>/<task>.json) make it exact across restarts: an evaluation
lost with its attempt is run again by the next one, and one whose results exist is never run twice.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Optional

from raytrain import storage
from raytrain.errors import first_line
from raytrain.rundir import EVAL_QUEUE, RunDir


class DownstreamEvals:
    """This attempt's evaluation tasks: `poll(committed)` every step, `drain()` at the end; both return records."""

    def __init__(self, eval_cfg, *, run_uri: str, enabled: bool, log: Callable[[str], None]):
        self.cfg, self.run_uri, self.say = eval_cfg, run_uri, log
        self.enabled = enabled and bool(eval_cfg.tasks)
        self.pending: dict = {}  # ObjectRef -> (step, checkpoint name)
        self.ready: list[dict] = []  # records to log (results found in the run directory at start)
        self.seen: Optional[str] = None
        self.commits = 0
        self.handoff_s: list[float] = []  # the loop's pause per hand-over (benchmarked: at most 50 ms)
        self.lock = threading.Lock()  # pending is filled by the submitting thread, read by the loop
        self.inbox: queue.Queue = queue.Queue()
        if self.enabled:
            threading.Thread(target=self._submitter, name="raytrain-eval-submit", daemon=True).start()

    def open(self, *, logged: list[dict]) -> None:
        """After the attempt's first step (storage is read): what earlier attempts left, given the records logged."""
        if self.enabled:
            self._catch_up({r["step"] for r in logged if any(k.startswith("eval/") for k in r)})

    def _catch_up(self, logged_steps: set[int]) -> None:
        """What earlier attempts left: queued evaluations are logged from their results, or run again when they were
        lost; checkpoints they committed but had not yet handed over are handed over now."""
        from raytrain.ckpt.catalog import list_checkpoints, verify
        from raytrain.ckpt.layout import step_of
        from raytrain.eval_harness import read_results

        queued: dict[int, str] = {}
        for q in RunDir(self.run_uri).read_jsonl(EVAL_QUEUE):
            if isinstance(q.get("step"), int) and isinstance(q.get("checkpoint"), str):
                queued.setdefault(q["step"], q["checkpoint"])
        for step, name in sorted(queued.items()):
            if step in logged_steps:
                continue
            found = read_results(self.run_uri, step, self.cfg.tasks)
            if found is not None:
                self.ready.append(_record(step, found))
            elif verify(storage.join(self.run_uri, name)).complete:
                self._hand_over(step, name, queue=False)
            else:
                self.say(f"warning: checkpoint {name} was queued for evaluation but is gone (pruned?); not evaluated")
        newest = max(queued, default=-1)
        for uri in list_checkpoints(self.run_uri):
            if step_of(uri) > newest and verify(uri).complete:
                self._committed(uri.rsplit("/", 1)[-1], final=False)

    def poll(self, committed: Optional[str], *, final: bool = False) -> list[dict]:
        """Hand over a newly committed checkpoint when due; the records of evaluations that finished."""
        if not self.enabled:
            return []
        if committed is not None and committed != self.seen:
            self._committed(committed, final=final)
        out, self.ready = self.ready, []
        with self.lock:
            refs = list(self.pending)
        if refs:
            import ray

            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            out += [r for ref in done for r in self._collect(ref)]
        return out

    def _committed(self, name: str, *, final: bool) -> None:
        """A newly committed checkpoint: handed over when it is the n-th (eval.every_n_checkpoints) or the last."""
        from raytrain.ckpt.layout import step_of

        self.seen = name
        self.commits += 1
        if final or self.commits % self.cfg.every_n_checkpoints == 0:
            self._hand_over(step_of(name), name, queue=True)

    def drain(self, timeout_s: float) -> list[dict]:
        """At the end of training: wait up to timeout_s for the evaluations still running."""
        deadline = time.time() + timeout_s
        while self.inbox.unfinished_tasks and time.time() < deadline:  # hand-overs not yet submitted
            time.sleep(0.05)
        with self.lock:
            refs = list(self.pending)
        if not refs:
            return []
        import ray

        self.say(f"waiting up to {timeout_s:g} s for {len(refs)} downstream evaluation(s) (eval.wait_at_end_s)")
        done, rest = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.time()))
        out = [r for ref in done for r in self._collect(ref)]
        if rest:
            names = ", ".join(self.pending[r][1] for r in rest)
            self.say(f"warning: evaluation of {names} did not finish in eval.wait_at_end_s; the run's next resume "
                     f"runs it again (its queue line is in {EVAL_QUEUE})")
        return out

    def summary(self) -> dict:
        """For summary.json: hand-overs and the loop's longest pause for one (eval.* figures)."""
        if not self.enabled:
            return {}
        return {"eval_handoffs": len(self.handoff_s), "eval_handoff_max_s": max(self.handoff_s, default=None)}

    def _hand_over(self, step: int, name: str, *, queue: bool) -> None:
        t0 = time.perf_counter()
        self.inbox.put((step, name, queue))
        self.handoff_s.append(time.perf_counter() - t0)

    def _submitter(self) -> None:
        """The thread that submits each handed-over evaluation and then writes its queue line (a kill in between:
        the next attempt finds the checkpoint committed and not queued, and hands it over itself)."""
        from raytrain.eval_harness import submit

        while True:
            step, name, queue_line = self.inbox.get()
            try:
                ref = submit(checkpoint=storage.join(self.run_uri, name), model_dir=None, eval_cfg=self.cfg,
                             run_uri=self.run_uri)
                with self.lock:
                    self.pending[ref] = (step, name)
                if queue_line:
                    RunDir(self.run_uri).append_jsonl(EVAL_QUEUE, {"step": step, "checkpoint": name,
                                                                   "tasks": self.cfg.tasks,
                                                                   "time": round(time.time(), 3)})
            except Exception as e:  # noqa: BLE001 - an evaluation's trouble is reported, never the training's
                self.say(f"warning: downstream evaluation of {name} could not be submitted: {first_line(e)}")
            finally:
                self.inbox.task_done()

    def _collect(self, ref) -> list[dict]:
        import ray

        with self.lock:
            step, name = self.pending.pop(ref)
        try:
            out = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - an evaluation's failure is reported, never the training's
            self.say(f"warning: downstream evaluation of {name} failed: {first_line(e)}")
            return [{"step": step, "event": "eval_failed", "checkpoint": name, "reason": first_line(e)}]
        return [_record(step, out["metrics"])]


def _record(step: int, metrics: dict[str, dict[str, float]]) -> dict:
    """A metrics.jsonl record at the checkpoint's step: eval/<task>/<metric> keys."""
    return {"step": step, **{f"eval/{t}/{m}": v for t, ms in metrics.items() for m, v in ms.items()}}
