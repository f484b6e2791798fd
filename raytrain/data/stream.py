"""The global sample order and the per-worker stream that reads it through Ray Data.

Data position is one integer: how many samples of the global stream have been consumed. The global
stream is epoch after epoch of the split; each epoch shuffles the shard order and then shuffles rows
inside fixed windows, both from (seed, epoch[, window]). Because the order depends on nothing else -
not on the number of workers, not on timing - a run resumed at position P trains on exactly the
samples an uninterrupted run would have, and a run resumed with a different world size still does.

Every worker reads the whole global stream and keeps its own slice of each global batch. For language
models the token stream is tiny next to compute (a 1B model on an H200 eats well under 1 MB/s of
token ids), so the extra reads cost little and buy exactness and elasticity.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa

from raytrain.data.manifest import Split
from raytrain.errors import UserError


def _tokens_to_numpy(col, window: int) -> np.ndarray:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if isinstance(col, (pa.FixedSizeListArray, pa.ListArray, pa.LargeListArray)):
        return col.flatten().to_numpy(zero_copy_only=False).astype(np.int64, copy=False).reshape(-1, window)
    arr = col.to_numpy(zero_copy_only=False)  # Ray's tensor extension type or object arrays
    return np.stack(list(arr)).astype(np.int64, copy=False) if arr.dtype == object else arr.astype(np.int64, copy=False)


def read_pyarrow(uris: list[str], window: int, **_) -> Iterator[np.ndarray]:
    """Plain pyarrow reader: the baseline, and the reader for driver-side tools."""
    import pyarrow.parquet as pq

    from raytrain import storage

    for uri in uris:
        fs, path = storage.resolve(uri)
        yield _tokens_to_numpy(pq.read_table(path, filesystem=fs, columns=["tokens"])["tokens"], window)


def read_ray(uris: list[str], window: int, prefetch: int = 2, read_cpus: float = 0.5) -> Iterator[np.ndarray]:
    """Stream shards through Ray Data, in the given file order, with background prefetch."""
    import ray.data

    from raytrain import storage

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # exactness needs file order, not completion order
    ctx.enable_progress_bars = False
    fs, _ = storage.resolve(uris[0])
    paths = [storage.resolve(u)[1] for u in uris]
    ds = ray.data.read_parquet(paths, filesystem=fs, num_cpus=read_cpus,
                               override_num_blocks=len(paths)).select_columns(["tokens"])
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=prefetch):
        yield _tokens_to_numpy(batch["tokens"], window)


READERS = {"ray": read_ray, "pyarrow": read_pyarrow}


class SampleStream:
    """Rows of the global stream from `position` on. `take(n)` returns the next n rows and advances."""

    def __init__(self, split: Split, seed: int, shuffle: bool = True, window: int = 4096,
                 position: int = 0, reader: str = "ray", prefetch: int = 2, read_cpus: float = 0.5,
                 background: bool = False, stall_timeout_s: float = 600.0):
        self.split, self.seed, self.shuffle, self.window = split, seed, shuffle, window
        self.position = position
        self.background = background
        self.stall_timeout_s = stall_timeout_s
        self._read = READERS[reader]
        self._read_kwargs = {"prefetch": prefetch, "read_cpus": read_cpus}
        self._width = split.seq_len + 1
        self._gen: Optional[Iterator[np.ndarray]] = None
        self._buf = np.zeros((0, self._width), np.int64)

    @property
    def epoch(self) -> int:
        return self.position // self.split.num_samples

    def shard_order(self, epoch: int) -> np.ndarray:
        n = len(self.split.shard_uris)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, 0]).permutation(n)

    def _window_perm(self, epoch: int, w: int, size: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(size)
        return np.random.default_rng([self.seed, epoch, 1, w]).permutation(size)

    def _epoch_rows(self, epoch: int, offset: int) -> Iterator[np.ndarray]:
        """Rows of one epoch from `offset`, window by window."""
        order = self.shard_order(epoch)
        rows = np.array(self.split.shard_rows)[order]
        cum = np.concatenate([[0], np.cumsum(rows)])
        w = offset // self.window
        wstart = w * self.window
        first = int(np.searchsorted(cum, wstart, side="right") - 1)
        skip = wstart - int(cum[first])
        chunks = self._read([self.split.shard_uris[i] for i in order[first:]], self._width, **self._read_kwargs)
        pending: list[np.ndarray] = []
        have = 0
        total = int(cum[-1])
        for chunk in chunks:
            if skip:
                cut = min(skip, len(chunk))
                chunk, skip = chunk[cut:], skip - cut
            pending.append(chunk)
            have += len(chunk)
            while have >= min(self.window, total - wstart) and wstart < total:
                size = min(self.window, total - wstart)
                block = np.concatenate(pending)
                win, rest = block[:size], block[size:]
                pending, have = [rest], len(rest)
                win = win[self._window_perm(epoch, w, size)]
                yield win[offset - wstart:] if offset > wstart else win
                w, wstart = w + 1, wstart + size
        if wstart < total:
            raise RuntimeError(f"dataset {self.split.uri} ended early: read {wstart} of {total} rows its manifest lists")

    def _all_rows(self) -> Iterator[np.ndarray]:
        epoch, offset = divmod(self.position, self.split.num_samples)
        while True:
            yield from self._epoch_rows(epoch, offset)
            epoch, offset = epoch + 1, 0

    def _prefetching(self, depth: int = 2) -> Iterator[np.ndarray]:
        """Start the reader in a thread now, so epoch starts and shard reads overlap with training."""
        q: queue.Queue = queue.Queue(maxsize=depth)

        def produce() -> None:
            try:
                for chunk in self._all_rows():
                    q.put(chunk)
            except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                q.put(e)

        threading.Thread(target=produce, daemon=True, name="raytrain-data").start()

        def consume() -> Iterator[np.ndarray]:
            while True:
                try:
                    item = q.get(timeout=self.stall_timeout_s)
                except queue.Empty:
                    raise UserError(self._stall_message()) from None
                if isinstance(item, BaseException):
                    raise item
                yield item

        return consume()

    def start(self) -> "SampleStream":
        """Begin reading now (in the background if enabled), e.g. while the model is being built."""
        if self._gen is None:
            self._gen = self._prefetching() if self.background else self._all_rows()
        return self

    def _stall_message(self) -> str:
        msg = (f"no training data arrived for {self.stall_timeout_s:.0f}s from {self.split.uri}. ")
        try:
            import ray

            total, free = ray.cluster_resources().get("CPU", 0), ray.available_resources().get("CPU", 0)
            msg += f"The cluster has {total:g} CPUs, {free:g} free: "
        except Exception:  # noqa: BLE001 - diagnosis only
            pass
        return msg + ("Ray Data's read tasks need free CPUs; lower scaling.cpus_per_worker, raise scaling.data_cpus "
                      "on a cluster with spare CPUs, or add nodes (data.stall_timeout_s sets this limit)")

    def take(self, n: int) -> np.ndarray:
        if self._gen is None:
            self.start()
        while len(self._buf) < n:
            self._buf = np.concatenate([self._buf, next(self._gen)])
        out, self._buf = self._buf[:n], self._buf[n:]
        self.position += n
        return out
