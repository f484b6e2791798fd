"""How often each rank copies its state into host memory: every N steps, or `auto`, measured and agreed by all ranks.

`auto` (the default): over an attempt's first MEASURE_STEPS steps every other step is snapshotted. The time from a
snapshot decision to the next, after a step with a snapshot against after one without, is what a snapshot costs the
training: its stall on the training thread and what its copy takes from the next step (on a GPU the copy runs on a
side stream beside it and competes for PCIe and memory bandwidth; the stall alone missed three quarters of that
cost on an H200, docs/BENCHMARKS.md). Each rank then proposes the Young-Daly interval, k x step = sqrt(2 x cost x
MTBF) (the least expected loss: snapshot cost against the steps a fault redoes; MTBF `checkpoint.mtbf_s` over the
run's attempts so far), but never one whose cost passes `checkpoint.memory_cost_target` (cost / (k x step)); the proposals ride on the step's all-reduce (worker/verdict.py), so every rank takes
the same k, their mean rounded up, from the same step. A restart redoes at most k steps (k + 1 when the kill lands
between a step and its snapshot).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Optional, Union

MEASURE_STEPS = 8  # an attempt's first steps, snapshotted every other one, before the interval is agreed
MAX_EVERY = 1000  # auto never widens past this (nor past a fixed storage checkpoint interval)


class SnapshotInterval:
    """`due(step)`: whether this step's state is copied. Under auto, `proposal()` / `agreed(step, mean)` at the
    one step where the ranks agree on the interval (`deciding(step)`, the same step on every rank)."""

    def __init__(self, every: Union[int, str], *, target: float, ckpt_every: Union[int, str],
                 mtbf_s: Optional[float] = None):
        self.auto = every == "auto"
        self.prior_mtbf_s = self.mtbf_s = mtbf_s  # None: the cost target alone decides
        self.every = 1 if self.auto else int(every)
        self.target = target
        self.max_every = min(MAX_EVERY, int(ckpt_every)) if isinstance(ckpt_every, int) else MAX_EVERY
        self.first_step: Optional[int] = None  # the attempt's first step
        self.decided_at: Optional[int] = None
        self.after_snapshot: list[float] = []  # seconds from a decision that took a snapshot to the next decision
        self.after_none: list[float] = []  # ... from one that took none
        self.stalls: list[float] = []
        self._last: Optional[float] = None
        self._told = False

    def begin(self, step: int, *, restarts: int = 0) -> None:
        """The attempt trains from `step` on: measure from its next step (every rank calls it alike); `restarts`:
        the run's attempts before this one (each an interruption: the MTBF estimate falls with them)."""
        self.first_step, self.decided_at, self._told = step + 1, None, False
        if self.prior_mtbf_s is not None:
            self.mtbf_s = self.prior_mtbf_s / (1 + restarts)
        self.after_snapshot, self.after_none, self.stalls, self._last = [], [], [], None

    def measuring(self, step: int) -> bool:
        return self.auto and self.decided_at is None and self.first_step is not None and \
            step < self.first_step + MEASURE_STEPS

    def due(self, step: int) -> bool:
        if self.measuring(step):
            return (step - self.first_step) % 2 == 0
        return step % self.every == 0

    def tick(self, prev_stall_s: Optional[float]) -> None:
        """At each step's snapshot decision (every step, every rank), with the whole stall of the previous call's
        snapshot (None: it took none)."""
        now = time.monotonic()
        if self._last is not None:
            (self.after_none if prev_stall_s is None else self.after_snapshot).append(now - self._last)
            if prev_stall_s is not None:
                self.stalls.append(prev_stall_s)
        self._last = now

    def deciding(self, step: int) -> bool:
        return self.auto and self.decided_at is None and self.first_step is not None and \
            step == self.first_step + MEASURE_STEPS

    @property
    def step_s(self) -> float:
        """A step with no snapshot before it (median)."""
        return statistics.median(self.after_none) if self.after_none else 0.0

    @property
    def cost_s(self) -> float:
        """What a snapshot adds (median): at least its own stall, however noisy the steps around it."""
        if not (self.after_snapshot and self.after_none):
            return 0.0
        return max(statistics.median(self.after_snapshot) - self.step_s, statistics.median(self.stalls))

    def proposal(self) -> float:
        """This rank's interval: Young-Daly's, and at least the smallest k with cost / (k x step) <= target (0:
        nothing measured, as on a rank whose snapshots are off)."""
        if not self.step_s:
            return 0.0
        k = math.ceil(self.cost_s / (self.target * self.step_s) - 1e-9)
        if self.mtbf_s:
            k = max(k, round(math.sqrt(2 * self.cost_s * self.mtbf_s) / self.step_s))
        return float(min(self.max_every, max(1, k)))

    def agreed(self, step: int, mean_proposal: float) -> None:
        """The mean of every rank's proposal, from the step's all-reduce: the interval from this step on."""
        self.every = min(self.max_every, max(1, math.ceil(mean_proposal - 1e-9)))
        self.decided_at = step

    def news(self) -> Optional[str]:
        """The interval agreed on, once, when it has been (for the run's log)."""
        if self.decided_at is None or self._told:
            return None
        self._told = True
        return self.describe()

    def describe(self) -> str:
        if not self.auto:
            return f"every {self.every} step(s)"
        if self.decided_at is None:
            return (f"every other step for {MEASURE_STEPS} steps, then auto (at most {self.target:.1%} of "
                    "throughput)")
        share = self.cost_s / (self.every * self.step_s) if self.step_s else 0.0
        yd = f", Young-Daly with MTBF {self.mtbf_s:,.0f} s" if self.mtbf_s else ""
        return (f"every {self.every} step(s) (auto, from step {self.decided_at}: a snapshot costs "
                f"{self.cost_s * 1e3:.2f} ms of a {self.step_s * 1e3:.1f} ms step here, {share:.2%} of throughput; "
                f"at most {self.target:.1%}{yd})")
