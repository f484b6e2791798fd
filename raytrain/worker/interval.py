"""When to checkpoint: every N steps, or `auto` - the Young-Daly interval from measured cost and failure rate.

Young-Daly: with a checkpoint costing C seconds of training and interruptions every M seconds on
average, checkpointing every sqrt(2 C M) seconds of work minimises the expected time lost (saving
too often pays C too often; too rarely re-trains too much after each interruption).

Under `auto`, C is the mean training stall of this run's checkpoints so far, earlier attempts included
(before the first one, an assumed `auto_initial_cost_s`); M is `checkpoint.mtbf_s` until interruptions are seen, then
(mtbf_s + the run's wall time) / (1 + restarts) - the prior counts as one interval already observed,
so one early preemption does not make the run checkpoint every step. Rank 0 decides on its own clock
and the per-step agreement (worker/verdict.py) makes every rank save at the same step.
"""

from __future__ import annotations

import math
import time
from typing import Optional

from raytrain.rundir import ATTEMPTS, RunDir


def young_daly_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (seconds of work) that minimises expected lost time: sqrt(2 C M)."""
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def run_history(run_uri: str) -> tuple[Optional[float], int]:
    """(start time of the run's first attempt, attempts before this one) from attempts.jsonl: each
    earlier attempt ended in an interruption, or this one would not exist."""
    times = []
    for rec in RunDir(run_uri).read_jsonl(ATTEMPTS):
        try:
            times.append(float(rec["time"]))
        except (ValueError, KeyError, TypeError):
            continue
    return (min(times) if times else None), len(times)


class FixedCadence:
    """Every N steps: every rank computes the same answer, so nothing needs agreeing."""

    agreed = False  # no vote rides on the step's all-reduce

    def __init__(self, every: int):
        self.every = every

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def seed(self, earlier_stalls: list[float]) -> None:
        pass

    def saved(self, stall_s: float) -> None:
        pass

    def record(self) -> dict:
        return {}

    def describe(self) -> str:
        return f"every {self.every} steps"


class YoungDalyCadence:
    """`auto`: every sqrt(2 C M) seconds of training. Rank 0's clock decides; its vote rides on the step's
    all-reduce (worker/verdict.py), so every rank saves at the same step."""

    agreed = True

    def __init__(self, *, mtbf_s: float, initial_cost_s: float, run_started: Optional[float] = None,
                 restarts: int = 0):
        self.prior_mtbf_s, self.restarts = mtbf_s, restarts
        self.run_started = run_started or time.time()
        self.costs: list[float] = []
        self.initial_cost_s = initial_cost_s
        self._since = time.monotonic()  # the end of the last checkpoint (or this attempt's start)

    @property
    def cost_s(self) -> float:
        return sum(self.costs) / len(self.costs) if self.costs else self.initial_cost_s

    @property
    def mtbf_s(self) -> float:
        return (self.prior_mtbf_s + (time.time() - self.run_started)) / (1 + self.restarts)

    @property
    def interval_s(self) -> float:
        return young_daly_s(self.cost_s, self.mtbf_s)

    def due(self, step: int) -> bool:
        """This rank's clock says so (only rank 0's answer counts: the caller agrees on it across ranks)."""
        return time.monotonic() - self._since >= self.interval_s

    def seed(self, earlier_stalls: list[float]) -> None:
        """A resumed attempt starts from the checkpoint costs the run already measured, not the assumption."""
        self.costs = [float(x) for x in earlier_stalls] + self.costs

    def saved(self, stall_s: float) -> None:
        """A checkpoint was taken and training paused `stall_s` for it."""
        self.costs.append(stall_s)
        self._since = time.monotonic()

    def record(self) -> dict:
        """What a checkpoint's metrics line says about the cadence."""
        return {"auto_interval_s": round(self.interval_s, 2)}

    def describe(self) -> str:
        return (f"auto: every {self.interval_s:.0f}s of training (checkpoint cost {self.cost_s:.2f}s, "
                f"mean time between interruptions {self.mtbf_s / 3600:.2f}h)")


def cadence_for(ckpt_cfg, *, run_started: Optional[float], restarts: int):
    """The policy `checkpoint.every_n_steps` names: a fixed interval or Young-Daly (`auto`)."""
    if ckpt_cfg.every_n_steps != "auto":
        return FixedCadence(int(ckpt_cfg.every_n_steps))
    return YoungDalyCadence(mtbf_s=ckpt_cfg.mtbf_s, initial_cost_s=ckpt_cfg.auto_initial_cost_s,
                            run_started=run_started, restarts=restarts)
