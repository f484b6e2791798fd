"""The names in a run's checkpoint directories, their time stamps and checksums: written here once, imported elsewhere.

A checkpoint directory holds:
    engine/ + latest            DeepSpeed engine state (model, optimizer, LR scheduler), all ranks' shards
    rng/rank_NNNNN.pt           each rank's Python / NumPy / torch RNG state
    raytrain_state.json         step, samples_seen (the data position), tokens_seen, world size, ...
    config.yaml                 the resolved config of the run that wrote it
    universal/                  after a resized resume: the DeepSpeed universal form, with its own manifest
    manifest.json               written last: every file with size and sha256 (see raytrain.ckpt.catalog)
"""

from __future__ import annotations

import calendar
import hashlib
import os
import re
import time
from typing import Optional

from raytrain.rundir import CONFIG, CONVERSIONS, RESTORES, RESUME_MARKER, TAGS as TAGS_DIR  # noqa: F401 - named there

MANIFEST = "manifest.json"
STATE = "raytrain_state.json"
ENGINE_TAG = "engine"  # DeepSpeed's tag of the engine state inside a checkpoint
UNIVERSAL = "universal"  # beside the checkpoint's files: its DeepSpeed universal form, for resized resumes
UNIVERSAL_TAG = ENGINE_TAG + "_universal"  # the engine state's tag inside universal/
RNG_DIR = "rng"

TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # UTC, as manifests, tags and markers record it

_NAME = re.compile(r"^checkpoint_(\d{8})$")
_BLOCK = 1 << 20


def dir_name(step: int) -> str:
    """The directory of the checkpoint at `step`."""
    return f"checkpoint_{step:08d}"


def step_of(name_or_uri: str) -> int:
    """The step of a checkpoint directory (name or URI); -1 for anything that is not one."""
    m = _NAME.match(name_or_uri.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else -1


def rng_file(rank: int) -> str:
    """A rank's RNG state, relative to its checkpoint."""
    return f"{RNG_DIR}/rank_{rank:05d}.pt"


def timestamp(t: Optional[float] = None) -> str:
    """`t` (epoch seconds; now when None) as the UTC time stamp that manifests record."""
    return time.strftime(TIME_FORMAT, time.gmtime(t))


def parse_timestamp(s: str) -> float:
    """Epoch seconds of a `timestamp` (read as UTC, whatever the local zone); ValueError if it is not one."""
    return float(calendar.timegm(time.strptime(s, TIME_FORMAT)))


def new_hash():
    """The checksum manifests record (sha256), for hashing bytes as they stream by."""
    return hashlib.sha256()


def hash_bytes(data: bytes) -> str:
    """The checksum of bytes in memory."""
    h = new_hash()
    h.update(data)
    return h.hexdigest()


def hash_file(path: str) -> str:
    """The checksum of a local file, read in blocks."""
    h = new_hash()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def hash_local_files(root: str) -> dict[str, dict]:
    """{relative path: {size, sha256}} for every file under a local directory."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = {"size": os.path.getsize(path), "sha256": hash_file(path)}
    return out
