"""Search: the spec's space as Tune distributions, and the adaptive micro-batch searcher.

The micro-batch search follows DeepSpeed's autotuner: try micro-batches in increasing powers of two, one
trial at a time (throughput measured on a shared machine would be meaningless), and stop growing once
throughput stops improving by plateau_pct or a trial runs out of memory. It reports how many trials it
used against the size of the full grid.
"""

from __future__ import annotations

import math
import pickle
from typing import Any, Optional

from ray import tune
from ray.tune.search import Searcher

from raytrain.sweep.spec import MICRO_BATCH_KEY, SweepSpec, microbatch_grid


def param_space(spec: SweepSpec) -> dict[str, Any]:
    """Dotted key -> Tune domain. Trials receive the dotted keys as they are (they are training overrides)."""
    out = {}
    for key, dim in spec.space.items():
        kind, arg = next(iter(dim.items()))
        out[key] = {"loguniform": lambda a: tune.loguniform(*a), "uniform": lambda a: tune.uniform(*a),
                    "randint": lambda a: tune.randint(*a), "choice": tune.choice,
                    "grid": tune.grid_search}[kind](arg)
    return out


class MicroBatchSearcher(Searcher):
    """Suggests batch.micro_batch_size values one trial at a time; stops on a plateau or on memory."""

    def __init__(self, grid: list[int], metric: str, mode: str, plateau_pct: Optional[float]):
        super().__init__(metric=metric, mode=mode)
        self.grid, self.plateau_pct = list(grid), plateau_pct
        self.next_index = 0
        self.running: Optional[str] = None
        self.outcomes: dict[int, dict] = {}  # micro-batch -> {"value": float|None, "feasible": bool}
        self.stop_reason: Optional[str] = None

    @classmethod
    def from_spec(cls, spec: SweepSpec) -> "MicroBatchSearcher":
        return cls(microbatch_grid(spec), spec.objective.metric, spec.mode, spec.microbatch.plateau_pct)

    def suggest(self, trial_id: str) -> Optional[dict]:
        if self.running is not None:
            return None  # wait: the next micro-batch depends on this trial's outcome
        if self.stop_reason is not None or self.next_index >= len(self.grid):
            if self.stop_reason is None:
                self.stop_reason = "grid exhausted"
            return Searcher.FINISHED
        mb = self.grid[self.next_index]
        self.next_index += 1
        self.running = trial_id
        return {MICRO_BATCH_KEY: mb}

    def _better(self, a: float, b: float) -> bool:
        return a > b if self.mode == "max" else a < b

    def record(self, mb: int, value: Optional[float], feasible: bool, reason: str = "") -> None:
        """The decision rule, separate from Tune so it can be tested on its own."""
        feasible_values = [o["value"] for o in self.outcomes.values() if o["feasible"] and o["value"] is not None]
        self.outcomes[mb] = {"value": value, "feasible": feasible}
        if not feasible:
            self.stop_reason = f"micro_batch_size={mb} infeasible ({reason or 'out of memory'}); larger ones would be too"
            return
        if value is None or not math.isfinite(value):
            return
        if feasible_values and self.plateau_pct is not None:
            best = max(feasible_values) if self.mode == "max" else min(feasible_values)
            gain = (value - best) / abs(best) * 100 if best else float("inf")
            if self.mode == "min":
                gain = -gain
            if gain < self.plateau_pct:
                self.stop_reason = (f"throughput plateau at micro_batch_size={mb}: {gain:+.1f}% vs the best so far "
                                    f"(< {self.plateau_pct:g}%)")

    def on_trial_complete(self, trial_id: str, result: Optional[dict] = None, error: bool = False) -> None:
        if trial_id != self.running:
            return
        self.running = None
        result = result or {}
        mb = result.get("micro_batch_size") or (result.get("config") or {}).get(MICRO_BATCH_KEY) \
            or self.grid[self.next_index - 1]
        if error:
            # An error that was not classified as out-of-memory: record it and keep growing.
            self.outcomes[mb] = {"value": None, "feasible": True}
            return
        value = result.get(self.metric)
        self.record(mb, value if isinstance(value, (int, float)) else None, not result.get("infeasible", False),
                    result.get("reason", ""))

    def summary(self) -> dict:
        return {"grid": self.grid, "trials": len(self.outcomes), "grid_size": len(self.grid),
                "stop_reason": self.stop_reason}

    # Tune checkpoints the searcher with the experiment, so `raytrain tune --resume` continues the search.
    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))
