"""Reading under the sample plan: one rank's rows of each global batch, from only the units that hold them.

The plan (raytrain/data/sample_plan.py) says which units this rank's lanes walk through and when each is first
and last needed. A background pool reads them ahead in that order (Parquet: the unit's row groups, token
column only; WebDataset: the tar, member by member), each unit once, through raytrain.storage so local
paths and s3:// both work and every byte fetched is counted. A unit stays in the cache from its first to
its last use by this rank, then goes: the cache holds about one unit per lane plus the read-ahead.

Why pyarrow here and not Ray Data: a rank reads a handful of whole units, in an order the plan fixes; Ray
Data's per-epoch pipeline start-up (3-27 s measured on 2 cores with the reader this one replaced, see
docs/BENCHMARKS_HISTORY.md) and its completion-order output buy nothing for that, and each unit is one sequential
read that pyarrow decodes in C++.

`read_rows` is the same unit reader for tools that want rows in the split's own order (validation, `raytrain
eval`, the serving check): it opens only the units that hold the rows asked for.
"""

from __future__ import annotations

import heapq
import io
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import numpy as np
import pyarrow as pa

from raytrain import storage
from raytrain.data.manifest import Split
from raytrain.data.sample_plan import SamplePlan, StepPlan, units_of
from raytrain.errors import UserError, first_line


def _tokens_to_numpy(col, width: int, dtype=np.int64) -> np.ndarray:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if isinstance(col, (pa.FixedSizeListArray, pa.ListArray, pa.LargeListArray)):
        return col.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(-1, width)
    arr = col.to_numpy(zero_copy_only=False)  # Ray's tensor extension type or object arrays
    return np.stack(list(arr)).astype(dtype, copy=False) if arr.dtype == object else arr.astype(dtype, copy=False)


class BadUnit(Exception):
    def __init__(self, uri: str, reason: str):
        super().__init__(reason)
        self.uri, self.reason = uri, reason


def read_unit(split: Split, unit, counter: Optional[storage.ReadCounter] = None, dtype=np.int64) -> np.ndarray:
    """The rows of one unit, [rows, seq_len + 1] of `dtype`. A unit that cannot be read whole is a BadUnit."""
    uri = split.shard_uris[unit.shard]
    width = split.seq_len + 1
    expected = split.shard_rows[unit.shard]
    try:
        with storage.open_counted(uri, counter) as f:
            # A unit that is its whole shard (as `raytrain prepare` writes them) is one GET; a part of a
            # shard is its footer plus its row groups' ranges.
            src = io.BytesIO(f.read()) if unit.start == 0 and unit.rows == expected else f
            if split.format == "parquet":
                import pyarrow.parquet as pq

                pf = pq.ParquetFile(src)
                if pf.metadata.num_rows != expected:
                    raise BadUnit(uri, f"read {pf.metadata.num_rows} rows, its manifest entry says {expected}; truncated?")
                sizes = np.array([pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)])
                ends = np.cumsum(sizes)
                g0 = int(np.searchsorted(ends, unit.start, side="right"))
                g1 = int(np.searchsorted(ends, unit.start + unit.rows - 1, side="right"))
                t = pf.read_row_groups(list(range(g0, g1 + 1)), columns=list(split.columns))
                rows = np.concatenate([_tokens_to_numpy(t[c], width, dtype) for c in split.columns], axis=1) \
                    if len(split.columns) > 1 else _tokens_to_numpy(t["tokens"], width, dtype)
                skip = unit.start - int(ends[g0] - sizes[g0])
                return rows[skip:skip + unit.rows]
            from raytrain.data.webdataset_io import iter_tar_rows

            # Buffered: tarfile reads 512-byte blocks, and unbuffered each would be a request on S3.
            stream = src if src is not f else io.BufferedReader(f, buffer_size=4 << 20)
            chunks = list(iter_tar_rows(stream, width, members=split.columns))
            rows = np.concatenate(chunks).astype(dtype, copy=False) if chunks else np.zeros((0, split.row_width), dtype)
            if len(rows) != expected:
                raise BadUnit(uri, f"read {len(rows)} rows, its manifest entry says {expected}; truncated?")
            return rows[unit.start:unit.start + unit.rows]
    except BadUnit:
        raise
    except Exception as e:  # noqa: BLE001 - any read or decode failure marks the shard
        raise BadUnit(uri, first_line(e)) from None


