"""The sample plan: which samples make up global batch `step`, and where each lives. Pure, and independent of N.

Layout (stratified lanes). Each epoch permutes the split's units (a unit is a run of rows of one shard
read in one go: a Parquet row group, a run of tar members) from (seed, epoch) and lays their rows end to
end. That sequence is cut into `global_batch` lanes of `steps_per_epoch` rows each; step t of the epoch
takes row t of every lane. Inside each unit the rows are visited in a keyed pseudo-random order
(a Feistel permutation keyed by seed, epoch and unit), so a lane walks through its units one after the
other and never holds more than one of them (two at a unit boundary).

Lanes are a function of the global batch, not of the number of workers: rank r of N owns lanes
[r*gb/N, (r+1)*gb/N). A unit lies inside one lane unless a lane boundary cuts it, so each unit is read by
one rank (two where a rank boundary cuts it): read amplification stays ~1 at any N, and the set of
samples in every global batch is the same at any N, which is what lets a run resize and resume exactly.

Every step is computed directly from (epoch, step): nothing is replayed on resume. Per epoch the plan
keeps the unit order and its running row counts (O(units), a few MB for a TB of tokens); per step it
does O(lanes) vectorised work. The last `samples % global_batch` rows of an epoch's order are not
trained that epoch (a different tail every epoch), so each sample is trained at most once per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from raytrain.errors import UserError


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def keyed_permute(i: np.ndarray, n: np.ndarray, key: np.ndarray, rounds: int = 4) -> np.ndarray:
    """The image of i under a keyed bijection of [0, n): a Feistel network on the next even bit width,
    cycle-walked back into range. Elementwise: every element may have its own n and key."""
    i, n, key = (np.asarray(a, dtype=np.uint64) for a in np.broadcast_arrays(i, n, key))
    bits = np.maximum(1, np.ceil(np.log2(np.maximum(n, 2).astype(np.float64)) / 2)).astype(np.uint64)
    mask = (np.uint64(1) << bits) - np.uint64(1)
    out = i.copy()
    todo = np.ones(out.shape, bool)
    while todo.any():  # expected < 4 passes: the Feistel domain is < 4n
        x, h, m, k = out[todo], bits[todo], mask[todo], key[todo]
        left, right = x >> h, x & m
        for r in range(rounds):
            f = _mix(right ^ _mix(k + np.uint64(r))) & m
            left, right = right, left ^ f
        out[todo] = (left << h) | right
        todo = out >= n
    return out


@dataclass(frozen=True)
class Unit:
    """Rows [start, start + rows) of shard `shard`: what a reader fetches in one go."""

    shard: int
    start: int
    rows: int


@dataclass(frozen=True)
class StepPlan:
    """The samples of some lanes of one global batch, in lane order."""

    step: int
    epoch: int
    lanes: tuple[int, int]
    ids: np.ndarray      # sample id = row number in the split (shard offset + row in shard)
    units: np.ndarray    # index into SamplePlan.units
    rows: np.ndarray     # row inside that unit

    def fingerprint(self) -> int:
        """A 63-bit digest of these sample ids, in order (for checking resumed runs against uninterrupted ones)."""
        h = _mix(self.ids.astype(np.uint64) + _mix(np.arange(len(self.ids), dtype=np.uint64)))
        return int(np.bitwise_xor.reduce(h, initial=np.uint64(0)) >> np.uint64(1))


def units_of(shard_rows: Sequence[int], unit_rows: Optional[int] = None) -> list[Unit]:
    """A split's units: each shard cut into runs of `unit_rows` rows (None: one unit per shard)."""
    out = []
    for s, n in enumerate(shard_rows):
        step = unit_rows or max(1, n)
        out.extend(Unit(s, a, min(step, n - a)) for a in range(0, n, step))
    return out


