"""The byte layout of one in-memory snapshot generation (a shared-memory file): data first, header next, commit word last.

A generation file holds [commit block: 64 bytes][skeleton pickle][tensor bytes...][header JSON]. A write first
zeroes the commit block's magic (the generation is then invalid), copies the data, writes the header (step, world
size, rank, layout, a crc32 per buffer), and only then the commit block (header offset, length and crc32, the magic
word last). A reader accepts a generation only when the magic, the header's crc and every buffer's crc match: a copy
torn by a kill, or a header of one step over the data of another, is never loaded.
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

MAGIC = b"RTSNAP01"
_BLOCK = struct.Struct("<8sQQI")  # magic, header offset, header length, header crc32
BLOCK_SIZE = 64


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


def flatten(obj: Any, tensors: list) -> Any:
    """`obj` with every tensor inside plain dicts / lists / tuples replaced by a TensorSlot (appended to `tensors`)."""
    import torch

    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return TensorSlot(len(tensors) - 1)
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, flatten(v, tensors)) for k, v in obj.items())
    if type(obj) in (list, tuple):
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
    data = sum(t.numel() * t.element_size() for t in tensors)
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
    with open(path, "r+b") as f:
        if os.fstat(f.fileno()).st_size < need:
            raise ValueError(f"snapshot file {path} holds {os.fstat(f.fileno()).st_size} bytes, {need} needed")
        mm = mmap.mmap(f.fileno(), 0)
    view = memoryview(mm)
    try:
        view[:len(MAGIC)] = b"\0" * len(MAGIC)
        off = BLOCK_SIZE
        view[off:off + len(skeleton)] = skeleton
        bufs = [{"off": off, "n": len(skeleton), "crc": zlib.crc32(skeleton)}]
        off += len(skeleton)
        for t in tensors:
            b = _as_bytes(t).numpy()
            n = b.size
            view[off:off + n] = b  # one memcpy
            bufs.append({"off": off, "n": n, "crc": zlib.crc32(view[off:off + n])})
            off += n
        header = {**meta, "buffers": bufs, "layout": layout_of(tensors)}
        text = json.dumps(header).encode()
        if off + len(text) > len(mm):
            raise ValueError(f"snapshot header does not fit in {path}")
        view[off:off + len(text)] = text
        # The commit block: offsets and crc first, the magic word (one aligned 8-byte store) last.
        view[len(MAGIC):_BLOCK.size] = _BLOCK.pack(MAGIC, off, len(text), zlib.crc32(text))[len(MAGIC):]
        view[:len(MAGIC)] = MAGIC
    finally:
        view.release()
        mm.close()
    return header


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
        ok = all(b["off"] + b["n"] <= len(mm) and zlib.crc32(view[b["off"]:b["off"] + b["n"]]) == b["crc"]
                 for b in header["buffers"])
        return ok
    finally:
        view.release()
        mm.close()


def load(path: str, header: dict) -> Optional[Snapshot]:
    """The state of a generation whose header was read: tensors copied out and checked against their crc (the
    commit word is read again after the copy, so a generation overwritten meanwhile is refused)."""
    import torch

    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mm)
    try:
        bufs, layout = header["buffers"], header["layout"]
        sk = bytes(view[bufs[0]["off"]:bufs[0]["off"] + bufs[0]["n"]])
        tensors = []
        for b, (dtype, shape) in zip(bufs[1:], layout):
            raw = bytearray(view[b["off"]:b["off"] + b["n"]])
            if zlib.crc32(raw) != b["crc"]:
                return None
            t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            tensors.append(t.view(getattr(torch, dtype)).reshape(shape))
    finally:
        view.release()
        mm.close()
    if zlib.crc32(sk) != bufs[0]["crc"] or read_header(path) != header:
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
    if h is None or not all(zlib.crc32(data[b["off"]:b["off"] + b["n"]]) == b["crc"] for b in h["buffers"]):
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