def bad_shard_error(e: BadUnit) -> UserError:
    return UserError(f"training data: shard {e.uri} cannot be used ({e.reason}); restore it or prepare the "
                     f"dataset again, or set data.on_bad_shard=skip to train without it")


def read_rows(split: Split, start: int, stop: int, on_bad_shard: str = "error",
              counter: Optional[storage.ReadCounter] = None, skipped: Optional[list] = None) -> np.ndarray:
    """Rows [start, stop) of the split in its own order (shard after shard), [n, seq_len + 1] int64, reading
    only the shards that hold them. With on_bad_shard=skip an unreadable shard's rows are left out (so fewer
    rows come back) and its URI is appended to `skipped`."""
    out, at = [], 0
    for unit in units_of(split.shard_rows):
        lo, hi = max(start, at), min(stop, at + unit.rows)
        if lo < hi:
            try:
                rows = read_unit(split, unit, counter)
            except BadUnit as e:
                if on_bad_shard != "skip":
                    raise bad_shard_error(e) from None
                logging.getLogger("raytrain").warning("skipping unreadable shard %s (%s)", e.uri, e.reason)
                if skipped is not None:
                    skipped.append(e.uri)
            else:
                out.append(rows[lo - at:hi - at])
        at += unit.rows
        if at >= stop:
            break
    return np.concatenate(out) if out else np.zeros((0, split.row_width), np.int64)


