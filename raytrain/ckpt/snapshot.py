"""The byte layout of one in-memory snapshot generation (a shared-memory file): data first, header next, commit word last.

A generation file holds [commit block: 64 bytes][skeleton pickle][tensor bytes, 64-byte aligned...][header JSON]. A
write first zeroes the commit block's magic (the generation is then invalid), copies the data, writes the header
(step, world size, rank, layout, a checksum per buffer), and only then the commit block (header offset, length and
crc32, the magic word last). A reader accepts a generation only when the magic, the header's crc and every buffer's
checksum match: a copy torn by a kill, or a header of one step over the data of another, is never loaded.

A generation of a step whose loss had not been read when it was taken (the loss is read a step late on steady steps:
raytrain/worker/verdict.py) says so in its header; once the loss is judged, its rank writes the step into the commit
block's judged word (zeroed when a write starts). A restore takes only judged generations (`judged`): a NaN step's
weights are never resumed from.

The buffer checksum is the wrapped int64 sum of the buffer's int32 words (plus its tail bytes): any stale region of
a torn copy changes it, and a GPU computes it on the source in well under a millisecond, so GPU tensors reach shared
memory by an asynchronous copy on a side stream (`write_from_gpu`) that the CPU never reads back; crc32 would cost
the CPU about 0.4 s per GB on every snapshot.
"""

from __future__ import annotations

import json
from collections import OrderedDict
import mmap
import os
import pickle
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

MAGIC = b"RTSNAP01"
_BLOCK = struct.Struct("<8sQQI")  # magic, header offset, header length, header crc32
BLOCK_SIZE = 64
_JUDGED = struct.Struct("<q")  # the step whose loss was judged after the generation was written (0: none)
JUDGED_AT = 32  # its offset in the commit block: an aligned 8-byte word after the block's fields


@dataclass(frozen=True)
class TensorSlot:
    """Stands in the pickled skeleton of a state dict for the tensor stored as buffer `index`."""

    index: int


@dataclass
class Snapshot:
    """A verified generation: its header and the state it holds (tensors copied out of shared memory)."""

    header: dict
    state: Any

    @property
    def step(self) -> int:
        return int(self.header["step"])


_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def flatten(obj: Any, tensors: list) -> Any:
    """`obj` with every tensor inside plain dicts / lists / tuples replaced by a TensorSlot (appended to `tensors`)."""
    import torch

    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return TensorSlot(len(tensors) - 1)
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, flatten(v, tensors)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        if all(type(v) in _SCALARS for v in obj):  # e.g. Python's RNG state, 625 ints: kept as it is, in one pass
            return obj
        return type(obj)(flatten(v, tensors) for v in obj)
    return obj


def unflatten(obj: Any, tensors: list) -> Any:
    """The inverse of `flatten`."""
    if isinstance(obj, TensorSlot):
        return tensors[obj.index]
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, unflatten(v, tensors)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(unflatten(v, tensors) for v in obj)
    return obj


ALIGN = 64  # tensor data starts on 64-byte boundaries: aligned copies, and int32 views of every buffer


