"""Data mixtures in the sample plan: which source each slot of a global batch comes from, and which of its samples.

Assignment (stratified, low-discrepancy). In a stage with normalised weights w, the global batch's gb slots
are cut at a_k = gb * (w_0 + ... + w_{k-1}); at step t every cut moves by the same offset u_t in [0, 1) and is
rounded down: source i holds slots [floor(a_i + u_t), floor(a_{i+1} + u_t)). u_t = frac(u_0 + t * phi) with
phi = (sqrt 5 - 1) / 2 (a Kronecker sequence) and u_0 from the seed. So:
- every global batch holds floor(gb * w_i) or ceil(gb * w_i) slots of source i (never further off than 1 slot);
- over any T consecutive steps of one stage the count of source i differs from T * gb * w_i by at most
  2 * T * D_T, D_T the extreme discrepancy of T consecutive points of the sequence (Koksma's inequality on the
  two rounding errors; shifting the window only shifts u_0). For phi, T * D_T <= 3 + 3.52 ln T (Niederreiter's
  bound for partial quotients 1); measured (2..8 sources, global batches 16..4096, windows of 1..16384 steps)
  it stays within bound_slots(T) = 1 + 0.5 ln T slots: 1 at T = 1, 3.1 at 64, 5.2 at 4096. As a share of the
  window's slots: |realised - w_i| <= bound_slots(T) / (T * gb). tests/test_mixture.py checks it from the
  plan, and from a real run's own counters.

Reading (each rank reads only its units). Slot p of the batch always maps to lane p - floor(a_i) of source i,
so each source is a SamplePlan of its own (raytrain/data/sample_plan.py) with L_i = ceil(a_{i+1}) - floor(a_i) lanes
(gb * w_i plus at most one shared boundary lane at each end, idle when the cut falls on the other side),
stepped once per global step: its own unit order, its own epochs (a small source repeats sooner), and a
contiguous range of its lanes per rank, so read amplification stays ~1 + 1 / (gb * w_i) per source. Lanes
are a function of the global batch and the weights, never of the number of workers: a resize keeps every
batch's membership.

Stages. A stage change (data.mixture_schedule, or new weights on resume) starts a new epoch of every source
at that step: the lane layout changes with the weights, and a fresh permutation never trains a sample twice
within one of a source's epochs.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from raytrain.data.sample_plan import SamplePlan, StepPlan, lanes_of, units_of
from raytrain.errors import UserError

PHI = (math.sqrt(5.0) - 1.0) / 2.0
ID_STRIDE = 1 << 40  # a mixture's sample ids: source index * ID_STRIDE + row in that source's split


def bound_slots(steps: int) -> float:
    """The stated bound on |slots of a source - steps * gb * w| over `steps` consecutive steps of one stage."""
    return 1.0 + 0.5 * math.log(max(1, steps))


def check_mixture(train, schedule: Sequence) -> None:
    """Config-time checks of data.train (a list of sources) and data.mixture_schedule; ValueError, one line."""
    if not isinstance(train, list):
        if schedule:
            raise ValueError("data.mixture_schedule needs data.train as a list of sources {name, path, weight}")
        return
    if not train:
        raise ValueError("data.train is an empty list; give one or more sources {name, path, weight}")
    names = [s.name for s in train]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"data.train names source {dup[0]!r} more than once; give every source its own name")
    for s in train:
        if not (s.weight >= 0 and math.isfinite(s.weight)):
            raise ValueError(f"data.train source {s.name!r}: weight {s.weight} must be >= 0 (a relative share)")
    weights = {s.name: s.weight for s in train}
    if sum(weights.values()) <= 0:
        raise ValueError("data.train: every source has weight 0; give at least one a positive weight")
    last = 0
    for k, stage in enumerate(schedule):
        where = f"data.mixture_schedule[{k}]"
        if stage.start_step <= last:
            raise ValueError(f"{where}.start_step={stage.start_step} must be greater than the previous stage's "
                             f"({last}); list the stages in increasing start_step")
        last = stage.start_step
        for name, w in stage.weights.items():
            if name not in weights:
                raise ValueError(f"{where} names source {name!r}, which data.train does not have "
                                 f"(sources: {', '.join(names)})")
            if not (w >= 0 and math.isfinite(w)):
                raise ValueError(f"{where}: weight {w} of source {name!r} must be >= 0")
        weights.update(stage.weights)
        if sum(weights.values()) <= 0:
            raise ValueError(f"{where}: every source has weight 0 from step {stage.start_step}; give one a "
                             "positive weight")


def stages_of(data_cfg) -> list[tuple[int, tuple[float, ...]]]:
    """(start step, weight per source in data.train's order) for step 0 and each schedule stage."""
    names = [s.name for s in data_cfg.train]
    weights = {s.name: s.weight for s in data_cfg.train}
    out = [(0, tuple(weights[n] for n in names))]
    for stage in data_cfg.mixture_schedule:
        weights.update(stage.weights)
        out.append((stage.start_step, tuple(weights[n] for n in names)))
    return out


def compose(records: Sequence[dict]) -> list[tuple[int, tuple[float, ...]]]:
    """The schedule a run trains by, from its recorded mixtures (mixture.jsonl, oldest first): each record's
    stages apply from its `from_step` on and replace whatever the earlier ones said from there."""
    out: list[tuple[int, tuple[float, ...]]] = []
    for rec in records:
        f = int(rec["from_step"])
        own = [(int(s), tuple(float(x) for x in w)) for s, w in rec["stages"]]
        at_f = [w for s, w in own if s <= f][-1]
        out = [st for st in out if st[0] < f]
        if not out or out[-1][1] != at_f:
            out.append((f, at_f))
        out += [st for st in own if st[0] > f]
    return out


def _seed_of(seed: int, name: str) -> int:
    """A source's own plan seed: keyed by its name, so adding or reordering sources leaves its order alone."""
    return (int(seed) << 32) | zlib.crc32(name.encode())


@dataclass(frozen=True)
class StageLayout:
    """One stage's cuts: a (K + 1 slot boundaries before rounding), base (first lane's slot), lanes per source."""

    start: int
    end: int          # first step of the next stage (2**62: none)
    weights: np.ndarray
    a: np.ndarray
    base: np.ndarray
    lanes: np.ndarray


class MixturePlan:
    """(seed, schedule, step, global batch) -> the samples of that global batch, drawn from several splits."""

    def __init__(self, splits: Sequence, names: Sequence[str], stages: Sequence[tuple[int, Sequence[float]]], *,
                 seed: int, global_batch: int, shuffle: bool = True, unit_rows: Optional[int] = None):
        self.splits, self.names = list(splits), list(names)
        self.seed, self.global_batch, self.shuffle = int(seed), int(global_batch), shuffle
        self.units = [units_of(s.shard_rows, unit_rows) for s in self.splits]
        self.num_samples = np.array([s.num_samples for s in self.splits], np.int64)
        self.u0 = zlib.crc32(f"mixture:{seed}".encode()) / 2 ** 32
        starts = [int(s) for s, _ in stages]
        self.stages = [self._layout(s, e, w) for s, e, w in
                       zip(starts, starts[1:] + [2 ** 62], [w for _, w in stages])]
        # Epochs each source began before each stage (a stage starts a fresh epoch of every source it uses).
        self.epoch0 = np.zeros((len(self.stages), len(self.names)), np.int64)
        for k, st in enumerate(self.stages[:-1]):
            spe = self.steps_per_epoch(k)
            began = np.where(st.lanes > 0, -(-(st.end - st.start) // np.maximum(spe, 1)), 0)
            self.epoch0[k + 1] = self.epoch0[k] + began
        self._plans: dict[tuple[int, int], SamplePlan] = {}

    def _layout(self, start: int, end: int, weights: Sequence[float]) -> StageLayout:
        w = np.asarray(weights, np.float64)
        w = w / w.sum()
        gb = self.global_batch
        a = np.round(gb * np.concatenate([[0.0], np.cumsum(w)]), 9)
        a[np.flatnonzero(w)[-1] + 1:] = gb  # no float residue may give a slot to the trailing zero weights
        base = np.floor(a[:-1]).astype(np.int64)
        lanes = np.where(w > 0, np.ceil(a[1:]).astype(np.int64) - base, 0)
        for i in np.flatnonzero(lanes > self.num_samples):
            raise UserError(f"data.train source {self.names[i]!r} has {self.num_samples[i]} sequences, fewer than "
                            f"its {lanes[i]} lanes of a global batch of {gb} at weight {w[i]:.3g} (from step "
                            f"{start}); prepare more of it, lower its weight or the global batch")
        return StageLayout(start=start, end=end, weights=w, a=a, base=base, lanes=lanes)

    def steps_per_epoch(self, stage: int) -> np.ndarray:
        return self.num_samples // np.maximum(self.stages[stage].lanes, 1)

    def stage_index(self, step: int) -> int:
        return int(np.searchsorted([s.start for s in self.stages], int(step), side="right") - 1)

    def lanes_of(self, rank: int, world: int) -> tuple[int, int]:
        """The slots of every global batch rank `rank` of `world` trains on (as SamplePlan.lanes_of)."""
        return lanes_of(self.global_batch, rank, world)

    def cuts(self, stage: int, steps: np.ndarray) -> np.ndarray:
        """[len(steps), K + 1] slot boundaries: source i holds slots [cuts[:, i], cuts[:, i + 1])."""
        st = self.stages[stage]
        steps = np.asarray(steps, np.float64)
        u = np.mod(self.u0 + np.mod(steps * PHI, 1.0), 1.0)
        out = np.floor(st.a[None, :] + u[:, None]).astype(np.int64)
        out[:, 0], out[:, -1] = 0, self.global_batch
        return out

    def slots(self, step: int, lanes: Optional[tuple[int, int]] = None) -> tuple[np.ndarray, np.ndarray]:
        """(source, lane of that source's plan) of every slot in [lo, hi) of global batch `step`."""
        lo, hi = lanes or (0, self.global_batch)
        k = self.stage_index(step)
        b = self.cuts(k, np.array([step]))[0]
        src = np.searchsorted(b, np.arange(lo, hi), side="right") - 1
        return src, np.arange(lo, hi) - self.stages[k].base[src]

    def source_lanes(self, i: int, stage: int, lanes: tuple[int, int]) -> tuple[int, int]:
        """The lanes of source i's plan that slots [lo, hi) can ever hold in this stage (contiguous)."""
        st = self.stages[stage]
        lo = int(np.clip(lanes[0] - st.base[i], 0, st.lanes[i]))
        return lo, int(np.clip(lanes[1] - st.base[i], lo, st.lanes[i]))

    def source_step(self, i: int, stage: int, step: int) -> int:
        """Global batch `step` (in `stage`) as a step of source i's own plan."""
        st = self.stages[stage]
        return int(self.epoch0[stage, i] * self.steps_per_epoch(stage)[i] + (step - st.start))

    def source_plan(self, i: int, stage: int) -> SamplePlan:
        got = self._plans.get((i, stage))
        if got is None:
            if len(self._plans) >= 4 * len(self.names):
                self._plans.pop(next(iter(self._plans)))
            sp = self.splits[i]
            got = self._plans[(i, stage)] = SamplePlan(self.units[i], sp.shard_rows, _seed_of(self.seed, self.names[i]),
                                                       int(self.stages[stage].lanes[i]), self.shuffle)
        return got

    def step(self, step: int, lanes: Optional[tuple[int, int]] = None) -> StepPlan:
        """The samples of global batch `step` in slots [lo, hi): ids are source * ID_STRIDE + row of its split;
        `units` holds each slot's source and `rows` its lane in that source's plan."""
        lanes = lanes or (0, self.global_batch)
        k = self.stage_index(step)
        src, sub = self.slots(step, lanes)
        ids = np.empty(len(src), np.int64)
        for i in np.unique(src):
            m = src == i
            lo, hi = self.source_lanes(int(i), k, lanes)
            part = self.source_plan(int(i), k).step(self.source_step(int(i), k, step), (lo, hi))
            ids[m] = part.ids[sub[m] - lo] + int(i) * ID_STRIDE
        return StepPlan(int(step), k, lanes, ids=ids, units=src, rows=sub)

    def counts(self, t0: int, t1: int) -> np.ndarray:
        """Slots of each source over global batches [t0, t1) (vectorised, from the plan alone)."""
        out = np.zeros(len(self.names), np.int64)
        for k, st in enumerate(self.stages):
            a, b = max(t0, st.start), min(t1, st.end)
            for c in range(a, b, 1 << 16):
                out += np.diff(self.cuts(k, np.arange(c, min(b, c + (1 << 16)))), axis=1).sum(axis=0)
        return out

    def weight_at(self, step: int) -> np.ndarray:
        return self.stages[self.stage_index(step)].weights

    def to_dict(self) -> dict:
        return {"names": self.names, "splits": [s.to_dict() for s in self.splits],
                "stages": [[st.start, st.weights.tolist()] for st in self.stages]}

    @classmethod
    def from_dict(cls, d: dict, **kw) -> "MixturePlan":
        from raytrain.data.manifest import Split

        return cls([Split.from_dict(s) for s in d["splits"]], d["names"], [(s, w) for s, w in d["stages"]], **kw)
