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


TAR_BUFFER = 4 << 20

# Readers: (shard URIs in read order, window) -> iterator of (index into the URIs, rows). The index lets
# SampleStream check every shard's row count against the manifest and name a bad shard exactly.

def read_pyarrow(uris: list[str], window: int, **_) -> Iterator[tuple[int, np.ndarray]]:
    """Plain pyarrow reader: the baseline, and the reader for driver-side tools."""
    import pyarrow.parquet as pq

    from raytrain import storage

    for i, uri in enumerate(uris):
        fs, path = storage.resolve(uri)
        yield i, _tokens_to_numpy(pq.read_table(path, filesystem=fs, columns=["tokens"])["tokens"], window)


def read_tar(uris: list[str], window: int, **_) -> Iterator[tuple[int, np.ndarray]]:
    """Plain WebDataset reader: each tar is streamed member by member, never downloaded whole."""
    from raytrain import storage
    from raytrain.data.webdataset_io import iter_tar_rows

    for i, uri in enumerate(uris):
        fs, path = storage.resolve(uri)
        # Buffered: tarfile reads 512-byte blocks, and unbuffered each would be a request on S3.
        with fs.open_input_stream(path, buffer_size=TAR_BUFFER) as f:
            for rows in iter_tar_rows(f, window):
                yield i, rows


def _ray_ordered(uris: list[str]):
    import ray.data

    from raytrain import storage

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # exactness needs file order, not completion order
    ctx.enable_progress_bars = False
    fs, _ = storage.resolve(uris[0])
    paths = [storage.resolve(u)[1] for u in uris]
    return fs, paths, {p: i for i, p in enumerate(paths)}


def _ray_batches(ds, index: dict, column: str, window: int, prefetch: int) -> Iterator[tuple[int, np.ndarray]]:
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=prefetch):
        paths = batch["path"].to_pylist()
        rows = _tokens_to_numpy(batch[column], window)
        # A block normally holds one file; split on path changes in case Ray Data merged blocks.
        cut = [0] + [j for j in range(1, len(paths)) if paths[j] != paths[j - 1]] + [len(paths)]
        for a, b in zip(cut, cut[1:]):
            yield index[paths[a]], rows[a:b]


def read_ray(uris: list[str], window: int, prefetch: int = 2, read_cpus: float = 0.5) -> Iterator[tuple[int, np.ndarray]]:
    """Stream Parquet shards through Ray Data, in the given file order, with background prefetch."""
    import ray.data

    fs, paths, index = _ray_ordered(uris)
    ds = ray.data.read_parquet(paths, filesystem=fs, num_cpus=read_cpus, include_paths=True,
                               override_num_blocks=len(paths)).select_columns(["tokens", "path"])
    yield from _ray_batches(ds, index, "tokens", window, prefetch)


def read_ray_webdataset(uris: list[str], window: int, prefetch: int = 2,
                        read_cpus: float = 0.5) -> Iterator[tuple[int, np.ndarray]]:
    """Stream WebDataset tar shards through Ray Data (`read_webdataset`, which decodes the .npy members)."""
    import ray.data

    from raytrain.data.webdataset_io import MEMBER

    fs, paths, index = _ray_ordered(uris)
    ds = ray.data.read_webdataset(paths, filesystem=fs, num_cpus=read_cpus, include_paths=True,
                                  arrow_open_stream_args={"buffer_size": TAR_BUFFER},
                                  override_num_blocks=len(paths)).select_columns([MEMBER, "path"])
    yield from _ray_batches(ds, index, MEMBER, window, prefetch)


def _fast_start(ray_reader, plain_reader):
    """A Ray Data reader whose first `direct` shards (the first shuffle window) are read directly while Ray
    Data's tasks start for the rest.

    Ray Data's start-up (scheduling read tasks, starting their worker processes) took 3-27 s on 2 cores,
    and every epoch and every restarted worker paid it before its first batch (measured: 10.5 of a
    restart's 17 s); a few shards read in this process take milliseconds. Same shards, same order: the
    sample stream is unchanged."""

    def read(uris: list[str], window: int, direct: int = 1, **kwargs) -> Iterator[tuple[int, np.ndarray]]:
        direct = max(1, direct)
        rest = ray_reader(uris[direct:], window, **kwargs) if len(uris) > direct else iter(())
        first: queue.Queue = queue.Queue(maxsize=1)

        def start() -> None:  # runs the generator up to its first block, in the background
            try:
                first.put((0, next(rest)))
            except StopIteration:
                first.put((1, None))
            except BaseException as e:  # noqa: BLE001 - re-raised in the reading thread
                first.put((2, e))

        threading.Thread(target=start, daemon=True, name="raytrain-data-start").start()
        yield from plain_reader(uris[:direct], window)
        kind, item = first.get()
        if kind == 2:
            raise item
        if kind == 0:
            yield item[0] + direct, item[1]
            for i, rows in rest:
                yield i + direct, rows

    return read


READERS = {("parquet", "ray"): _fast_start(read_ray, read_pyarrow), ("parquet", "pyarrow"): read_pyarrow,
           ("webdataset", "ray"): _fast_start(read_ray_webdataset, read_tar), ("webdataset", "pyarrow"): read_tar}
PLAIN = {"parquet": read_pyarrow, "webdataset": read_tar}