def _aligned(off: int) -> int:
    return -(-off // ALIGN) * ALIGN


def _wrap64(v: int) -> int:
    return (v + 2**63) % 2**64 - 2**63


def checksum(b) -> int:
    """The checksum of a buffer's bytes (a 1-D uint8 numpy array or memoryview; CPU)."""
    a = np.frombuffer(b, dtype=np.uint8)
    n4 = a.size - a.size % 4
    words = int(np.add.reduce(a[:n4].view(np.int32), dtype=np.int64)) if n4 else 0
    return _wrap64(words + int(a[n4:].sum(dtype=np.int64)))


def _checksum_on_device(b):
    """`checksum` of a uint8 tensor, computed where it lives (a 0-d int64 tensor: nothing waits for it)."""
    import torch

    n4 = b.numel() - b.numel() % 4
    words = b[:n4]
    if words.storage_offset() % 4:
        words = words.clone()
    total = words.view(torch.int32).sum(dtype=torch.int64) if n4 else torch.zeros((), dtype=torch.int64,
                                                                                   device=b.device)
    return total + b[n4:].sum(dtype=torch.int64)


def _as_bytes(t):
    """A CPU, contiguous uint8 view of a tensor's data (a copy only for device or non-contiguous tensors)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def layout_of(tensors: list) -> list:
    """What the tensors look like (dtype, shape): two snapshots with equal layouts fit the same engine."""
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]


def size_needed(skeleton: bytes, tensors: list) -> int:
    """Bytes a generation file needs for this state: block, data, and room for the header."""
    data = sum(t.numel() * t.element_size() + ALIGN for t in tensors)
    return BLOCK_SIZE + len(skeleton) + data + 4096 + 160 * (len(tensors) + 1)


def invalidate(path: str) -> None:
    """Mark a generation unreadable (its magic zeroed) before it is overwritten or when its timeline ends."""
    try:
        with open(path, "r+b") as f:
            f.write(b"\0" * len(MAGIC))
    except FileNotFoundError:
        pass


def write(path: str, meta: dict, skeleton: bytes, tensors: list) -> dict:
    """Copy one state (pickled skeleton + tensors) into the generation file at `path` (sized by the node's actor);
    returns the header. The commit block goes last: until then the generation reads as invalid."""
    need = size_needed(skeleton, tensors)
    if os.path.getsize(path) < need:
        raise ValueError(f"snapshot file {path} holds {os.path.getsize(path)} bytes, {need} needed")
    mapping = Mapping(path, pin=False)
    try:
        return write_mapped(mapping, meta, skeleton, tensors)
    finally:
        mapping.close()


def write_mapped(mapping: "Mapping", meta: dict, skeleton: bytes, tensors: list) -> dict:
    """`write` into a generation kept mapped (a rank maps each of its two once: no page faults per snapshot)."""
    view = memoryview(mapping.mm)
    try:
        _blank(view)
        bufs, off = _put_skeleton(view, skeleton)
        for t in tensors:
            b = _as_bytes(t)
            n = b.numel()
            off = _aligned(off)
            if n:
                # numpy's copy: one thread, without the GIL (it runs beside the step, whose threads it must not crowd)
                np.copyto(mapping.buf[off:off + n].numpy(), b.numpy())
            bufs.append({"off": off, "n": n, "sum": checksum(b.numpy())})
            off += n
        return _commit(view, mapping.path, {**meta, "buffers": bufs, "layout": layout_of(tensors)}, off)
    finally:
        view.release()


def _blank(view) -> None:
    """A write starts: the generation reads as invalid, and as unjudged once committed (the old step's mark goes)."""
    view[:len(MAGIC)] = b"\0" * len(MAGIC)
    view[JUDGED_AT:JUDGED_AT + _JUDGED.size] = b"\0" * _JUDGED.size


def mark_judged(mapping: "Mapping", step: int) -> None:
    """The committed generation in `mapping`, of `step`, may be restored: its loss was read and passed the health
    rules. One aligned 8-byte store, no header rewrite: a generation read meanwhile is never torn by it."""
    mapping.mm[JUDGED_AT:JUDGED_AT + _JUDGED.size] = _JUDGED.pack(step)


def judged(path: str, header: dict) -> bool:
    """Whether the generation at `path` with `header` (read_header's) is of a step whose loss was judged: when it was
    taken, or marked since."""
    if header.get("judged") is True:
        return True
    try:
        with open(path, "rb") as f:
            f.seek(JUDGED_AT)
            word = f.read(_JUDGED.size)
    except OSError:
        return False
    return len(word) == _JUDGED.size and _JUDGED.unpack(word)[0] == int(header["step"])


def _put_skeleton(view, skeleton: bytes) -> tuple[list, int]:
    """The pickled skeleton after the commit block: (its buffer record, the offset after it)."""
    view[BLOCK_SIZE:BLOCK_SIZE + len(skeleton)] = skeleton
    return [{"off": BLOCK_SIZE, "n": len(skeleton), "sum": checksum(skeleton)}], BLOCK_SIZE + len(skeleton)


def _commit(view, path: str, header: dict, off: int) -> dict:
    """The header at `off`, then the commit block: offsets and crc first, the magic word (one aligned 8-byte
    store) last. Returns the header."""
    text = json.dumps(header).encode()
    if off + len(text) > len(view):
        raise ValueError(f"snapshot header does not fit in {path}")
    view[off:off + len(text)] = text
    view[len(MAGIC):_BLOCK.size] = _BLOCK.pack(MAGIC, off, len(text), zlib.crc32(text))[len(MAGIC):]
    view[:len(MAGIC)] = MAGIC
    return header


class Mapping:
    """A generation file mapped for as long as its rank runs; with `pin` and CUDA its pages are registered with
    CUDA (page-locked) so that the GPU copies into them directly at full speed. Unregistered and unmapped by
    `close`."""

    def __init__(self, path: str, *, pin: bool = True):
        import torch

        self.path = path
        with open(path, "r+b") as f:
            self.mm = mmap.mmap(f.fileno(), 0)
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        # Unpinned, a copy from the GPU stages through a driver buffer and blocks the host: correct, only slower.
        self.pinned = pin and torch.cuda.is_available() and int(
            torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.buf.numel(), 0)) == 0

    def close(self) -> None:
        import torch

        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
        del self.buf
        try:
            self.mm.close()
        except BufferError:  # a view of it is still alive somewhere: the mapping goes with it
            pass


class PendingWrite:
    """A generation whose tensor bytes are still on their way from the GPU; `finish` waits for the copies and
    commits it. Until then the generation reads as invalid, and the source tensors must not change."""

    def __init__(self, mapping: Mapping, header: dict, off: int, sums, done):
        self.mapping, self.header, self.off, self.sums, self.done = mapping, header, off, sums, done

    def wait(self) -> None:
        """Until the copies have read their sources (the generation stays uncommitted)."""
        self.done.synchronize()

    def finish(self) -> dict:
        self.done.synchronize()
        for b, s in zip(self.header["buffers"][1:], self.sums.tolist()):
            b["sum"] = s
        view = memoryview(self.mapping.mm)
        try:
            return _commit(view, self.mapping.path, self.header, self.off)
        finally:
            view.release()


def write_from_gpu(mapping: Mapping, meta: dict, skeleton: bytes, tensors: list, stream) -> PendingWrite:
    """Start copying one state into the generation mapped by `mapping` on the CUDA `stream` (after the work the
    current stream has queued); returns at once. The checksums are computed on the GPU, on the source."""
    import torch

    view = memoryview(mapping.mm)
    try:
        _blank(view)
        bufs, off = _put_skeleton(view, skeleton)
    finally:
        view.release()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # temporaries (contiguous copies, sums) belong to the side stream
        sums = []
        for t in tensors:
            src = t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else None
            n = 0 if src is None else src.numel()
            off = _aligned(off)
            if n:
                if src.device.type == "cuda":
                    sums.append(_checksum_on_device(src))
                    mapping.buf[off:off + n].copy_(src, non_blocking=True)
                else:  # a CPU tensor among them (counters, RNG): copied now, it is small
                    mapping.buf[off:off + n].copy_(src)
                    sums.append(torch.tensor(checksum(src.numpy()), dtype=torch.int64, device=stream.device))
            else:
                sums.append(torch.zeros((), dtype=torch.int64, device=stream.device))
            bufs.append({"off": off, "n": n, "sum": None})
            off += n
        host = torch.empty(len(sums), dtype=torch.int64, pin_memory=True)
        if sums:
            host.copy_(torch.stack(sums), non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return PendingWrite(mapping, {**meta, "buffers": bufs, "layout": layout_of(tensors)}, off, host, done)


def _commit_block(f) -> Optional[tuple[int, int, int]]:
    """(header offset, header length, header crc32) from an open generation's commit block; None when blank/torn."""
    block = f.read(_BLOCK.size)
    if len(block) < _BLOCK.size:
        return None
    magic, off, n, crc = _BLOCK.unpack(block)
    return (off, n, crc) if magic == MAGIC else None


def read_header(path: str) -> Optional[dict]:
    """A generation's header when its commit block and header crc check out; None for a torn, blank or missing one."""
    try:
        with open(path, "rb") as f:
            commit = _commit_block(f)
            if commit is None:
                return None
            off, n, crc = commit
            f.seek(off)
            text = f.read(n)
    except (FileNotFoundError, OSError, ValueError):
        return None
    return _header_text(text, n, crc)


def _header_text(text: bytes, n: int, crc: int) -> Optional[dict]:
    """The header from its bytes when they are whole and match the commit block's crc32; None otherwise."""
    if len(text) != n or zlib.crc32(text) != crc:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def verify(path: str, header: dict) -> bool:
    """Every buffer's crc32 matches its header (reads the whole generation once)."""
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (FileNotFoundError, OSError, ValueError):
        return False
    view = memoryview(mm)
    try:
        ok = all(b["off"] + b["n"] <= len(mm) and checksum(view[b["off"]:b["off"] + b["n"]]) == b["sum"]
                 for b in header["buffers"])
        return ok
    finally:
        view.release()
        mm.close()


def load(path: str, header: dict) -> Optional[Snapshot]:
    """The state of a generation whose header was read: tensors copied out and checked against their crc (the
    commit word is read again after the copy, so a generation overwritten meanwhile is refused)."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mm)
    try:
        snap = _state_of(view, header)
    finally:
        view.release()
        mm.close()
    return snap if snap is not None and read_header(path) == header else None


def load_bytes(data: bytes) -> Optional[Snapshot]:
    """The state of a whole generation received from another node (committed_bytes); None when it does not check
    out."""
    header = header_of(data)
    return _state_of(memoryview(data), header) if header is not None else None


def _state_of(view, header: dict) -> Optional[Snapshot]:
    """A generation's state from its bytes: tensors copied out, every buffer checked against its crc."""
    import torch

    bufs, layout = header["buffers"], header["layout"]
    sk = bytes(view[bufs[0]["off"]:bufs[0]["off"] + bufs[0]["n"]])
    tensors = []
    for b, (dtype, shape) in zip(bufs[1:], layout):
        raw = bytearray(view[b["off"]:b["off"] + b["n"]])
        if checksum(raw) != b["sum"]:
            return None
        t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        tensors.append(t.view(getattr(torch, dtype)).reshape(shape))
    if checksum(sk) != bufs[0]["sum"]:
        return None
    return Snapshot(header, unflatten(pickle.loads(sk), tensors))


def dump_skeleton(state: Any) -> tuple[bytes, list]:
    """(pickled skeleton, tensors) of a state dict."""
    tensors: list = []
    skeleton = flatten(state, tensors)
    return pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL), tensors


def committed_bytes(path: str) -> Optional[tuple[int, bytes]]:
    """(step, bytes) of a generation copied whole (block, data, header) and checked on the copy: what a peer copy
    sends. None when the generation is blank, torn, or was overwritten while it was read."""
    try:
        with open(path, "rb") as f:
            commit = _commit_block(f)
            if commit is None:
                return None
            off, n, _ = commit
            f.seek(0)
            data = f.read(off + n)
    except (OSError, ValueError):
        return None
    h = header_of(data)
    if h is None or not all(checksum(memoryview(data)[b["off"]:b["off"] + b["n"]]) == b["sum"] for b in h["buffers"]):
        return None
    return int(h["step"]), data


def header_of(data: bytes) -> Optional[dict]:
    """The header of a generation held in memory (see read_header)."""
    if len(data) < _BLOCK.size:
        return None
    magic, off, n, crc = _BLOCK.unpack(data[:_BLOCK.size])
    return _header_text(data[off:off + n], n, crc) if magic == MAGIC else None


def place(path: str, data: bytes) -> None:
    """Write a whole generation received from elsewhere (committed_bytes) into the file at `path`: blank first,
    the commit word last, like `write`."""
    with open(path, "r+b") as f:
        f.write(b"\0" * len(MAGIC))
        f.seek(len(MAGIC))
        f.write(data[len(MAGIC):])
        f.flush()
        f.seek(0)
        f.write(data[:len(MAGIC)])