class PlannedReader:
    """This rank's rows of global batch `step`, for steps start, start + 1, ... (strictly in order).

    Three parts: a scheduler thread submits unit reads to a pool in the order the plan first needs them
    (at most `ahead` units before they are needed); an assembler thread computes the plan for blocks of
    steps and gathers their rows from the units in memory (then lets go of units it is done with); the
    training thread's `take` only pops a ready batch."""

    def __init__(self, split: Split, plan: SamplePlan, lanes: tuple[int, int], start_step: int = 0,
                 ahead: Optional[int] = None, threads: int = 4, stall_timeout_s: float = 600.0,
                 on_bad_shard: str = "error", counter: Optional[storage.ReadCounter] = None,
                 end_step: Optional[int] = None, feed=None, transform=None):
        self.split, self.plan, self.lanes = split, plan, lanes
        self.transform = transform  # data.transform (raytrain/data/transforms.py), applied as each unit is read
        self.feed = feed  # data.reader=ray: units come from the ingest pipeline by key (raytrain/data/ingest.py)
        self.step_next = start_step
        # Nothing at or past end_step is read (the run's last step: no read-ahead wasted); extend_to moves it.
        self.end_step = end_step if end_step is not None else 2 ** 62
        n_lanes = lanes[1] - lanes[0]
        # Units read before any lane needs them. All lanes can enter new units at the same step (when the
        # lane length is a multiple of the unit size), so up to one per lane, within a fixed bound.
        self.ahead = ahead or max(4, min(n_lanes, 32))
        # Steps assembled at once: amortises the plan's vectorised work; ~1024 rows per block bounds memory.
        self.block = max(1, min(32, 512 // max(1, n_lanes)))
        self.stall_timeout_s, self.on_bad_shard = stall_timeout_s, on_bad_shard
        self.counter = counter or storage.ReadCounter()
        self.rows_read = 0       # rows decoded from storage (whole units)
        self.rows_trained = 0    # rows handed to training
        self.units_opened: list[tuple[int, int]] = []  # (epoch, unit), in read order
        self.wait_s = 0.0
        self.skipped: list[str] = []
        self._cache: dict[tuple[int, int], Future] = {}
        self._release: list[tuple[int, tuple[int, int]]] = []  # heap of (last global step, key)
        self._first: dict[tuple[int, int], int] = {}
        self._assembled = start_step  # the first step not yet assembled
        self._assembling = start_step  # the first step past the block being assembled
        self._cv = threading.Condition()
        self._lock = threading.Lock()
        self._stop = False
        self._error: Optional[BaseException] = None
        self._ready: queue.Queue = queue.Queue(maxsize=2)  # blocks of assembled steps
        self._current: list = []
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="raytrain-read")
        self._threads = [threading.Thread(target=self._guard, args=(fn,), daemon=True, name=f"raytrain-plan-{fn.__name__}")
                         for fn in (self._schedule, self._assemble)]
        for t in self._threads:
            t.start()

    def _guard(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            with self._cv:
                self._error = self._error or e
                self._cv.notify_all()
            try:
                self._ready.put(e, timeout=5)
            except queue.Full:
                pass

    # ------------------------------------------------------------------ scheduler (background thread)

    def _schedule(self) -> None:
        L = self.plan.steps_per_epoch
        epoch, t0 = divmod(self.step_next, L)
        while True:
            for first, last, unit in self.plan.lane_units(epoch, self.lanes, t0):
                key = (epoch, unit)
                with self._cv:
                    while not self._stop and (epoch * L + first >= self.end_step or sum(
                            1 for f in self._first.values() if f >= self._assembling) >= self.ahead):
                        self._cv.wait(1.0)
                    if self._stop:
                        return
                    self._first[key] = epoch * L + first
                    heapq.heappush(self._release, (epoch * L + last, key))
                    self._cache[key] = self._fetch(epoch, unit)
                    self._cv.notify_all()
            epoch, t0 = epoch + 1, 0

    def _fetch(self, epoch: int, u: int) -> Future:
        """The unit's rows, read here (a pool thread) or delivered by the ingest pipeline."""
        if self.feed is None:
            return self._pool.submit(self._load, epoch, u)
        out: Future = Future()
        self.units_opened.append((epoch, u))

        def arrived(fut: Future) -> None:
            try:
                rows, bad = fut.result()
            except BaseException as e:  # noqa: BLE001 - the pipeline's failure, raised where the unit is needed
                out.set_exception(e)
                return
            if not bad:
                with self._lock:
                    self.rows_read += len(rows)
                out.set_result(rows)
                return
            e = BadUnit(*bad.split("\t", 1))
            if self.on_bad_shard != "skip":
                out.set_exception(bad_shard_error(e))
                return
            # Its places filled from the next readable unit, read here (a failure case: this rank reads storage).
            sub = self._pool.submit(self._substitute, epoch, u, e)
            sub.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception() else
                                  out.set_result(f.result()))

        self.feed.future((epoch, u)).add_done_callback(arrived)
        return out

    def _load(self, epoch: int, u: int) -> np.ndarray:
        unit = self.plan.units[u]
        self.units_opened.append((epoch, u))
        try:
            # Token ids as int32: half the cache of int64, decoded once (no second copy).
            rows = self._transformed(read_unit(self.split, unit, self.counter, np.int32), epoch, u)
        except BadUnit as e:
            if self.on_bad_shard != "skip":
                raise bad_shard_error(e) from None
            return self._substitute(epoch, u, e)
        with self._lock:
            self.rows_read += len(rows)
        return rows

    def _transformed(self, rows: np.ndarray, epoch: int, u: int) -> np.ndarray:
        return rows if self.transform is None else self.transform(rows, epoch=epoch, unit=u, split=self.split)

    def _skip(self, uri: str) -> bool:
        """Counts a bad shard once, however many reader threads meet it at once (two epochs' loads can)."""
        with self._lock:
            if uri in self.skipped:
                return False
            self.skipped.append(uri)
            return True

    def _substitute(self, epoch: int, u: int, e: BadUnit) -> np.ndarray:
        """A skipped unit's places are filled from the next readable unit in the epoch's order: a function of
        the data and the plan alone, so every rank that reads either unit fills them alike, at any N."""
        if self._skip(e.uri):
            logging.getLogger("raytrain").warning("skipping unreadable shard %s (%s)", e.uri, e.reason)
        order, _ = self.plan.epoch_order(epoch)
        j = int(np.flatnonzero(order == u)[0])
        for k in range(1, len(order)):
            cand = int(order[(j + k) % len(order)])
            try:
                rows = self._transformed(read_unit(self.split, self.plan.units[cand], self.counter, np.int32),
                                         epoch, cand)
            except BadUnit as e2:
                self._skip(e2.uri)
                continue
            with self._lock:
                self.rows_read += len(rows)
            reps = -(-self.plan.units[u].rows // len(rows))
            return np.concatenate([rows] * reps)[:self.plan.units[u].rows]
        raise UserError(f"training data: no shard of {self.split.uri} can be read; restore the data or prepare it again")

    # ------------------------------------------------------------------ assembler (background thread)

    def _assemble(self) -> None:
        L, width = self.plan.steps_per_epoch, self.split.row_width
        s = self.step_next
        while not self._stop:
            with self._cv:
                while not self._stop and s >= self.end_step:
                    self._cv.wait(1.0)
                count = min(self.block, L - s % L, self.end_step - s)
            if self._stop:
                return
            ids, units, rows, epoch = self.plan.block(s, count, self.lanes)
            with self._cv:
                self._assembling = s + count  # units this block needs are not "ahead"
                self._cv.notify_all()
            out = np.empty(units.shape + (width,), np.int32)  # widened to int64 on the device (half the copy)
            flat_units, flat_rows, flat_out = units.ravel(), rows.ravel(), out.reshape(-1, width)
            order = np.argsort(flat_units, kind="stable")  # group the block's samples by unit
            cuts = np.flatnonzero(np.diff(flat_units[order])) + 1
            for idx in np.split(order, cuts):
                flat_out[idx] = self._unit((epoch, int(flat_units[idx[0]])))[flat_rows[idx]]
            with self._cv:
                self._assembled = s + count
                while self._release and self._release[0][0] < self._assembled:
                    _, key = heapq.heappop(self._release)
                    self._cache.pop(key, None)
                    self._first.pop(key, None)
                self._cv.notify_all()
            item = (s, epoch, ids, units, rows, out)
            while not self._stop:
                try:
                    self._ready.put(item, timeout=1.0)
                    break
                except queue.Full:
                    pass
            s += count

    def extend_to(self, end_step: int) -> None:
        """Allow reading up to (not including) global batch end_step."""
        with self._cv:
            self.end_step = max(self.end_step, end_step)
            self._cv.notify_all()

    def _unit(self, key: tuple[int, int]) -> np.ndarray:
        deadline = time.monotonic() + self.stall_timeout_s
        with self._cv:
            while key not in self._cache:
                if self._error is not None:
                    raise self._error
                if self._stop:
                    raise RuntimeError("the reader was closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise UserError(self._stall())
                self._cv.wait(min(left, 1.0))
            fut = self._cache[key]
        try:
            return fut.result(timeout=max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            raise UserError(self._stall()) from None

    # ------------------------------------------------------------------ consumer (training thread)

    def take(self, step: Optional[int] = None) -> tuple[np.ndarray, StepPlan]:
        """(rows of this rank's lanes for global batch `step`, the step's plan). Steps go strictly forward."""
        step = self.step_next if step is None else step
        if step != self.step_next:
            raise ValueError(f"PlannedReader reads forward: asked for step {step}, next is {self.step_next}")
        if step >= self.end_step:
            self.extend_to(step + 1)
        if not self._current:
            t0 = time.perf_counter()
            try:
                item = self._ready.get(timeout=self.stall_timeout_s)
            except queue.Empty:
                raise UserError(self._stall()) from None
            self.wait_s += time.perf_counter() - t0
            if isinstance(item, BaseException):
                raise item
            s0, epoch, ids, units, rows, out = item
            self._current = [(s0 + i, StepPlan(s0 + i, epoch, self.lanes, ids=ids[i], units=units[i], rows=rows[i]), out[i])
                             for i in range(len(ids))]
        got, sp, rows = self._current.pop(0)
        assert got == step, (got, step)
        self.step_next = step + 1
        self.rows_trained += len(sp.ids)
        return rows, sp

    def _stall(self) -> str:
        return (f"no training data arrived for {self.stall_timeout_s:.0f}s from {self.split.uri}; check that its "
                "storage is reachable from every node (data.stall_timeout_s sets this limit)")

    @property
    def cached_units(self) -> int:
        return len(self._cache)

    def counters(self) -> dict:
        return {"rows_read": self.rows_read, "rows_trained": self.rows_trained, "bytes_fetched": self.counter.bytes,
                "units_opened": len(self.units_opened), "data_wait_s": self.wait_s,
                "skipped_shards": len(self.skipped)}

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._pool.shutdown(wait=True, cancel_futures=True)  # at most `threads` unit reads in flight