class _BadShard(Exception):
    def __init__(self, index: int, reason: str):
        super().__init__(reason)
        self.index, self.reason = index, reason


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    for line in text.splitlines():  # Ray prefixes worker errors with its own lines; keep the cause
        if line.strip() and not line.startswith(("ray::", "Traceback", "  ")):
            text = line.strip()
    return (text or type(e).__name__)[:200]


class SampleStream:
    """Rows of the global stream from `position` on. `take(n)` returns the next n rows and advances."""

    def __init__(self, split: Split, seed: int, shuffle: bool = True, window: int = 4096,
                 position: int = 0, reader: str = "ray", prefetch: int = 2, read_cpus: float = 0.5,
                 background: bool = False, stall_timeout_s: float = 600.0, on_bad_shard: str = "error"):
        self.split, self.seed, self.shuffle, self.window = split, seed, shuffle, window
        self.position = position
        self.background = background
        self.stall_timeout_s = stall_timeout_s
        self.on_bad_shard = on_bad_shard
        self.skipped: list[str] = []  # shards skipped as unreadable (on_bad_shard=skip), each counted once
        self._read = READERS[(split.format, reader)]
        self._plain = PLAIN[split.format]
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
        uris = [self.split.shard_uris[i] for i in order[first:]]
        lost = [0]  # rows of skipped shards: the epoch is shorter by them
        # Shards that hold the first shuffle window: nothing is yielded before the whole window is read.
        need = skip + min(self.window, int(cum[-1]) - wstart)
        direct = int(np.searchsorted(np.cumsum(rows[first:]), need, side="left")) + 1
        chunks = self._checked(uris, [int(r) for r in rows[first:]], lost, direct)
        pending: list[np.ndarray] = []
        have = 0
        total = int(cum[-1])

        def windows(final: bool) -> Iterator[np.ndarray]:
            nonlocal pending, have, w, wstart
            while wstart < total - lost[0] and (have >= min(self.window, total - lost[0] - wstart) or final):
                if not have:
                    break
                size = min(self.window, total - lost[0] - wstart, have)
                block = np.concatenate(pending)
                win, rest = block[:size], block[size:]
                pending, have = [rest], len(rest)
                win = win[self._window_perm(epoch, w, size)]
                yield win[offset - wstart:] if offset > wstart else win
                w, wstart = w + 1, wstart + size

        for chunk in chunks:
            if skip:
                cut = min(skip, len(chunk))
                chunk, skip = chunk[cut:], skip - cut
            pending.append(chunk)
            have += len(chunk)
            yield from windows(final=False)
        yield from windows(final=True)  # a skipped shard near the end leaves a short last window
        if wstart < total - lost[0]:
            raise RuntimeError(f"dataset {self.split.uri} ended early: read {wstart} of {total} rows its manifest lists")

    def _checked(self, uris: list[str], expected: list[int], lost: list[int], direct: int = 1) -> Iterator[np.ndarray]:
        """The rows of `uris`, shard by shard, each handed on only once it is complete with the manifest's
        row count. A shard that fails to read or comes up short is named in a UserError, or skipped and
        counted (on_bad_shard=skip) - never half-used, so a skip drops exactly that shard's rows."""
        todo = []
        for j, uri in enumerate(uris):
            if uri in self.skipped:  # known bad from an earlier epoch
                lost[0] += expected[j]
            else:
                todo.append(j)
        while todo:
            cur, buf, got = 0, [], 0
            try:
                for k, rows in self._read([uris[j] for j in todo], self._width, direct=direct, **self._read_kwargs):
                    while k > cur:
                        self._check_rows(todo[cur], got, expected)
                        if buf:
                            yield np.concatenate(buf)
                        cur, buf, got = cur + 1, [], 0
                    buf.append(rows)
                    got += len(rows)
                while cur < len(todo):
                    self._check_rows(todo[cur], got, expected)
                    if buf:
                        yield np.concatenate(buf)
                    cur, buf, got = cur + 1, [], 0
                return
            except _BadShard as e:
                bad, reason = e.index, e.reason
            except Exception as e:  # noqa: BLE001 - which shard? read them plainly to find out
                found = self._find_bad(uris, todo[cur:], expected)
                if found is None:
                    raise
                bad, reason = found
            uri = uris[bad]
            if self.on_bad_shard != "skip":
                raise UserError(f"training data: shard {uri} cannot be used ({reason}); restore it or prepare the "
                                f"dataset again, or set data.on_bad_shard=skip to train without it") from None
            import logging

            logging.getLogger("raytrain").warning("skipping unreadable shard %s (%s)", uri, reason)
            self.skipped.append(uri)
            lost[0] += expected[bad]
            todo = [j for j in todo[cur:] if j != bad]

    @staticmethod
    def _check_rows(j: int, got: int, expected: list[int]) -> None:
        if got != expected[j]:
            raise _BadShard(j, f"read {got} rows, its manifest entry says {expected[j]}; truncated?")

    def _find_bad(self, uris: list[str], candidates: list[int], expected: list[int],
                  limit: int = 8) -> Optional[tuple[int, str]]:
        """The first unreadable shard among the next few (the reader may have failed on one it read ahead)."""
        for j in candidates[:limit]:
            try:
                got = sum(len(r) for _, r in self._plain([uris[j]], self._width))
            except Exception as e:  # noqa: BLE001 - any read failure marks the shard
                return j, _first_line(e)
            if got != expected[j]:
                return j, f"read {got} rows, its manifest entry says {expected[j]}; truncated?"
        return None

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