class SamplePlan:
    """(seed, epoch, step, global batch) -> the samples of that global batch, for any lanes."""

    def __init__(self, units: Sequence[Unit], shard_rows: Sequence[int], seed: int, global_batch: int,
                 shuffle: bool = True, cache_epochs: int = 2):
        self.units = list(units)
        self.seed, self.global_batch, self.shuffle = int(seed), int(global_batch), shuffle
        self.unit_rows = np.array([u.rows for u in self.units], np.int64)
        offsets = np.concatenate([[0], np.cumsum(np.asarray(shard_rows, np.int64))])
        self.unit_first_id = np.array([offsets[u.shard] + u.start for u in self.units], np.int64)
        self.num_samples = int(self.unit_rows.sum())
        self.steps_per_epoch = self.num_samples // self.global_batch
        if self.steps_per_epoch == 0:
            raise UserError(f"the training split has {self.num_samples} sequences, fewer than one global batch "
                            f"({self.global_batch}); prepare more data or lower the global batch")
        self.trained_per_epoch = self.steps_per_epoch * self.global_batch
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._cache_epochs = cache_epochs

    @classmethod
    def for_split(cls, split, seed: int, global_batch: int, shuffle: bool = True,
                  unit_rows: Optional[int] = None) -> "SamplePlan":
        return cls(units_of(split.shard_rows, unit_rows), split.shard_rows, seed, global_batch, shuffle)

    def epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(unit indices in this epoch's order, start position of each in the epoch's row sequence)."""
        got = self._epochs.get(epoch)
        if got is None:
            n = len(self.units)
            order = np.random.default_rng([self.seed, epoch, 0]).permutation(n) if self.shuffle else np.arange(n)
            starts = np.concatenate([[0], np.cumsum(self.unit_rows[order])[:-1]])
            if len(self._epochs) >= self._cache_epochs:
                self._epochs.pop(min(self._epochs))
            got = self._epochs[epoch] = (order, starts)
        return got

    def lanes_of(self, rank: int, world: int) -> tuple[int, int]:
        """The lanes rank `rank` of `world` data-parallel ranks trains on: a contiguous, equal share."""
        return lanes_of(self.global_batch, rank, world)

    def step(self, step: int, lanes: Optional[tuple[int, int]] = None) -> StepPlan:
        """The samples of global batch `step` (0-based) in lanes [lo, hi) (default: all of them)."""
        ids, units, rows, epoch = self.block(step, 1, lanes)
        return StepPlan(int(step), epoch, lanes or (0, self.global_batch), ids=ids[0], units=units[0], rows=rows[0])

    def block(self, step: int, count: int, lanes: Optional[tuple[int, int]] = None):
        """(ids, units, rows), each [count, lanes], and the epoch: global batches step .. step + count - 1 at once
        (vectorised: what a reader computes ahead). The steps must lie in one epoch."""
        lo, hi = lanes or (0, self.global_batch)
        epoch, t = divmod(int(step), self.steps_per_epoch)
        if t + count > self.steps_per_epoch:
            raise ValueError(f"steps {step}..{step + count - 1} cross an epoch boundary")
        order, starts = self.epoch_order(epoch)
        pos = (np.arange(lo, hi, dtype=np.int64) * self.steps_per_epoch)[None, :] + \
            np.arange(t, t + count, dtype=np.int64)[:, None]
        j = np.searchsorted(starts, pos, side="right") - 1
        units = order[j]
        off = pos - starts[j]
        if self.shuffle:
            with np.errstate(over="ignore"):
                key = _mix(_mix(_mix(np.uint64(self.seed)) + np.uint64(epoch)) + units.astype(np.uint64))
            rows = keyed_permute(off, self.unit_rows[units], key).astype(np.int64)
        else:
            rows = off
        return self.unit_first_id[units] + rows, units, rows, epoch

    def lane_units(self, epoch: int, lanes: tuple[int, int], t0: int = 0) -> list[tuple[int, int, int]]:
        """(first step, last step, unit) in this epoch for every unit lanes [lo, hi) use at or after epoch step
        t0, in the order they are first needed: what a reader fetches ahead, and when it may let go.

        Lanes [lo, hi) are one contiguous run of the epoch's row sequence, so this is a slice of the unit order."""
        lo, hi = lanes
        L = self.steps_per_epoch
        order, starts = self.epoch_order(epoch)
        a_end = min(hi * L, self.trained_per_epoch)
        j0 = int(np.searchsorted(starts, lo * L, side="right") - 1)
        j1 = int(np.searchsorted(starts, a_end - 1, side="right") - 1)
        j = np.arange(j0, j1 + 1)
        a = np.maximum(starts[j], lo * L)
        b = np.minimum(starts[j] + self.unit_rows[order[j]], a_end)  # exclusive
        one_lane = a // L == (b - 1) // L
        # A unit cut by a lane boundary is used from the start of the later lane to the end of the earlier one.
        first = np.where(one_lane, a % L, 0)
        last = np.where(one_lane, (b - 1) % L, L - 1)
        if t0:
            # Resuming at step t0: only the parts still ahead count.
            keep = last >= t0
            j, first, last = j[keep], np.maximum(first[keep], t0), last[keep]
        k = np.argsort(first, kind="stable")
        return [(int(f), int(e), int(order[u])) for f, e, u in zip(first[k], last[k], j[k])]


def lanes_of(global_batch: int, rank: int, world: int) -> tuple[int, int]:
    """The lanes (slots of every global batch) rank `rank` of `world` data-parallel ranks trains on: a contiguous,
    equal share, the same for a single split and a mixture."""
    if global_batch % world:
        raise UserError(f"global batch {global_batch} does not split evenly over {world} data-parallel "
                        "workers; make it a multiple of the worker count")
    per = global_batch // world
    return rank * per, (rank + 1) * per
