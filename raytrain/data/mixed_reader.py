"""Reading a mixture: one rank's rows of each global batch, from one PlannedReader per source it has lanes of.

The mixture plan (raytrain/data/mixture.py) gives each source its own SamplePlan and this rank a contiguous
range of its lanes; a PlannedReader per source reads those units ahead as for a single split, and each step
takes the rows of the slots the step gives to that source. A stage change closes the readers and opens the
new stage's (a stage starts a new epoch of every source).
"""

from __future__ import annotations

import numpy as np

from raytrain.data.mixture import ID_STRIDE, MixturePlan
from raytrain.data.sample_plan import StepPlan
from raytrain.data.reader import PlannedReader


class MixedReader:
    """This rank's slots [lo, hi) of global batch `step`, for steps start, start + 1, ... (strictly in order)."""

    def __init__(self, plan: MixturePlan, lanes: tuple[int, int], start_step: int, *, end_step: int,
                 stall_timeout_s: float = 600.0, on_bad_shard: str = "error"):
        self.plan, self.lanes = plan, lanes
        self.step_next, self.end_step = start_step, end_step
        self.opts = {"stall_timeout_s": stall_timeout_s, "on_bad_shard": on_bad_shard}
        self.width = plan.splits[0].seq_len + 1
        self.stage: int = -1
        self.readers: dict[int, PlannedReader] = {}
        self.done = {"rows_read": 0, "bytes_fetched": 0, "units_opened": 0, "data_wait_s": 0.0}  # closed readers'
        self.rows_trained = 0
        self._skipped: list[str] = []  # closed readers'

    @property
    def skipped(self) -> list[str]:
        out = list(self._skipped)
        for r in self.readers.values():
            out += [u for u in r.skipped if u not in out]
        return out

    def _open(self, stage: int, step: int) -> None:
        self._close_readers()
        self.stage = stage
        for i in range(len(self.plan.names)):
            lo, hi = self.plan.source_lanes(i, stage, self.lanes)
            if hi > lo:
                self.readers[i] = PlannedReader(
                    self.plan.splits[i], self.plan.source_plan(i, stage), (lo, hi),
                    self.plan.source_step(i, stage, step), end_step=self._end(i), **self.opts)

    def _end(self, i: int) -> int:
        """Source i's end step: the run's last step, or the stage's end (no read-ahead past either)."""
        st = self.plan.stages[self.stage]
        return self.plan.source_step(i, self.stage, min(self.end_step, st.end))

    def take(self, step: int) -> tuple[np.ndarray, StepPlan]:
        """(rows of this rank's slots of global batch `step`, [slots, seq_len + 1] int32; the step's plan)."""
        if step != self.step_next:
            raise ValueError(f"MixedReader reads forward: asked for step {step}, next is {self.step_next}")
        k = self.plan.stage_index(step)
        if k != self.stage:
            self._open(k, step)
        src, sub = self.plan.slots(step, self.lanes)
        out = np.empty((len(src), self.width), np.int32)
        ids = np.empty(len(src), np.int64)
        for i, r in self.readers.items():
            rows, sp = r.take(self.plan.source_step(i, k, step))
            m = src == i
            out[m] = rows[sub[m] - r.lanes[0]]
            ids[m] = sp.ids[sub[m] - r.lanes[0]] + i * ID_STRIDE
        self.step_next = step + 1
        self.rows_trained += len(src)
        return out, StepPlan(step, k, self.lanes, ids=ids, units=src, rows=sub)

    def extend_to(self, end_step: int) -> None:
        self.end_step = max(self.end_step, end_step)
        for i, r in self.readers.items():
            r.extend_to(self._end(i))

    @property
    def cached_units(self) -> int:
        return sum(r.cached_units for r in self.readers.values())

    def counters(self) -> dict:
        """As PlannedReader.counters, over every source; rows_trained counts the rows handed to training
        (a boundary lane's rows that a step gives to the neighbouring source are read, not trained)."""
        c = dict(self.done)
        for r in self.readers.values():
            for key, v in r.counters().items():
                if key in c:
                    c[key] += v
        return {**c, "rows_trained": self.rows_trained, "skipped_shards": len(self.skipped)}

    def _close_readers(self) -> None:
        for r in self.readers.values():
            r.close()
            for key, v in r.counters().items():
                if key in self.done:
                    self.done[key] += v
            self._skipped += [u for u in r.skipped if u not in self._skipped]
        self.readers = {}

    def close(self) -> None:
        self._close_readers()
